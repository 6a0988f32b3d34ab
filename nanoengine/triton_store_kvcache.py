"""store_kvcache.py's contract as a Triton kernel, for the GPU: one program per token writes its
keys and values at ``slot_mapping``'s row, and a padding row (slot -1) returns at once, so nothing
depends on the data and the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from nanoengine.kv_cache_dtype import inverse_scale
from nanoengine.triton_fp8 import fp8_format, to_fp8
from nanoengine.triton_jit import jit, tl, triton


def _store_kvcache_kernel(key_ptr, key_stride_t, key_stride_h, key_stride_d,
                          value_ptr, value_stride_t, value_stride_h, value_stride_d,
                          k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_inverse_scale, v_inverse_scale,
                          HEAD_DIM: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr, FMT: tl.constexpr,
                          TO_FP8: tl.constexpr):
    # int64 so that token * stride and slot * ROW cannot overflow on a large cache.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    # One token's ROW = num_kv_heads * head_dim values; tl.arange needs a power of two, so
    # round up and mask (e.g. 3 heads * 64 = 192 -> 256).
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    key = tl.load(key_ptr + token * key_stride_t + head * key_stride_h + dim * key_stride_d,
                  mask=mask)
    value = tl.load(value_ptr + token * value_stride_t + head * value_stride_h
                    + dim * value_stride_d, mask=mask)
    if FMT:  # an 8-bit cache, as bytes: each value's fp8 code (triton_fp8.py)
        key = TO_FP8(key.to(tl.float32) * k_inverse_scale, FMT)
        value = TO_FP8(value.to(tl.float32) * v_inverse_scale, FMT)
    tl.store(k_cache_ptr + slot * ROW + offs, key, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, value, mask=mask)


def store_kvcache_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                         v_scale: float = 1.0) -> None:
    """Same contract as `store_kvcache_torch`, with no host sync: padding rows are skipped
    inside the kernel, so the launch can be captured in a CUDA graph."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and slot_mapping.shape == (num_tokens,)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.shape[2:] == (num_kv_heads, head_dim)
    row, fmt = num_kv_heads * head_dim, fp8_format(k_cache.dtype)
    if fmt:  # Triton's own e4m3 type needs sm_89: the kernel writes the codes as bytes
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    jit(_store_kvcache_kernel)[(num_tokens,)](
        key, *key.stride(), value, *value.stride(), k_cache, v_cache, slot_mapping, inverse_scale(k_scale),
        inverse_scale(v_scale), HEAD_DIM=head_dim, ROW=row, BLOCK=triton.next_power_of_2(row), FMT=fmt,
        TO_FP8=jit(to_fp8) if fmt else None)
