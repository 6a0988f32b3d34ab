"""Which code computes a quantized linear layer on CPU, by the rows of x and what the CPU has:
nanoengine's C++ kernel (cpu_quantized_linear.cpp) or oneDNN's int8 GEMM (int8_gemm.py).

The two are made for different ends. The C++ kernel streams the weight once for all of x's rows
and is bound by memory: at batch 1 it is 2-4x faster than the GEMM. The GEMM is blocked for the
caches and uses the CPU's widest instructions (AMX where there is AMX, which only a library uses
here), so once there are enough rows for arithmetic to be what costs, it wins.

``GEMM_MIN_ROWS`` is the fewest rows from which the GEMM was faster, summed over a decoder
layer's four matmuls of the default model (576 -> 960, 576 -> 576, 576 -> 3072, 1536 -> 576), for
1 to 512 rows, bf16 activations, both threads of a 2-core Sapphire Rapids, 2026-11-25. The CPUs
without AMX were that machine with oneDNN held below it (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``,
as on a Cooper Lake or a Zen 4; ``AVX2`` with the C++ kernels compiled for Haswell), so those rows
are estimates until measured on such a machine (docs/quantization.md has the sweep and the
command). None: the GEMM never won by enough to pay for its copy of the weight.
"""

from nanoengine.cpu_library import cpu_features

GEMM_MIN_ROWS = {  # CPU kind -> weight format -> rows
    "amx": {"int8": 12, "int4": 64},
    # int4: its kernel stayed 2-8% ahead at 128-512 rows.
    "avx512_vnni": {"int8": 12, "int4": None},
    # int8: at most 10% ahead from 128 rows, level below; int4: the kernel ahead at every size.
    "avx2": {"int8": None, "int4": None},
}


def cpu_kind(features: str) -> str:
    """The row of ``GEMM_MIN_ROWS`` for a CPU with these /proc/cpuinfo flags."""
    flags = set(features.split())
    if "amx_int8" in flags:
        return "amx"
    return "avx512_vnni" if "avx512_vnni" in flags else "avx2"


def gemm_min_rows(fmt: str, features: str | None = None) -> int | None:
    """From how many rows of x a layer with ``fmt`` weights ("int8" or "int4") computes through the
    int8 GEMM on this CPU (or on one with ``features``); None: never."""
    return GEMM_MIN_ROWS[cpu_kind(cpu_features() if features is None else features)][fmt]
