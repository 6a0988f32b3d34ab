"""Sizing the KV cache on a GPU, with faked memory figures: the cache never over-commits.

The figures are what ``_kvcache_blocks_for_budget`` reads after its warm-up: the device's total
and free memory, what PyTorch's allocator has reserved, and this process's peak of tensors.
"""

import pytest
import torch

from nanoengine import LLM
from nanoengine import model_runner
from nanoengine.config import kvcache_budget_bytes, warmup_lengths

GiB = 1 << 30
TOTAL = 80 * GiB
CONTEXT = GiB // 2  # the CUDA context and library workspaces: outside PyTorch's allocator
WEIGHTS, ACTIVATIONS = 2 * GiB, 3 * GiB


def budget(other_processes: int = 0, graph_pool: int = 0, utilization: float = 0.9) -> int:
    """After the warm-up, empty_cache has handed the activations back: the allocator holds the weights."""
    free = TOTAL - CONTEXT - other_processes - WEIGHTS
    return kvcache_budget_bytes(TOTAL, free, torch_reserved=WEIGHTS, torch_peak=WEIGHTS + ACTIVATIONS,
                                graph_pool=graph_pool, utilization=utilization)


def test_budget_is_our_share_less_context_weights_and_activations():
    assert budget() == int(0.9 * TOTAL) - CONTEXT - WEIGHTS - ACTIVATIONS


def test_a_process_already_using_part_of_the_gpu_shrinks_the_budget_to_fit():
    alone, shared = budget(), budget(other_processes=30 * GiB)
    assert alone - shared == 30 * GiB
    # Everything the device will hold once the cache exists fits in our share of it.
    peak_use = CONTEXT + 30 * GiB + WEIGHTS + ACTIVATIONS + shared
    assert peak_use <= 0.9 * TOTAL


def test_room_is_kept_for_the_cuda_graph_pool():
    assert budget() - budget(graph_pool=ACTIVATIONS) == ACTIVATIONS


def test_a_gpu_already_full_leaves_no_budget():
    assert budget(other_processes=70 * GiB) < 0


@pytest.mark.parametrize("num_tokens, max_num_seqs, max_model_len", [
    (8192, 256, 4096), (8192, 1, 4096), (300, 512, 300), (16384, 256, 2048), (1000, 7, 1000)])
def test_warmup_is_the_largest_step_the_scheduler_can_form(num_tokens, max_num_seqs, max_model_len):
    lengths = warmup_lengths(num_tokens, max_num_seqs, max_model_len)
    assert sum(lengths) == num_tokens and max(lengths) <= max_model_len and min(lengths) >= 1
    assert len(lengths) >= min(max_num_seqs, num_tokens)  # a logit row for every sequence a step may hold


def test_model_is_created_in_its_final_dtype(tiny_models, monkeypatch):
    """bf16 parameters from the start (no float32 copy at twice the size), rotary angles still
    float32, and the process's default dtype left as it was."""
    seen = {}

    def check_then_load(model, path, **kwargs):
        seen["dtypes"] = {p.dtype for p in model.parameters()}
        load_weights(model, path, **kwargs)

    load_weights = model_runner.load_weights
    monkeypatch.setattr(model_runner, "load_weights", check_then_load)
    llm = LLM(tiny_models["qwen3"], dtype="bfloat16", max_model_len=64)
    assert seen["dtypes"] == {torch.bfloat16}
    rotary = llm.model_runner.model.model.layers[0].self_attn.rotary_emb
    assert rotary.cos_sin_cache.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32


def test_warmup_runs_the_worst_case_step_and_writes_nothing_to_the_cache(tiny_models):
    runner = LLM(tiny_models["llama"], dtype="float32", max_model_len=64, max_num_seqs=4).model_runner
    before = runner.kv_cache.clone()
    runner.warmup(warmup_lengths(200, 4, 64))  # four prompts of 50 tokens
    assert torch.equal(runner.kv_cache, before)


def test_building_the_engine_draws_nothing_from_the_global_rng(tiny_models):
    """Every weight comes from the checkpoint, so none is drawn at random first: a caller's seeded
    torch RNG gives the same numbers whether an engine was built in between or not."""
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    LLM(tiny_models["llama"], dtype="float32", max_model_len=64)
    assert torch.equal(torch.rand(4), expected)


def test_a_cpu_kv_cache_starts_zeroed_where_freed_memory_held_nan(tiny_models):
    """The cache's memory is fresh from the kernel, not reused from a freed tensor of NaNs of the
    same size (which the heap would hand straight back, as ``keep_freed_memory_for_reuse`` keeps it)."""
    kwargs = dict(dtype="float32", max_model_len=64, num_kvcache_blocks=64)
    runner = LLM(tiny_models["llama"], **kwargs).model_runner
    shape = runner.kv_cache.shape
    del runner
    torch.full(shape, float("nan"))  # allocated and freed at once
    assert LLM(tiny_models["llama"], **kwargs).model_runner.kv_cache.eq(0).all()
