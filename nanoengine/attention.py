"""Attention over the paged KV cache, and the kernels behind it.

Each step, an attention layer first stores this step's keys and values into the cache through
the slot mapping, then attends: a prefill step over variable-length sequences packed into one
batch, a decode step with one query per sequence over its block table. Every backend has
flash-attn's signatures and semantics (the subset nanoengine uses), so the model never asks which
one runs:

- "flash-attn": flash-attn itself, on CUDA, with the Triton store (store_kvcache.py);
- "triton": the same two functions written in Triton (triton_attention.py), on CUDA where
  flash-attn is not installed, and on CPU tensors under Triton's interpreter for testing;
- "cpu": small C++ kernels (cpu_kernels.py), which fall back to the pure-torch functions where they
  cannot run;
- "torch": the pure-torch reference functions (torch_attention.py), on either device. Learner mode
  (``LLM(learner_mode=True)``) runs them too, decode through the plain per-sequence one.

``Config.attention_kernels`` picks one (``attention_backend="auto"``: flash-attn on CUDA where it is
installed, else Triton; the C++ kernels on CPU); ``get_backend`` builds it, once.
"""

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from nanoengine.context import Context
from nanoengine.cpu_kernels import flash_attn_varlen_func_cpu, flash_attn_with_kvcache_cpu, store_kvcache_cpu
from nanoengine.kv_cache_dtype import is_fp8
from nanoengine.store_kvcache import store_kvcache_torch
from nanoengine.torch_attention import (flash_attn_varlen_func_torch, flash_attn_with_kvcache_plain,
                                        flash_attn_with_kvcache_torch)
from nanoengine.triton_attention import flash_attn_varlen_func_triton, flash_attn_with_kvcache_triton
from nanoengine.triton_store_kvcache import store_kvcache_triton


@dataclass(frozen=True)
class AttentionBackend:
    store_kvcache: Callable
    flash_attn_varlen_func: Callable
    flash_attn_with_kvcache: Callable


def get_backend(kernels: str, device: torch.device, learner_mode: bool = False) -> AttentionBackend:
    """The functions of ``kernels`` ("flash-attn", "triton", "cpu" or "torch"; Config.attention_kernels)."""
    if learner_mode:  # pure torch on any device: no graphs run, so the torch store's host sync breaks nothing
        return AttentionBackend(store_kvcache_torch, flash_attn_varlen_func_torch, flash_attn_with_kvcache_plain)
    # Otherwise on CUDA the store is always Triton's: the torch store's mask syncs with the host, breaking graphs.
    store = store_kvcache_triton if device.type == "cuda" or kernels == "triton" else store_kvcache_torch
    if kernels == "cpu":
        return AttentionBackend(store_kvcache_cpu, flash_attn_varlen_func_cpu, flash_attn_with_kvcache_cpu)
    if kernels == "torch":
        return AttentionBackend(store, flash_attn_varlen_func_torch, flash_attn_with_kvcache_torch)
    if kernels == "triton":
        return AttentionBackend(store, flash_attn_varlen_func_triton, flash_attn_with_kvcache_triton)
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # Config checked it is installed
    return AttentionBackend(store, flash_attn_varlen_func, flash_attn_with_kvcache)


class Attention(nn.Module):
    """One layer's attention; the model runner binds its cache slices and backend.

    ``scale`` defaults to head_dim ** -0.5; ``sliding_window`` (HF's: a query sees itself and the
    ``sliding_window - 1`` keys before it, flash-attn's left window of ``sliding_window - 1``) and
    ``softcap`` are for the families that have them (model_families.py). The keys left of a window
    stay in the cache: attention only skips them.

    ``k_scale`` and ``v_scale`` are vLLM's per-tensor scales of an 8-bit cache (kv_cache_dtype.py):
    the store divides by them, attention multiplies (flash-attn 3's ``k_descale``, ``v_descale``).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 sliding_window: int | None = None, softcap: float = 0.0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale or head_dim ** -0.5
        self.window_size = (sliding_window - 1, 0) if sliding_window else (-1, -1)
        self.softcap = softcap
        self.k_cache = self.v_cache = torch.empty(0)
        self.k_scale = self.v_scale = 1.0
        self.backend = get_backend("cpu", torch.device("cpu"))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: Context) -> torch.Tensor:
        """q: [num_tokens, H, D], k and v: [num_tokens, Hk, D] -> [num_tokens, H, D]."""
        self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping, self.k_scale, self.v_scale)
        # Only an 8-bit cache passes its scales: flash-attn (2) has no such arguments, nor needs them.
        scales = dict(k_descale=self.k_scale, v_descale=self.v_scale) if is_fp8(self.k_cache.dtype) else {}
        if ctx.is_prefill:
            # Some prompt starts in the prefix cache (with an 8-bit cache, always: model_runner.py): read it back.
            if ctx.block_tables is not None:
                k, v = self.k_cache, self.v_cache
            else:
                scales = {}  # k and v themselves, in the model's dtype (the warm-up's step)
            return self.backend.flash_attn_varlen_func(
                q, k, v, cu_seqlens_q=ctx.cu_seqlens_q, cu_seqlens_k=ctx.cu_seqlens_k,
                max_seqlen_q=ctx.max_seqlen_q, max_seqlen_k=ctx.max_seqlen_k,
                softmax_scale=self.scale, causal=True, block_table=ctx.block_tables,
                window_size=self.window_size, softcap=self.softcap, **scales)
        out = self.backend.flash_attn_with_kvcache(
            q.unsqueeze(1), self.k_cache, self.v_cache, cache_seqlens=ctx.context_lens,
            block_table=ctx.block_tables, softmax_scale=self.scale, causal=True, window_size=self.window_size,
            softcap=self.softcap, **scales)
        return out.squeeze(1)
