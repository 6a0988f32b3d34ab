"""Chunked prefill on tiny real models: the same greedy tokens as prefill-first.

With ``enable_chunked_prefill`` a step holds running sequences' decode tokens and chunks of new
prompts. Each chunk's queries must line up with their keys (a chunk's first query sits at position
``num_computed_tokens``, after keys read back from the cache), across block boundaries, beside
prefix-cache hits and after preemptions; any misalignment changes the logits and, with these
decisive random models, the greedy tokens.
"""

import random

import pytest
import torch

from nanoengine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def prompts_with_shared_prefixes(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1000, 20000) for _ in range(10)]  # two full blocks of 4 and half of one
    own = [[rng.randrange(1000, 20000) for _ in range(rng.randrange(1, 15))] for _ in range(6)]
    return [prefix + tail for tail in own[:4]] + own[4:]


def staggered(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    """Prompts arriving one per step, so that new prompts meet running decodes."""
    seqs = []
    for prompt in prompts:
        seqs.append(llm.requests[llm.add_request(prompt, params)])
        llm.step()
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.stats()["kvcache_blocks_in_use"] == 0
    return [seq.completion_token_ids for seq in seqs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_chunked_prefill_gives_prefill_firsts_greedy_tokens_with_cached_prefixes(tiny_models, arch):
    prompts = prompts_with_shared_prefixes(seed=1)
    common = dict(dtype="float32", kvcache_block_size=4, num_kvcache_blocks=64, max_model_len=64)
    reference = staggered(LLM(tiny_models[arch], **common), prompts)
    # A budget of 7: chunks start and end inside blocks, and most steps mix decodes with a chunk.
    chunked = LLM(tiny_models[arch], enable_chunked_prefill=True, max_num_batched_tokens=7, **common)
    assert staggered(chunked, prompts) == reference
    stats = chunked.stats()
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["prefill_steps"] > len(prompts)  # prompts were split over several steps


def test_chunked_prefill_under_forced_preemption_gives_the_same_greedy_tokens(tiny_models):
    prompts = prompts_with_shared_prefixes(seed=2)
    common = dict(dtype="float32", kvcache_block_size=4, max_model_len=32)
    reference = staggered(LLM(tiny_models["llama"], num_kvcache_blocks=64, **common), prompts)
    small = LLM(tiny_models["llama"], num_kvcache_blocks=10, enable_chunked_prefill=True,
                max_num_batched_tokens=9, **common)
    assert staggered(small, prompts) == reference
    assert small.stats()["num_preemptions"] > 0


def test_chunked_prefill_serves_a_prompt_longer_than_the_step_budget(tiny_models):
    prompt = prompts_with_shared_prefixes(seed=3)[0] * 3
    common = dict(dtype="float32", kvcache_block_size=4, num_kvcache_blocks=64, max_model_len=64)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(tiny_models["qwen2"], max_num_batched_tokens=16, **common)  # without chunks it could never run
    chunked = LLM(tiny_models["qwen2"], enable_chunked_prefill=True, max_num_batched_tokens=16, **common)
    reference = LLM(tiny_models["qwen2"], **common)
    assert (chunked.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"]
            == reference.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"])


def test_chunked_prefill_defaults_to_a_small_step_budget_on_cpu_and_is_the_servers_default():
    from nanoengine.config import Config
    from nanoengine.serve_cli_args import engine_options, make_parser
    chunked, first = Config(enable_chunked_prefill=True, device="cpu"), Config(device="cpu")
    for config in (chunked, first):
        config.resolve_limits(2048)
        config.fit_to_kvcache(1000, 16)
    assert chunked.max_num_batched_tokens == 256 and first.max_num_batched_tokens == 8192
    assert engine_options(make_parser().parse_args([]))["enable_chunked_prefill"] is True
    assert engine_options(make_parser().parse_args(["--no-enable-chunked-prefill"]))["enable_chunked_prefill"] is False
