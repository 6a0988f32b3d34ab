"""Rotary position embedding: plain RoPE, Llama 3's scaled frequencies, linear scaling, Phi-3's
LongRoPE and a partial rotary, all as one cos/sin table indexed by position. Torch computes it
unless the model runner gives it a one-pass ``kernel`` (cpu_kernels.rotary, triton_layers.rotary).
"""

import math
from typing import Callable

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (the "rotate half" layout HF's Llama and Qwen use).

    cos/sin for every position up to ``max_position`` are computed once; each call looks up its
    tokens' rows by position, which is what lets prefill and decode share one code path. One
    instance serves every layer. ``kernel`` rotates q and k in one pass (cpu_kernels.rotary, in place;
    triton_layers.rotary); torch needs eleven small ops.
    ``llama3_scaling`` holds the factors of ``llama3_inv_freq`` (Llama 3.1/3.2), or is None for plain RoPE;
    ``linear_factor`` slows every pair by one factor ("linear" in HF's ``rope_parameters``, Gemma 3's global
    layers); ``longrope`` holds the arguments of ``longrope_angles`` (Phi-3). With ``rotary_dim`` under
    head_dim (Phi-4-mini's partial rotary) only each head's first ``rotary_dim`` values turn, in torch: the
    kernels turn whole heads.
    """

    kernel: Callable | None = None

    def __init__(self, head_dim: int, max_position: int, base: float, llama3_scaling: dict | None = None,
                 linear_factor: float = 1.0, longrope: dict | None = None, rotary_dim: int | None = None):
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        wavelengths = base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim)
        positions, scale = torch.arange(max_position, dtype=torch.float), 1.0
        if longrope is not None:
            freqs, scale = longrope_angles(positions, wavelengths, **longrope)
        else:
            inv_freq = 1.0 / wavelengths / linear_factor
            if llama3_scaling is not None:
                inv_freq = llama3_inv_freq(inv_freq, **llama3_scaling)
            freqs = torch.outer(positions, inv_freq)
        cos, sin = freqs.cos() * scale, freqs.sin() * scale
        # Full head width, with the rotation's sign folded into sin: see ``apply_rotary``.
        # A plain attribute, not a buffer: ``model.to(bfloat16)`` must not round the angles.
        self.cos_sin_cache = torch.cat([cos, cos, -sin, sin], dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k ``[num_tokens, heads, head_dim]``, each token's heads turned by its position's angles."""
        d = self.rotary_dim
        if self.kernel is not None and d == q.shape[-1]:
            return self.kernel(positions, q, k, self.cos_sin_cache)
        cos, sin = self.cos_sin_cache[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
        if d < q.shape[-1]:  # the rest of each head passes unturned
            return (torch.cat([apply_rotary(q[..., :d], cos, sin), q[..., d:]], dim=-1),
                    torch.cat([apply_rotary(k[..., :d], cos, sin), k[..., d:]], dim=-1))
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def longrope_angles(positions: torch.Tensor, wavelengths: torch.Tensor, short_factor: tuple[float, ...],
                    long_factor: tuple[float, ...], original_max_position_embeddings: int,
                    attention_factor: float) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE ("longrope"): each pair's wavelength stretched by its own factor, the short
    factors within the original context and the long ones past it, and cos/sin scaled by
    ``attention_factor``. HF switches to the long factors for a whole sequence once it is longer than
    the original context (recomputing its cache); here a position's factors follow from the position
    alone, so a cached key never changes: the two agree for every sequence within the original context."""
    angles = [torch.outer(positions, 1.0 / (torch.tensor(factors) * wavelengths))
              for factors in (short_factor, long_factor)]
    return torch.where(positions[:, None] < original_max_position_embeddings, *angles), attention_factor


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
