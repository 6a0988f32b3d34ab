"""int8 compute for batched steps: the int8 weight multiplied by oneDNN's int8 GEMM
(``torch._int_mm``, on AVX-512 VNNI, AVX-VNNI or AMX as the CPU has them; without VNNI its sums
saturate, so cpu_dispatch.py never picks it there), x rounded per row to two int8 digits, the
int32 products scaled back to x's dtype.

The C++ kernel (cpu_quantized_linear.cpp) is made for one row of x: it streams the weight once and
is bound by memory. A batched step is bound by arithmetic instead, and there a library GEMM,
blocked for the caches and the CPU's widest instructions, does several times more per second
(docs/quantization.md); cpu_dispatch.py says from how many rows it takes over.

A GEMM takes one scale per row of x (it must be constant along the sum), but one int8 step per row
is coarse: a row's step is set by its largest value, and LLM activations have a few channels far
larger than the rest. Rounded that way, every layer's input raised the default model's perplexity
by 4.3-4.8% (the C++ kernel, with a scale per 32 values, by 0.4-0.6%; LLM.int8()'s remedy, the
largest columns of the batch apart in float32, still left 1.0-1.3%, and made a row's result depend
on its batch). So each row is rounded to 15 bits instead and written as two int8 digits:

    v = round(x / x_scale[m]),  |v| <= 127 * 128,   v = 128 * hi + lo   (hi, lo int8)
    out[m, n] = (128 * (hi @ q.T)[m, n] + (lo @ q.T)[m, n]) * x_scale[m] * w_scale[n]

Both digits go through one GEMM (as rows 2m and 2m + 1), twice the arithmetic of one int8 digit,
and x is then about as exact as bf16 itself: perplexity +0.3% in int8, within noise of the weights'
own rounding. Each product is an exact integer, so a row's result does not depend on the rows
beside it or on how the GEMM blocks its sums: among the steps this path computes, a sequence is
computed the same way whatever its batch (below cpu_dispatch.py's rows the kernel computes it, in
8 bits per 32 values). Both passes around the GEMM are cpu_int8_gemm.cpp.
"""

import torch

from nanoengine.cpu_kernels import DTYPES
from nanoengine.cpu_library import load

# Rows whose int32 products are rescaled while they are still in cache: one GEMM per chunk.
CHUNK_ROWS = 128


def available() -> bool:
    """Whether the passes around the GEMM build here (they need a C++ compiler)."""
    return load("cpu_int8_gemm.cpp") is not None


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ (weight * scales[:, None]).T + bias`` through the int8 GEMM: ``weight`` int8
    ``[out, in]``, ``scales`` float32 ``[out]``, ``x`` float32 or bfloat16 ``[..., in]``."""
    out_features, in_features = weight.shape
    if x.dtype not in DTYPES or x.shape[-1] != in_features:
        raise ValueError(f"int8_linear takes float32 or bfloat16 x [..., {in_features}], got {x.dtype} "
                         f"{tuple(x.shape)}")
    if (weight.dtype, scales.dtype, tuple(scales.shape)) != (torch.int8, torch.float32, (out_features,)) \
            or not (weight.is_contiguous() and scales.is_contiguous()) or (bias is not None and (bias.dtype, bias.shape) != (x.dtype, (out_features,))):
        raise ValueError("int8_linear takes a contiguous int8 weight [out, in], float32 scales [out] and a bias "
                         "[out] in x's dtype")
    library, dtype, threads = load("cpu_int8_gemm.cpp"), DTYPES[x.dtype], torch.get_num_threads()
    rows = x.reshape(-1, in_features)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    num_rows = rows.shape[0]
    digits = torch.empty(num_rows, 2, in_features, dtype=torch.int8)  # row m: its hi, then its lo
    x_scales = torch.empty(num_rows, dtype=torch.float32)
    getattr(library, f"quantize_activations_{dtype}")(rows.data_ptr(), rows.stride(0), num_rows, in_features,
                                                       digits.data_ptr(), x_scales.data_ptr(), threads)
    bias = bias.contiguous() if bias is not None else None
    out = x.new_empty(num_rows, out_features)
    products = torch.empty(2 * min(num_rows, CHUNK_ROWS), out_features, dtype=torch.int32)
    for start in range(0, num_rows, CHUNK_ROWS):
        chunk = min(CHUNK_ROWS, num_rows - start)
        torch._int_mm(digits[start:start + chunk].view(2 * chunk, in_features), weight.t(), out=products[:2 * chunk])
        getattr(library, f"rescale_{dtype}")(
            products.data_ptr(), x_scales[start:].data_ptr(), scales.data_ptr(),
            bias.data_ptr() if bias is not None else None, out[start:].data_ptr(), chunk, out_features, threads)
    return out.view(*x.shape[:-1], out_features)
