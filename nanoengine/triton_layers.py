"""The decoder's small layers as Triton kernels: what layers.py's ``kernel`` hooks run on a GPU.

In torch an RMSNorm with its residual add is eight kernels, the rotary embedding eleven for q and
k, SiLU-and-mul three; with the casts and copies between them a decode step of Qwen3-0.6B launched
about 1,400 kernels besides its matmuls and attention. Each reads and writes a few kilobytes and
takes 1-3 us, mostly start-up, so together they cost an H100 3.3 ms of a 12.8 ms step at batch 131
(docs/gpu.md). A CUDA graph removes their launch cost from the host, not their time on the GPU.
Fused, each layer is one pass over its rows, as vLLM's custom ops are and as cpu_layers.cpp does
on CPU: the same hooks, the same contracts (``add_rms_norm`` writes the sum into ``residual``),
except that ``rotary`` returns new tensors (see there).

Each kernel rounds where torch's ops round (the residual sum, the normalised row, SiLU, each of the
rotation's products), in the activation dtype, so in bf16 it gives HF's values up to the order of
a float32 sum. Grids follow from shapes only, and nothing is read back to the host, so a decode
step with them is captured in a CUDA graph as before. Tested under Triton's interpreter on CPU
(tests/test_triton_layers.py) and compiled for sm_80/sm_90 without a GPU
(tests/compile_triton_kernels.py).
"""

from __future__ import annotations

import torch

from nanoengine.activation import SiluAndMul
from nanoengine.layernorm import RMSNorm
from nanoengine.rotary_embedding import RotaryEmbedding
from nanoengine.triton_jit import jit, tl, triton


def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_t, stride_h, num_heads, hidden, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # One program a row; row r of a [tokens, heads, hidden] view is token r // heads, head r % heads.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + (row // num_heads) * stride_t + (row % num_heads) * stride_h + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # the sum rounded to the activation dtype, as torch's add; the norm reads it rounded
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(dtype)
        tl.store(residual_ptr + row * hidden + cols, x, mask=mask)
    x = x.to(tl.float32)
    normed = (x * tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)).to(dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * hidden + cols, (weight.to(tl.float32) * normed.to(tl.float32)).to(dtype), mask=mask)


def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, width, BLOCK: tl.constexpr):
    # Program (row, i) takes columns [i * BLOCK, (i + 1) * BLOCK) of the row's gate and up halves.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + width + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (silu * up).to(dtype), mask=mask)


def _rotary_kernel(x_ptr, out_ptr, positions_ptr, cos_sin_ptr, stride_t, stride_h, num_heads,
                   HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program a token, all its heads at once: out = x * [c, c] + [x2, x1] * [-s, s] (apply_rotary),
    # the table row holding [c, c, -s, s] in float32, rounded to x's dtype first as torch does.
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    d = tl.arange(0, BLOCK_D)
    partner = tl.where(d < HEAD_DIM // 2, d + HEAD_DIM // 2, d - HEAD_DIM // 2)  # [x2, x1]'s column d
    angles = cos_sin_ptr + position * (2 * HEAD_DIM)
    cos = tl.load(angles + d, mask=d < HEAD_DIM, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(angles + HEAD_DIM + d, mask=d < HEAD_DIM, other=0.0).to(dtype).to(tl.float32)
    heads = tl.arange(0, BLOCK_H)[:, None]
    mask = (heads < num_heads) & (d[None, :] < HEAD_DIM)
    row = x_ptr + token * stride_t + heads * stride_h
    x = tl.load(row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    out = (x * cos[None, :]).to(dtype).to(tl.float32) + (x_partner * sin[None, :]).to(dtype).to(tl.float32)
    tl.store(out_ptr + (token * num_heads + heads) * HEAD_DIM + d[None, :], out.to(dtype), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """``RMSNorm.forward`` in one kernel. x is ``[tokens, hidden]`` or a ``[tokens, heads, hidden]``
    view (Qwen3's per-head norms, inside the qkv output); with a residual, the sum is written into it."""
    hidden = x.shape[-1]
    if x.stride(-1) != 1 or (residual is not None and not residual.is_contiguous()):
        raise ValueError("add_rms_norm needs x's rows contiguous and residual contiguous (it writes the sum there)")
    x3 = x.view(-1, 1, hidden) if x.dim() == 2 else x
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel():
        block = triton.next_power_of_2(hidden)
        jit(_add_rms_norm_kernel)[(x3.shape[0] * x3.shape[1],)](
            x3, residual, weight, out, x3.stride(0), x3.stride(1), x3.shape[1], hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 16))
    return out if residual is None else (out, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``SiluAndMul.forward`` in one kernel: x ``[tokens, 2 * width]`` is [gate | up]."""
    width = x.shape[-1] // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    x2 = x.view(-1, x.shape[-1])
    out = torch.empty(*x.shape[:-1], width, dtype=x.dtype, device=x.device)
    if out.numel():
        block = min(triton.next_power_of_2(width), 1024)
        jit(_silu_and_mul_kernel)[(x2.shape[0], triton.cdiv(width, block))](x2, out, x2.stride(0), width, BLOCK=block)
    return out


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor):
    """``RotaryEmbedding.forward``: q and k ``[tokens, heads, head_dim]`` (views into the qkv output),
    turned into new tensors. Unlike the C++ kernel, not in place: a thread here reads the partners
    of its values, which other threads of the program would write, and nothing orders the two (an
    H100 run of an in-place version gave wrong values now and then). Launched without FP fusion:
    with it the compiler made the first product and the sum one FMA (``fma.rn.bf16x2`` on an H100),
    skipping the product's rounding, and a fifth of the values came out an ulp from torch's.
    Positions come from the scheduler, which keeps them under ``max_model_len``, the table's length:
    they are not checked here, which would cost a read back to the host."""
    head_dim = q.shape[-1]
    rotated = []
    for x in (q, k):
        if x.stride(-1) != 1:
            raise ValueError("rotary needs each head's values contiguous")
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if x.numel():
            jit(_rotary_kernel)[(x.shape[0],)](
                x, out, positions, cos_sin_cache, x.stride(0), x.stride(1), x.shape[1], HEAD_DIM=head_dim,
                BLOCK_H=triton.next_power_of_2(x.shape[1]), BLOCK_D=triton.next_power_of_2(head_dim),
                enable_fp_fusion=False)
        rotated.append(out)
    return tuple(rotated)


KERNELS = {RMSNorm: add_rms_norm, SiluAndMul: silu_and_mul, RotaryEmbedding: rotary}


def use_triton_kernels(model: torch.nn.Module) -> None:
    """Point the model's RMSNorms, SiLU-and-muls and rotary embedding at these kernels."""
    for module in model.modules():
        if type(module) in KERNELS:
            module.kernel = KERNELS[type(module)]
