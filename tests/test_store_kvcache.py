"""store_kvcache: every kernel writes exactly the bytes the reference writes, and nothing else.

The Triton kernel runs twice: on CPU tensors under Triton's interpreter (everywhere), and compiled
on a GPU (marked ``cuda``): conftest's ``triton_device``.
"""

import pytest
import torch

from nanoengine import cpu_kernels, cpu_library
from nanoengine.store_kvcache import store_kvcache_torch
from nanoengine.triton_store_kvcache import store_kvcache_triton

NUM_BLOCKS, BLOCK_SIZE, NUM_TOKENS = 6, 8, 24  # small: the interpreter is slow


@pytest.fixture(params=["torch", "cpu_kernel"])
def store_on_cpu(request):
    if request.param == "torch":
        return store_kvcache_torch
    assert cpu_library.load("cpu_attention.cpp", 64) is not None, "the CPU kernels did not build"
    return cpu_kernels.store_kvcache_cpu


def make_case(num_kv_heads: int, head_dim: int, dtype: torch.dtype, layout: str = "contiguous",
              slot_dtype: torch.dtype = torch.int32, device: str = "cpu", seed: int = 0):
    """Random caches, key/value in the given memory layout, and a slot mapping to distinct
    slots in which every fifth token is a padding row (-1)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:  # cast before slicing, so views stay views
        return torch.randn(shape, generator=gen).to(device, dtype)

    shape = (NUM_TOKENS, num_kv_heads, head_dim)
    if layout == "contiguous":
        key, value = rand(*shape), rand(*shape)
    elif layout == "fused_qkv":  # key/value sliced out of a qkv projection output, as in a model
        num_q_heads = 2 * num_kv_heads
        qkv = rand(NUM_TOKENS, (num_q_heads + 2 * num_kv_heads) * head_dim)
        _, key, value = qkv.split([num_q_heads * head_dim, *2 * [num_kv_heads * head_dim]], -1)
        key, value = key.view(shape), value.view(shape)
    elif layout == "transposed":  # head_dim is not the fastest-moving axis
        key = rand(NUM_TOKENS, head_dim, num_kv_heads).transpose(1, 2)
        value = rand(num_kv_heads, NUM_TOKENS, head_dim).transpose(0, 1)
    assert layout == "contiguous" or not (key.is_contiguous() or value.is_contiguous())
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    slot_mapping = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:NUM_TOKENS]
    slot_mapping[::5] = -1
    return key, value, rand(*cache_shape), rand(*cache_shape), slot_mapping.to(device, slot_dtype)


def store_with_python_loop(key, value, k_cache, v_cache, slot_mapping) -> None:
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = key[token]
            v_cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = value[token]


def assert_triton_matches_torch(case) -> None:
    key, value, k_cache, v_cache, slot_mapping = case
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kvcache_torch(key, value, expected_k, expected_v, slot_mapping)
    store_kvcache_triton(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


# The CPU kernel copies rows of bytes: it takes the contiguous and fused-qkv layouts (rows of one
# token's heads, token strides of any size) and hands a transposed one to the torch code.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("layout", ["contiguous", "fused_qkv", "transposed"])
def test_cpu_stores_match_python_loop_reference(store_on_cpu, layout, slot_dtype, dtype):
    key, value, k_cache, v_cache, slot_mapping = make_case(3, 64, dtype, layout, slot_dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_with_python_loop(key, value, expected_k, expected_v, slot_mapping)
    store_on_cpu(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_store_matches_torch_for_non_power_of_two_heads(triton_device, dtype):
    assert_triton_matches_torch(make_case(3, 64, dtype, device=triton_device))  # row of 192 values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_store_matches_torch_for_power_of_two_heads(triton_device, dtype):
    assert_triton_matches_torch(make_case(4, 32, dtype, slot_dtype=torch.int64, device=triton_device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["fused_qkv", "transposed"])
def test_triton_store_matches_torch_for_non_contiguous_key_value(triton_device, layout, dtype):
    assert_triton_matches_torch(make_case(3, 64, dtype, layout, device=triton_device))


def test_padding_rows_write_nothing_on_cpu(store_on_cpu):
    assert_padding_rows_write_nothing(store_on_cpu)


def test_padding_rows_write_nothing_in_triton(triton_device):
    assert_padding_rows_write_nothing(store_kvcache_triton, triton_device)


def assert_padding_rows_write_nothing(store, device: str = "cpu") -> None:
    key, value, k_cache, v_cache, slot_mapping = make_case(3, 64, torch.float32, device=device)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    store(key, value, k_cache, v_cache, torch.full_like(slot_mapping, -1))
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)
    # With real slots too, only the named rows change: padded tokens land nowhere.
    store(key, value, k_cache, v_cache, slot_mapping)
    untouched = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool, device=device)
    untouched[slot_mapping[slot_mapping >= 0].long()] = False
    assert torch.equal(k_cache.flatten(0, 1)[untouched], before_k.flatten(0, 1)[untouched])
    assert torch.equal(v_cache.flatten(0, 1)[untouched], before_v.flatten(0, 1)[untouched])
