"""Write this step's new keys and values into the paged KV cache.

Where it sits: each attention layer calls `store_kvcache` once per step, after the qkv projection
and rotary embedding and before attending, so that the attention kernel finds this step's tokens
in the same paged cache as all earlier ones. The scheduler has already chosen where every token
goes: `slot_mapping[i] = block_id * block_size + offset` names the cache row of token i, and -1
marks a padding row (a batch padded up to a captured CUDA-graph size) that must write nothing.

One contract, three kernels, all writing the same bytes: `store_kvcache_torch` here, plain
indexing, for learner mode and the pure-torch backend on CPU; `store_kvcache_triton`
(triton_store_kvcache.py), one Triton program per token, for the GPU; and on CPU otherwise a C++
kernel (cpu_kernels.py).

An 8-bit cache (``kv_cache_dtype``, kv_cache_dtype.py) stores ``key / k_scale`` and ``value /
v_scale`` rounded to its fp8 format, the bytes ``kv_cache_dtype.quantize`` gives, by each kernel.
"""

from __future__ import annotations

import torch

from nanoengine.kv_cache_dtype import is_fp8, quantize


def store_kvcache_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                        v_scale: float = 1.0) -> None:
    """Copy key/value `[num_tokens, num_kv_heads, head_dim]` (any strides) into the caches
    `[num_blocks, block_size, num_kv_heads, head_dim]` at the rows named by `slot_mapping`.

    Dropping the padding rows with a boolean mask gives a tensor whose size depends on the data:
    free on the CPU, but on a GPU it costs a device-to-host sync and cannot be graph-captured,
    which is one reason the GPU path uses the Triton kernel instead.
    """
    num_kv_heads, head_dim = k_cache.shape[2:]
    valid = slot_mapping >= 0
    if not valid.all():
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    slots = slot_mapping.long()
    if is_fp8(k_cache.dtype):  # index_copy_ has no fp8 kernel: the same bytes, as uint8
        key, value = (quantize(x, scale, k_cache.dtype).view(torch.uint8) for x, scale in
                      ((key, k_scale), (value, v_scale)))
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)
