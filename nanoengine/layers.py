"""Building blocks of the decoder that are neither attention nor projections (linear.py): the
RMSNorm (with the residual add folded in), the gated MLP's activation, and the rotary embedding.
Each computes in torch unless the model runner gives it a ``kernel`` that does the same in one
pass: C++ on CPU (cpu_kernels.py), Triton on a GPU (triton_layers.py). Learner mode keeps torch's.
"""

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm, optionally with the residual add before it (vLLM's fused_add_rms_norm).

    ``norm(x)`` returns RMSNorm(x). ``norm(x, residual)`` returns (RMSNorm(residual + x),
    residual + x): the decoder keeps a running residual sum, and adding into it is folded into
    the norm that reads it next. ``kernel`` does both in one pass (cpu_kernels.add_rms_norm,
    triton_layers.add_rms_norm); torch runs them as eight small ops.
    """

    kernel: Callable | None = None

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.kernel is not None:
            return self.kernel(x, residual, self.weight, self.eps)
        if residual is not None:
            x = residual = x + residual
        # Normalise in float32 (as HF does) so bf16 activations do not lose the small variance.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(x.dtype)
        return out if residual is None else (out, residual)


class SiluAndMul(nn.Module):
    """The gated MLP's activation: x is [gate | up], the result SiLU(gate) * up; ``kernel`` does it in
    one pass (cpu_kernels.silu_and_mul, triton_layers.silu_and_mul)."""

    kernel: Callable | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (the "rotate half" layout HF's Llama and Qwen use).

    cos/sin for every position up to ``max_position`` are computed once; each call looks up its
    tokens' rows by position, which is what lets prefill and decode share one code path. One
    instance serves every layer. ``kernel`` rotates q and k in one pass (cpu_kernels.rotary, in place;
    triton_layers.rotary); torch needs eleven small ops.
    ``llama3_scaling`` holds the factors of ``llama3_inv_freq`` (Llama 3.1/3.2), or is None for plain RoPE.
    """

    kernel: Callable | None = None

    def __init__(self, head_dim: int, max_position: int, base: float, llama3_scaling: dict | None = None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        if llama3_scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, **llama3_scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        # Full head width, with the rotation's sign folded into sin: see ``apply_rotary``.
        # A plain attribute, not a buffer: ``model.to(bfloat16)`` must not round the angles.
        self.cos_sin_cache = torch.cat([cos, cos, -sin, sin], dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k ``[num_tokens, heads, head_dim]``, each token's heads turned by its position's angles."""
        if self.kernel is not None:
            return self.kernel(positions, q, k, self.cos_sin_cache)
        cos, sin = self.cos_sin_cache[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1's long-context RoPE ("llama3" in HF's ``rope_parameters``).

    A pair whose wavelength is longer than ``original / low_freq_factor`` positions turned fewer
    than ``low_freq_factor`` times over the training context; it is slowed by ``factor``, so a
    context ``factor`` times longer turns it no further than training did. Pairs with a wavelength
    under ``original / high_freq_factor`` (local detail) are kept; in between the two blend,
    linearly in ``original / wavelength``.
    """
    wavelength = 2 * math.pi / inv_freq
    kept = (original_max_position_embeddings / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    kept = kept.clamp(0.0, 1.0)  # 0: slowed by factor, 1: unchanged
    return (1 - kept) * inv_freq / factor + kept * inv_freq


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x ``[num_tokens, heads, head_dim]``: pair i of its two halves turns by angle i.

    With cos = [c, c] and sin = [-s, s] this is [x1 c - x2 s, x2 c + x1 s], the same products HF
    forms, rounded in x's dtype as there (so bf16 matches HF bit for bit), in four tensor ops.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([x2, x1], dim=-1) * sin
