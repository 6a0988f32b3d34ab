"""int8 compute for batched steps: x rotated and rounded per row to int8, multiplied by an int8
weight rotated the same way, the int32 products scaled back to x's dtype. The GEMM is
cpu_int8_gemm.cpp's on AMX tiles where the CPU has them, and otherwise oneDNN's
(``torch._int_mm``, on AVX-512 VNNI or AVX-VNNI; without VNNI its sums saturate, so
``GEMM_MIN_ROWS`` never picks it there). oneDNN's, as torch calls it, does not use AMX, and AMX's tiles do 16,384
multiply-adds an instruction: there the kernel of our own is faster (docs/quantization.md).

The C++ kernel (cpu_quantized_linear.cpp) is made for one row of x: it streams the weight once and
is bound by memory. A batched step is bound by arithmetic instead, and there a GEMM, blocked for
the caches and the CPU's widest instructions, does several times more per second
(docs/quantization.md); ``GEMM_MIN_ROWS`` says from how many rows it takes over.

A GEMM takes one scale per row of x (it must be constant along the sum), and one int8 step per
row is coarse: a row's step is set by its largest value, and LLM activations have a few channels
far larger than the rest. Rounded that way, every layer's input raised the default model's
perplexity by 3.9-5.7%. So x is rotated first (QuaRot's remedy): each block of B values (B the
largest power of two dividing the row, at most 512) times H, the B x B Hadamard matrix (entries
+-1, H @ H.T = B * I). A rotation spreads a large channel over its whole block and leaves the
product as it was, if the weight rotates with it:

    x @ W.T = (x @ H) @ (W @ H / B).T           (H block-diagonal along the row)
    v = round((x @ H) / x_scale[m]),  |v| <= 127
    out[m, n] = (v @ q.T)[m, n] * x_scale[m] * w_scale[n]   (q, w_scale: W @ H / B in int8, per row)

The weight's rotation is done once (``quantize_weight``); x's is log2(B) rounds of additions in the
pass that rounds it. Perplexity: +0.3% in int8 on the test's text (docs/quantization.md). Each
product is an exact integer and a row's scale is its own, so a row's result does not depend on the
rows beside it or on how the GEMM blocks its sums (both GEMMs give the same bits): among the steps
this path computes, a sequence is computed the same way whatever its batch (below ``GEMM_MIN_ROWS``'
rows the kernel computes it, in 8 bits per 32 values). The passes around the GEMM are
cpu_int8_gemm.cpp too.

Which of the two computes a quantized linear layer, by the rows of x and what the CPU has:
the C++ kernel (cpu_quantized_linear.cpp) or this GEMM (on AMX tiles, or oneDNN's).

The two are made for different ends. The C++ kernel streams the weight once for all of x's rows
and is bound by memory: at batch 1 it is the faster. The GEMM is blocked for the caches and uses
the CPU's widest instructions (AMX's tiles, where there are some), so once there are enough rows
for arithmetic to be what costs, it wins.

``GEMM_MIN_ROWS`` is the fewest rows from which the GEMM is used, from the rows where it became
faster, summed over a decoder layer's four matmuls of the default model (576 -> 960, 576 -> 576,
576 -> 3072, 1536 -> 576), bf16 activations, both threads of a 2-core Sapphire Rapids
(docs/quantization.md has the sweep and its command): with AMX, the GEMM on tiles is behind the
int8 kernel at 1 row and ahead from 2; level with the int4 kernel at 3-4 rows and ahead from 5.
The other kinds were that machine with oneDNN held below AMX and the C++ kernels built without it
(``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``, as on a Cooper Lake or a Zen 4; ``AVX2_VNNI``, as on an
Alder Lake, with the C++ kernels compiled for Haswell), where oneDNN's GEMM caught up with the
int8 kernel between 8 and 12 rows, and with the int4 kernel between 17 and 24 rows and between 24
and 32: estimates until measured on such a machine. None: the GEMM does not win by enough, early
enough, to pay for its copy of the weight.

Each count is also one past a batch bucket of the CPU graphs (1, 2, 4, 8, 16: graph_runner.py),
so a graph's step, padded to its bucket, takes the path its unpadded rows would (a verify step's
rows too, its sequences times the tokens each brings): a replay gives the eager step's tokens.
Past 9 rows that no longer holds for verify steps, so int4 on AVX-512 VNNI, whose crossover is
higher, takes the GEMM from 9 rows: behind on steps of 9-16 rows, ahead on the larger ones that
make batched throughput.

Without VNNI the GEMM is not only slower but wrong: oneDNN then multiplies bytes with
``vpmaddubsw``, whose pairs of products saturate at int16 (127 x 127 x 2 does not fit), so
products of large int8 values come out clipped (here, with ``ONEDNN_MAX_CPU_ISA=AVX2``, 64 products
of 127 x 127 summed to 8,160 instead of 1,032,256).
"""

import functools

import torch

from nanoengine import quantization
from nanoengine.cpu_kernels import DTYPES
from nanoengine.cpu_library import cpu_features, load

# Rows whose int32 products are rescaled while they are still in cache: one GEMM per chunk.
CHUNK_ROWS = 128
# AMX's tiles: a GEMM block is 32 rows of x by 32 columns, its sums over 64 values of k at a time.
AMX_BLOCK, AMX_K = 32, 64
# The largest block of x that one Hadamard matrix rotates. Blocks of 64 on the default model's rows
# of 1,536 too read 0.3% more perplexity; each doubling costs one more round of additions.
MAX_HADAMARD_BLOCK = 512


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


def hadamard_block(in_features: int) -> int:
    """B for a row of ``in_features``: the largest power of two that divides it, at most 512; and 1
    (no rotation) below 16, where the pass's vectors of 16 would not fit (never for a quantized
    layer, whose rows are whole groups of 32)."""
    block = min(in_features & -in_features, MAX_HADAMARD_BLOCK)
    return block if block >= 16 else 1


def rotate(x: torch.Tensor) -> torch.Tensor:
    """Each block of ``hadamard_block`` values along x's last dimension times the Hadamard matrix
    (Sylvester's: H_2B = [[H_B, H_B], [H_B, -H_B]]), in float64: what the pass before the GEMM
    does to x in float32."""
    block, h = hadamard_block(x.shape[-1]), torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return (x.double().unflatten(-1, (-1, block)) @ h).flatten(-2)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float ``[out, in]`` weight as the GEMM multiplies it: ``weight @ H / B`` rounded to int8
    per row, ``(q, scales)`` (quantization.quantize_int8). ``pack_weight`` lays q out."""
    block = hadamard_block(weight.shape[1])
    # a few thousand rows at a time: the LM head's float64 copies would otherwise add a gigabyte to
    # the process's peak memory
    parts = [quantization.quantize_int8(rotate(rows) / block) for rows in weight.split(4096)]
    return torch.cat([q for q, _ in parts]), torch.cat([scales for _, scales in parts])


def pack_weight(q: torch.Tensor) -> torch.Tensor:
    """An int8 ``[out, in]`` weight in the layout this CPU's GEMM reads: AMX's tiles (the layout in
    cpu_int8_gemm.cpp, zero-padded to whole tiles), or ``q`` itself for ``torch._int_mm``."""
    if not uses_amx():
        return q.contiguous()
    out_features, in_features = q.shape
    rows, k = _round_up(out_features, AMX_BLOCK), _round_up(in_features, AMX_K)
    padded = q.new_zeros(rows, k)
    padded[:out_features, :in_features] = q
    # [16 columns, 16 of them; k in blocks of 64, of 16 quads] -> tile (16 columns, k block): row r
    # holds k quad r, column by column
    tiles = padded.view(rows // 16, 16, k // AMX_K, AMX_K // 4, 4).permute(0, 2, 3, 1, 4)
    return tiles.reshape(rows // 16, k // AMX_K, 16, AMX_K)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` through the int8 GEMM: ``weight`` and ``scales`` are W as
    ``quantize_weight`` gives it (int8, laid out by ``pack_weight``; float32 ``[out]``), ``x``
    float32 or bfloat16 ``[..., in]``."""
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
    # AMX reads whole tiles, so its rows and k are padded (the padding's values do not matter: the
    # weight is zero past in_features, and the padded rows' sums are never read)
    q = torch.empty(_round_up(num_rows, AMX_BLOCK), tiles[1] * AMX_K, dtype=torch.int8) if amx \
        else torch.empty(num_rows, in_features, dtype=torch.int8)
    x_scales = torch.empty(num_rows, dtype=torch.float32)
    getattr(library, f"quantize_activations_{dtype}")(rows.data_ptr(), rows.stride(0), num_rows, in_features,
                                                       hadamard_block(in_features), q.data_ptr(), q.stride(0),
                                                       x_scales.data_ptr(), threads)
    bias = bias.contiguous() if bias is not None else None
    out = x.new_empty(num_rows, out_features)
    bias_ptr = bias.data_ptr() if bias is not None else None
    if amx:
        getattr(library, f"amx_gemm_{dtype}")(q.data_ptr(), x_scales.data_ptr(), num_rows, q.shape[1],
                                              weight.data_ptr(), scales.data_ptr(), bias_ptr, out.data_ptr(),
                                              out_features, threads)
        return out.view(*x.shape[:-1], out_features)
    products = torch.empty(min(num_rows, CHUNK_ROWS), out_features, dtype=torch.int32)
    for start in range(0, num_rows, CHUNK_ROWS):
        chunk = min(CHUNK_ROWS, num_rows - start)
        torch._int_mm(q[start:start + chunk], weight.t(), out=products[:chunk])
        getattr(library, f"rescale_{dtype}")(products.data_ptr(), x_scales[start:].data_ptr(), scales.data_ptr(),
                                             bias_ptr, out[start:].data_ptr(), chunk, out_features, threads)
    return out.view(*x.shape[:-1], out_features)


GEMM_MIN_ROWS = {  # CPU kind -> weight format -> rows
    "amx": {"int8": 2, "int4": 5},
    "avx512_vnni": {"int8": 9, "int4": 9},  # int4: behind at 9-16 rows (1.4-1.15x), 1.2-2.2x ahead from 32
    "avx_vnni": {"int8": 9, "int4": None},  # int4: 1.6x behind at 9 rows, ahead only from 24-32
    "no_vnni": {"int8": None, "int4": None},  # the GEMM's products would saturate
}


def cpu_kind(features: str) -> str:
    """The row of ``GEMM_MIN_ROWS`` for a CPU with these /proc/cpuinfo flags."""
    flags = set(features.split())
    if "amx_int8" in flags:
        return "amx"
    return next((kind for kind in ("avx512_vnni", "avx_vnni") if kind in flags), "no_vnni")


def gemm_min_rows(fmt: str, features: str | None = None) -> int | None:
    """From how many rows of x a layer with ``fmt`` weights ("int8" or "int4") computes through the
    int8 GEMM on this CPU (or on one with ``features``); None: never."""
    return GEMM_MIN_ROWS[_this_cpu_kind() if features is None else cpu_kind(features)][fmt]


@functools.cache
def _this_cpu_kind() -> str:
    """This CPU's kind, read once (every quantized layer asks)."""
    return cpu_kind(cpu_features())
