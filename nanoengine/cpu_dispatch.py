"""Which code computes a quantized linear layer on CPU, by the rows of x and what the CPU has:
nanoengine's C++ kernel (cpu_quantized_linear.cpp) or the int8 GEMM (int8_gemm.py: on AMX tiles,
or oneDNN's).

The two are made for different ends. The C++ kernel streams the weight once for all of x's rows
and is bound by memory: at batch 1 it is the faster. The GEMM is blocked for the caches and uses
the CPU's widest instructions (AMX's tiles, where there are some), so once there are enough rows
for arithmetic to be what costs, it wins.

``GEMM_MIN_ROWS`` is the fewest rows from which the GEMM is used, from the rows where it became
faster, summed over a decoder layer's four matmuls of the default model (576 -> 960, 576 -> 576,
576 -> 3072, 1536 -> 576), bf16 activations, both threads of a 2-core Sapphire Rapids
(docs/quantization.md has the sweep and its command): with AMX, the GEMM on tiles is level with
the kernel at 2-3 rows in int8 and 4-5 in int4, and ahead from 4 and 8. The other kinds were that
machine with oneDNN held below AMX (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``, as on a Cooper Lake
or a Zen 4; ``AVX2_VNNI``, as on an Alder Lake, with the C++ kernel compiled for Haswell), where
oneDNN's GEMM caught up between 8 and 12 rows and between 12 and 24: estimates until measured on
such a machine. None: the GEMM never won by enough to pay for its copy of the weight.

Each count is also one past a batch bucket of the CPU graphs (1, 2, 4, 8, 16: graph_runner.py),
so a graph's step, padded to its bucket, takes the path its unpadded rows would (a verify step's
rows too, its sequences times the tokens each brings): a replay gives the eager step's tokens.
Past 9 rows that no longer holds for verify steps, so the AVX-VNNI kind, whose crossover is
higher, takes the GEMM from 9 rows too, a little early.

Without VNNI the GEMM is not only slower but wrong: oneDNN then multiplies bytes with
``vpmaddubsw``, whose pairs of products saturate at int16 (127 x 127 x 2 does not fit), so
products of large int8 values come out clipped (here, with ``ONEDNN_MAX_CPU_ISA=AVX2``, 64 products
of 127 x 127 summed to 8,160 instead of 1,032,256).
"""

import functools

from nanoengine.cpu_library import cpu_features

GEMM_MIN_ROWS = {  # CPU kind -> weight format -> rows
    "amx": {"int8": 3, "int4": 5},
    "avx512_vnni": {"int8": 9, "int4": None},  # int4: its kernel stayed 3-7% ahead at 128-512 rows
    "avx_vnni": {"int8": 9, "int4": None},  # int4: at most 8% ahead from 256 rows
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
