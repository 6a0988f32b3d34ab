"""The gated MLP's activations: x is [gate | up] (gate_up_proj's output), the result act(gate) * up.
SiLU (Llama, Qwen, Mistral, Phi) takes a one-pass ``kernel`` from the model runner, as RMSNorm
does; Gemma's GeLU-tanh runs in torch.
"""

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class GeluTanhAndMul(nn.Module):
    """Gemma's gated MLP activation: x is [gate | up], the result GeLU(gate) * up, GeLU with its tanh
    approximation (HF's "gelu_pytorch_tanh")."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class SiluAndMul(nn.Module):
    """The gated MLP's activation: x is [gate | up], the result SiLU(gate) * up; ``kernel`` does it in
    one pass (cpu_kernels.silu_and_mul, triton_layers.silu_and_mul)."""

    kernel: Callable | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
