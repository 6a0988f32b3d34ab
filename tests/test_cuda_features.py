"""What a request can ask for gives on a GPU what it gives on the CPU.

The rest of the suite runs these features on the CPU only; on CUDA the sampler takes torch's ops
instead of cpu_sampler.cpp, the logits processors' tensors and masks are moved to the GPU, decode
and verification replay CUDA graphs, and attention is Triton's. So one batch that mixes them runs on
both devices in float32 (where a tiny model's greedy choices are far apart next to the rounding
differences of two kernels) and must give the same tokens, texts, finish reasons and logprobs;
then the same for beam search, and for ngram speculation with chunked prefill and preemption.
"""

import pytest
import torch

from nanoengine.llm import LLM
from nanoengine.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from tests.conftest import OracleProposer, installed

pytestmark = pytest.mark.cuda

PROMPTS = ["The engine reads", "A paged cache holds", "Tokens are", "Blocks of sixteen", "Prefill then decode",
           "The scheduler", "Speculation drafts", "One request"]


def mixed_params(tokenizer_vocab: int) -> list[SamplingParams]:
    """One request for each option; the grammars' only where llguidance is installed."""
    greedy = dict(temperature=0, max_tokens=24)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    grammars = [StructuredOutputsParams(choice=["yes", "no", "maybe"]), StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"),
                StructuredOutputsParams(json=schema)] if installed("llguidance") else []
    return [
        SamplingParams(**greedy, logprobs=3, prompt_logprobs=2),
        SamplingParams(**greedy, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5),
        SamplingParams(**greedy, logit_bias={5: 4.0, 7: -100.0}, allowed_token_ids=list(range(5, tokenizer_vocab, 3))),
        SamplingParams(**greedy, bad_words=["the", "a"], min_tokens=6, stop=[" of"], include_stop_str_in_output=True),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.02, seed=7, n=3, max_tokens=24, logprobs=1),
    ] + [SamplingParams(**greedy, structured_outputs=grammar) for grammar in grammars]


def check_same(cpu: list[dict], cuda: list[dict]) -> None:
    for i, (a, b) in enumerate(zip(cpu, cuda)):
        for sa, sb in zip(a["outputs"], b["outputs"], strict=True):
            assert sb["token_ids"] == sa["token_ids"], f"request {i}: CUDA chose other tokens"
            assert (sb["text"], sb["finish_reason"], sb["stop_reason"]) == (sa["text"], sa["finish_reason"], sa["stop_reason"])
            assert sb["cumulative_logprob"] == pytest.approx(sa["cumulative_logprob"], abs=1e-3)
            for la, lb in zip(sa["logprobs"] or [], sb["logprobs"] or [], strict=True):
                assert la.keys() == lb.keys() and all(lb[t] == pytest.approx(la[t], abs=1e-3) for t in la)
        for la, lb in zip(a["prompt_logprobs"] or [], b["prompt_logprobs"] or [], strict=True):
            assert (la is None) == (lb is None)
            assert la is None or all(lb[t] == pytest.approx(la[t], abs=1e-3) for t in la)


def both(model: str, run, **kwargs) -> tuple:
    return tuple(run(LLM(model, dtype="float32", device=device, **kwargs)) for device in ("cpu", "cuda"))


def test_a_batch_mixing_every_request_option_gives_the_cpus_results(tiny_models):
    def run(llm: LLM) -> list[dict]:
        params = mixed_params(llm.vocab_size)
        return llm.generate(PROMPTS[:len(params)], params, use_tqdm=False)

    cpu, cuda = both(tiny_models["qwen3"], run)
    check_same(cpu, cuda)
    if len(cuda) == len(PROMPTS):
        assert cuda[5]["text"] in ("yes", "no", "maybe") and cuda[7]["text"].startswith('{"n":')


def test_beam_search_gives_the_cpus_beams(tiny_models):
    cpu, cuda = both(tiny_models["llama"], lambda llm: llm.beam_search(PROMPTS[:3], BeamSearchParams(beam_width=4, max_tokens=12)))
    for a, b in zip(cpu, cuda):
        assert [s["token_ids"] for s in b["sequences"]] == [s["token_ids"] for s in a["sequences"]]


def test_speculation_with_chunked_prefill_and_preemption_gives_the_cpus_tokens(tiny_models):
    """Few KV blocks preempt sequences for recompute, chunks of 32 tokens split the longer prompts, and
    on CUDA the drafts come from the CPU's completions, wrong at every third position, so that runs
    of them are accepted, cut short and refused."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 500, (n,), generator=gen).tolist() * 2 for n in (20, 45, 60, 9, 33, 70)]
    options = dict(dtype="float32", num_kvcache_blocks=28, max_num_batched_tokens=32, enable_chunked_prefill=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    cpu = LLM(tiny_models["qwen2"], device="cpu", **options).generate(prompts, greedy, use_tqdm=False)
    llm = LLM(tiny_models["qwen2"], device="cuda", **options)
    llm.proposer = OracleProposer(prompts, [o["token_ids"] for o in cpu])
    cuda = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o["token_ids"] for o in cuda] == [o["token_ids"] for o in cpu]
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
