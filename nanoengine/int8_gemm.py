"""int8 compute for batched steps: the int8 weight multiplied by an int8 GEMM, x rounded per row to
two int8 digits, the int32 products scaled back to x's dtype. The GEMM is cpu_int8_gemm.cpp's on
AMX tiles where the CPU has them, and otherwise oneDNN's (``torch._int_mm``, on AVX-512 VNNI or
AVX-VNNI; without VNNI its sums saturate, so cpu_dispatch.py never picks it there). oneDNN's, as
torch calls it, does not use AMX, and AMX's tiles do 16,384 multiply-adds an instruction: there the
kernel of our own is two to four times faster (docs/quantization.md).

The C++ kernel (cpu_quantized_linear.cpp) is made for one row of x: it streams the weight once and
is bound by memory. A batched step is bound by arithmetic instead, and there a GEMM, blocked for
the caches and the CPU's widest instructions, does several times more per second
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
beside it or on how the GEMM blocks its sums (both GEMMs give the same bits): among the steps this
path computes, a sequence is computed the same way whatever its batch (below cpu_dispatch.py's
rows the kernel computes it, in 8 bits per 32 values). The passes around the GEMM are
cpu_int8_gemm.cpp too.
"""

import functools

import torch

from nanoengine.cpu_kernels import DTYPES
from nanoengine.cpu_library import load

# Rows whose int32 products are rescaled while they are still in cache: one GEMM per chunk.
CHUNK_ROWS = 128
# AMX's tiles: a GEMM block is 32 rows of digits by 32 columns, its sums over 64 values of k at a time.
AMX_BLOCK, AMX_K = 32, 64


def available() -> bool:
    """Whether the passes around the GEMM build here (they need a C++ compiler)."""
    return load("cpu_int8_gemm.cpp") is not None


@functools.cache
def uses_amx() -> bool:
    """Whether the GEMM is cpu_int8_gemm.cpp's, on AMX tiles: the kernel was built for a CPU with
    AMX and Linux granted this process the tiles' state (asked once, for the whole process, as
    oneDNN asks too)."""
    library = load("cpu_int8_gemm.cpp")
    return library is not None and library.amx_ready() == 0


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """An int8 ``[out, in]`` weight in the layout this CPU's GEMM reads: AMX's tiles (the layout in
    cpu_int8_gemm.cpp, zero-padded to whole tiles), or ``weight`` itself for ``torch._int_mm``."""
    if not uses_amx():
        return weight.contiguous()
    out_features, in_features = weight.shape
    rows, k = _round_up(out_features, AMX_BLOCK), _round_up(in_features, AMX_K)
    padded = weight.new_zeros(rows, k)
    padded[:out_features, :in_features] = weight
    # [16 columns, 16 of them; k in blocks of 64, of 16 quads] -> tile (16 columns, k block): row r
    # holds k quad r, column by column
    tiles = padded.view(rows // 16, 16, k // AMX_K, AMX_K // 4, 4).permute(0, 2, 3, 1, 4)
    return tiles.reshape(rows // 16, k // AMX_K, 16, AMX_K)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ (weight * scales[:, None]).T + bias`` through the int8 GEMM: ``weight`` int8 from
    ``pack_weight`` (``[out, in]``, or AMX's tiles), ``scales`` float32 ``[out]``, ``x`` float32 or
    bfloat16 ``[..., in]``."""
    out_features, in_features = scales.shape[0], x.shape[-1]
    tiles = (_round_up(out_features, AMX_BLOCK) // 16, _round_up(in_features, AMX_K) // AMX_K, 16, AMX_K)
    if x.dtype not in DTYPES:
        raise ValueError(f"int8_linear takes float32 or bfloat16 x, got {x.dtype}")
    if weight.dtype != torch.int8 or tuple(weight.shape) not in ((out_features, in_features), tiles) \
            or (weight.dim() == 4 and not uses_amx()):
        raise ValueError(f"int8_linear's weight for x [..., {in_features}] and {out_features} scales is int8 "
                         f"[{out_features}, {in_features}] (or AMX's tiles, from pack_weight), got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if scales.dtype != torch.float32 or scales.dim() != 1 or not (weight.is_contiguous() and scales.is_contiguous()) \
            or (bias is not None and (bias.dtype, bias.shape) != (x.dtype, (out_features,))):
        raise ValueError("int8_linear takes a contiguous weight, contiguous float32 scales [out] and a bias "
                         "[out] in x's dtype")
    library, dtype, threads = load("cpu_int8_gemm.cpp"), DTYPES[x.dtype], torch.get_num_threads()
    rows = x.reshape(-1, in_features)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    num_rows, amx = rows.shape[0], weight.dim() == 4
    # row m's digits: rows 2m (hi) and 2m + 1 (lo); AMX reads whole tiles, so its rows and k are
    # padded (the padding's values do not matter: the weight is zero past in_features, and the
    # padded rows' sums are never read)
    digits = torch.empty(_round_up(2 * num_rows, AMX_BLOCK), tiles[1] * AMX_K, dtype=torch.int8) if amx \
        else torch.empty(2 * num_rows, in_features, dtype=torch.int8)
    x_scales = torch.empty(num_rows, dtype=torch.float32)
    getattr(library, f"quantize_activations_{dtype}")(rows.data_ptr(), rows.stride(0), num_rows, in_features,
                                                       digits.data_ptr(), digits.stride(0), x_scales.data_ptr(),
                                                       threads)
    bias = bias.contiguous() if bias is not None else None
    out = x.new_empty(num_rows, out_features)
    bias_ptr = bias.data_ptr() if bias is not None else None
    if amx:
        getattr(library, f"amx_gemm_{dtype}")(digits.data_ptr(), x_scales.data_ptr(), num_rows, digits.shape[1],
                                              weight.data_ptr(), scales.data_ptr(), bias_ptr, out.data_ptr(),
                                              out_features, threads)
        return out.view(*x.shape[:-1], out_features)
    products = torch.empty(2 * min(num_rows, CHUNK_ROWS), out_features, dtype=torch.int32)
    for start in range(0, num_rows, CHUNK_ROWS):
        chunk = min(CHUNK_ROWS, num_rows - start)
        torch._int_mm(digits[2 * start:2 * (start + chunk)], weight.t(), out=products[:2 * chunk])
        getattr(library, f"rescale_{dtype}")(products.data_ptr(), x_scales[start:].data_ptr(), scales.data_ptr(),
                                             bias_ptr, out[start:].data_ptr(), chunk, out_features, threads)
    return out.view(*x.shape[:-1], out_features)
