"""Which code computes a quantized linear layer on CPU, by the rows of x and what the CPU has:
nanoengine's C++ kernel (cpu_quantized_linear.cpp) or oneDNN's int8 GEMM (int8_gemm.py).

The two are made for different ends. The C++ kernel streams the weight once for all of x's rows
and is bound by memory: at batch 1 it is 2-4x faster than the GEMM. The GEMM is blocked for the
caches and uses the CPU's widest instructions (AMX where there is AMX, which only a library uses
here), so once there are enough rows for arithmetic to be what costs, it wins.

``GEMM_MIN_ROWS`` is the fewest rows from which the GEMM was faster, summed over a decoder layer's
four matmuls of the default model (576 -> 960, 576 -> 576, 576 -> 3072, 1536 -> 576), for 1 to 512
rows, bf16 activations, both threads of a 2-core Sapphire Rapids, 2026-11-25. The other kinds were
that machine with oneDNN held below AMX (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``, as on a Cooper
Lake or a Zen 4; ``AVX2_VNNI``, as on an Alder Lake, with the C++ kernel compiled for Haswell), so
their rows are estimates until measured on such a machine (docs/quantization.md has the sweep and
its command). None: the GEMM never won by enough to pay for its copy of the weight.

Without VNNI the GEMM is not only slower but wrong: oneDNN then multiplies bytes with
``vpmaddubsw``, whose pairs of products saturate at int16 (127 x 127 x 2 does not fit), so
products of large int8 values come out clipped (here, with ``ONEDNN_MAX_CPU_ISA=AVX2``, 64 products
of 127 x 127 summed to 8,160 instead of 1,032,256).
"""

import functools

from nanoengine.cpu_library import cpu_features

GEMM_MIN_ROWS = {  # CPU kind -> weight format -> rows
    "amx": {"int8": 12, "int4": 64},
    "avx512_vnni": {"int8": 12, "int4": None},  # int4: its kernel stayed 3-7% ahead at 128-512 rows
    "avx_vnni": {"int8": 24, "int4": None},  # int4: at most 8% ahead from 256 rows
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
