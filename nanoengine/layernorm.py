"""The decoder's RMSNorms, with the residual add folded in (vLLM's fused_add_rms_norm): Llama's, and
Gemma's (1 + weight). Llama's computes in torch unless the model runner gives it a ``kernel`` that
does the same in one pass: C++ on CPU (cpu_kernels.py), Triton on a GPU (triton_layers.py); learner
mode keeps torch's. Gemma's has no such kernel (the runners bind kernels by exact type).
"""

from typing import Callable

import torch
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


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: it scales by (1 + weight), in float32, and rounds once at the end (HF's
    Gemma2RMSNorm), where Llama's rounds before the weight. Same calls as ``RMSNorm``. The mean
    square is taken as a vector norm's square over n, whose op a CPU graph can replay (cpu_graph.py
    finds no ``out=`` form for ``mean.dim``); it differs from HF's mean in the last bit at most."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = residual = x + residual
        x32 = x.float()
        mean_square = torch.linalg.vector_norm(x32, dim=-1, keepdim=True).square() / x.shape[-1]
        out = x32 * torch.rsqrt(mean_square + self.eps) * (1.0 + self.weight.float())
        out = out.to(x.dtype)
        return out if residual is None else (out, residual)
