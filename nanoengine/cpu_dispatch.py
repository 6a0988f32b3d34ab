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

from nanoengine.cpu_library import cpu_features

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
