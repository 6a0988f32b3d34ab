"""Learner mode (``LLM(learner_mode=True)``): pure torch everywhere, the same tokens as the default path."""

import pytest
import torch

from nanoengine import LLM, SamplingParams
from nanoengine.linear import Linear
from nanoengine.store_kvcache import store_kvcache_torch
from nanoengine.torch_attention import flash_attn_with_kvcache_plain, flash_attn_with_kvcache_torch


def paged_case(dtype, seqlen_q, seed=0):
    """A shuffled paged cache, grouped-query heads, and sequences of assorted lengths (one empty)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks, block_size, num_heads, num_kv_heads, head_dim = 24, 4, 6, 2, 16
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    lens = [5, 1, 0, 16, 11]
    order = torch.randperm(num_blocks, generator=g)
    block_table = order[:len(lens) * 4].view(len(lens), 4).to(torch.int32)  # 4 blocks each, partly used
    q = torch.randn(len(lens), seqlen_q, num_heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, torch.tensor(lens, dtype=torch.int32), block_table


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("seqlen_q, causal", [(1, True), (1, False), (2, True)])
def test_plain_decode_reference_matches_the_tuned_fallback(dtype, atol, seqlen_q, causal):
    q, k_cache, v_cache, lens, block_table = paged_case(dtype, seqlen_q)
    lens = lens.clamp(min=0)
    if seqlen_q > 1:  # every non-empty sequence has at least seqlen_q keys
        lens = torch.where(lens > 0, lens.clamp(min=seqlen_q), lens)
    plain = flash_attn_with_kvcache_plain(q, k_cache, v_cache, lens, block_table, causal=causal)
    tuned = flash_attn_with_kvcache_torch(q, k_cache, v_cache, lens, block_table, causal=causal)
    torch.testing.assert_close(plain, tuned, atol=atol, rtol=0)
    assert plain[2].abs().max() == 0  # the empty row


def test_plain_decode_reference_reads_keys_through_the_block_table():
    """Against dense attention over the keys laid out in order: the block table is the only link."""
    q, k_cache, v_cache, lens, block_table = paged_case(torch.float32, 1)
    out = flash_attn_with_kvcache_plain(q, k_cache, v_cache, lens, block_table, causal=True)
    b, n = 3, int(lens[3])
    k = torch.cat([k_cache[i] for i in block_table[b].tolist()])[:n].repeat_interleave(3, dim=1)
    v = torch.cat([v_cache[i] for i in block_table[b].tolist()])[:n].repeat_interleave(3, dim=1)
    probs = (torch.einsum("hd,khd->hk", q[b, 0], k) * 16 ** -0.5).softmax(-1)
    torch.testing.assert_close(out[b, 0], torch.einsum("hk,khd->hd", probs, v), atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_learner_mode_gives_the_default_paths_greedy_tokens(tiny_models, arch):
    prompts = ["The capital of France is", "The capital of France is a city", "Once upon a time"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    common = dict(dtype="float32", device="cpu", kvcache_block_size=4, num_kvcache_blocks=12)  # preempts
    default = LLM(tiny_models[arch], **common)
    learner = LLM(tiny_models[arch], learner_mode=True, **common)
    expected = [o["token_ids"] for o in default.generate(prompts, params, use_tqdm=False)]
    assert [o["token_ids"] for o in learner.generate(prompts, params, use_tqdm=False)] == expected
    assert learner.stats()["num_preemptions"] > 0 and learner.stats()["prefix_cache_hit_tokens"] > 0


def test_learner_mode_runs_no_cpu_kernel_and_keeps_plain_weights(tiny_models):
    llm = LLM(tiny_models["llama"], learner_mode=True, dtype="bfloat16", device="cpu", num_kvcache_blocks=16)
    modules = list(llm.model_runner.model.modules())
    assert all(getattr(m, "kernel", None) is None for m in modules)
    assert llm.model_runner.sampler.library is None  # sampling through the torch ops too
    assert all(m.weight is not None for m in modules if isinstance(m, Linear))
    backend = llm.model_runner.attention_layers[0].backend
    assert backend.store_kvcache is store_kvcache_torch
    assert backend.flash_attn_with_kvcache is flash_attn_with_kvcache_plain


def test_learner_mode_must_be_a_bool(tiny_models):
    with pytest.raises(ValueError, match="learner_mode"):
        LLM(tiny_models["llama"], learner_mode="yes")


@pytest.mark.parametrize("kernels", ["flash-attn", "triton", "torch"])
def test_learner_mode_on_cuda_stores_kv_through_torch_too(kernels):
    """Learner mode runs no graphs, so on CUDA too the store is the torch one a debugger steps into."""
    from nanoengine.attention import get_backend
    backend = get_backend(kernels, torch.device("cuda"), learner_mode=True)
    assert backend.store_kvcache is store_kvcache_torch
    assert backend.flash_attn_with_kvcache is flash_attn_with_kvcache_plain
