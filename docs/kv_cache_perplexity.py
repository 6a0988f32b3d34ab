"""Perplexity with each KV cache dtype: ``python docs/kv_cache_perplexity.py [--model M] [--dtype D]``.

The text is the evaluation text of the tests (tests/data/perplexity_text.md, the README's opening,
about 1,000 tokens), teacher-forced in one request (``prompt_logprobs``): each token's probability
given the ones before it. With an 8-bit cache every step attends over the cache's 8-bit keys and
values (model_runner.py), so this prefill reads them as the decode steps would. Prints one line per
``kv_cache_dtype``: perplexity and its difference from ``auto``'s.
"""

import argparse
import math
import time
from pathlib import Path

from nanoengine import LLM, SamplingParams

TEXT = Path(__file__).parent.parent / "tests" / "data" / "perplexity_text.md"


def perplexity(llm: LLM, token_ids: list[int]) -> float:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0]
    nll = -sum(lp[t] for lp, t in zip(out["prompt_logprobs"][1:], token_ids[1:])) / (len(token_ids) - 1)
    return math.exp(nll)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    base = None
    for kv_cache_dtype in ("auto", "fp8", "fp8_e5m2"):
        start = time.perf_counter()
        llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=1024, kv_cache_dtype=kv_cache_dtype)
        token_ids = llm.tokenizer.encode(TEXT.read_text())
        ppl = perplexity(llm, token_ids)
        base = base or ppl
        print(f"{kv_cache_dtype:9} {len(token_ids)} tokens  perplexity {ppl:.3f}  {100 * (ppl / base - 1):+.2f}%  "
              f"dtype {llm.config.torch_dtype}, cache {llm.stats()['kvcache_tokens']} tokens "
              f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
