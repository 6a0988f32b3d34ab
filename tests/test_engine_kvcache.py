"""The paged KV cache end to end, on tiny real models: what it changes must not change the tokens.

Preemption and recomputation, prefix caching on or off: greedy outputs stay the same token for
token. The counters behind ``LLM.stats()`` report what happened, and configurations or prompts
the cache could never serve are refused up front, leaving the engine usable.
"""

import random

import pytest
import torch

from nanoengine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and then a busy machine cannot make them crawl
    (with every core taken, OpenMP's threads wait on each other at every matmul)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 20000) for _ in range(length + i)] for i in range(n)]


def make_llm(path: str, **kwargs) -> LLM:
    return LLM(path, dtype="float32", **kwargs)


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["kvcache_blocks_in_use"] == 0  # every block back in the pool
    return [out["token_ids"] for out in outputs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_forced_preemption_gives_same_greedy_tokens_as_a_large_cache(tiny_models, arch):
    prompts = random_prompts(4, 9, seed=1)  # up to 12 + 16 tokens each: 7 blocks of 4
    tiny = make_llm(tiny_models[arch], num_kvcache_blocks=8, kvcache_block_size=4, max_model_len=32)
    large = make_llm(tiny_models[arch], num_kvcache_blocks=64, kvcache_block_size=4, max_model_len=32)
    assert generate(tiny, prompts) == generate(large, prompts)
    assert tiny.stats()["num_preemptions"] > 0
    assert large.stats()["num_preemptions"] == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_prefix_caching_on_and_off_give_same_greedy_tokens(tiny_models, arch):
    prefix = random_prompts(1, 13, seed=2)[0]  # three full blocks of 4, and one token
    tails = random_prompts(3, 2, seed=3)
    other_start = random_prompts(1, 4, seed=4)[0]
    # One batch: later prompts share the first's blocks. The last one has the prefix's second
    # block after a different first block: equal tokens, different K/V, never to be shared.
    first = [prefix + tail for tail in tails] + [other_start + prefix[4:] + tails[0]]
    second = [prefix[:8] + tail for tail in tails] + [prefix]  # after the first batch finished
    outputs = {}
    for caching in (True, False):
        llm = make_llm(tiny_models[arch], num_kvcache_blocks=32, kvcache_block_size=4, enable_prefix_caching=caching)
        outputs[caching] = generate(llm, first) + generate(llm, second)
        hits = llm.stats()["prefix_cache_hit_tokens"]
        assert hits > 0 if caching else hits == 0
    assert outputs[True] == outputs[False]


def test_prompts_sharing_a_prefix_report_cache_hits_for_the_shared_full_blocks(tiny_models):
    llm = make_llm(tiny_models["llama"], num_kvcache_blocks=32, kvcache_block_size=4)
    prefix = random_prompts(1, 10, seed=5)[0]  # two full blocks of 4, then 2 tokens
    generate(llm, [prefix + [1001, 1002, 1003]])
    assert llm.stats()["prefix_cache_hit_tokens"] == 0
    generate(llm, [prefix + [2001]])
    assert llm.stats()["prefix_cache_hit_tokens"] >= 8
    before = llm.stats()["prefix_cache_hit_tokens"]
    generate(llm, [prefix[:4] + [3001, 3002, 3003, 3004, 3005]])
    assert llm.stats()["prefix_cache_hit_tokens"] - before >= 4


def test_max_model_len_larger_than_the_cache_is_refused(tiny_models):
    path = tiny_models["llama"]
    with pytest.raises(ValueError, match="KV cache"):
        make_llm(path, num_kvcache_blocks=4, kvcache_block_size=4, max_model_len=17)
    llm = make_llm(path, num_kvcache_blocks=4, kvcache_block_size=4, max_model_len=16)  # exactly fits
    (completion,) = generate(llm, random_prompts(1, 16, seed=6))  # a prompt that fills the whole cache
    assert len(completion) == 1
    assert len(generate(llm, random_prompts(2, 5, seed=7))[1]) == 10  # 6 + 10 = 16 tokens


def test_prompt_longer_than_max_model_len_is_refused_and_the_engine_still_serves(tiny_models):
    llm = make_llm(tiny_models["llama"], num_kvcache_blocks=4, kvcache_block_size=4)
    assert llm.config.max_model_len == 16  # not given: clamped to what the cache holds
    ok, too_long = random_prompts(1, 6, seed=8)[0], random_prompts(1, 17, seed=9)[0]
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([ok, too_long], GREEDY, use_tqdm=False)
    assert not llm.has_unfinished_requests()  # the good prompt was not queued either
    assert llm.stats()["kvcache_blocks_in_use"] == 0
    outputs = llm.generate([ok], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(outputs[0]["token_ids"]) == 4 and outputs[0]["finish_reason"] == "length"
