"""The sweep behind docs/quantization.md's table and cpu_int8_gemm.py's GEMM_MIN_ROWS: for each row count, a
decoder layer's four matmuls (the default model's shapes) through oneDNN, through the int8 GEMM on
AMX tiles (where the CPU has them) and through the C++ kernels, microseconds summed over the four.
Run it on an idle machine:

    python docs/cpu_dispatch_sweep.py

To estimate another CPU kind on this one, hold oneDNN below what the CPU has
(``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``: AVX-512 VNNI without AMX; ``AVX2_VNNI``) and, for an
AVX2 kind, build the C++ kernels for it (``CXX`` set to a script running ``g++ "$@" -march=haswell``).
"""

import time

import torch
import torch.nn.functional as F

from nanoengine import cpu_kernels, cpu_int8_gemm, quantization
from nanoengine.cpu_library import load
from nanoengine.cpu_int8_gemm import int8_linear, pack_weight

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out): qkv, o, gate_up, down
ROWS = [1, 2, 3, 4, 5, 8, 9, 12, 16, 17, 24, 32, 64, 128, 512]


def microseconds(fn, repeats: int = 10) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    torch.manual_seed(0)
    has_bf16_kernel = load("cpu_linear.cpp") is not None
    weights = {}
    for in_features, out_features in SHAPES:
        w = torch.randn(out_features, in_features)
        q, scales = cpu_int8_gemm.quantize_weight(w)
        weights[in_features, out_features] = dict(
            bf16=w.bfloat16(), packed=cpu_kernels.pack_linear_weight(w.bfloat16()) if has_bf16_kernel else None,
            int8=quantization.quantize_weight(w, "int8"), int4=quantization.quantize_weight(w, "int4"),
            gemm=(q, scales), amx=(pack_weight(q), scales))  # torch._int_mm's layout, AMX's tiles
    amx = cpu_int8_gemm.uses_amx()
    print("rows: bf16 oneDNN / kernel | int8 oneDNN GEMM / AMX GEMM / kernel | int4 kernel (us, a layer's four matmuls)")
    with torch.inference_mode():
        for rows in ROWS:
            total = dict.fromkeys(["onednn", "bf16", "gemm", "amx", "int8", "int4"], 0.0)
            for (in_features, out_features), w in weights.items():
                x = torch.randn(rows, in_features, dtype=torch.bfloat16)
                total["onednn"] += microseconds(lambda: F.linear(x, w["bf16"]))
                if has_bf16_kernel:
                    total["bf16"] += microseconds(lambda: cpu_kernels.linear(x, w["packed"], None, out_features))
                total["gemm"] += microseconds(lambda: int8_linear(x, *w["gemm"], None))
                if amx:
                    total["amx"] += microseconds(lambda: int8_linear(x, *w["amx"], None))
                total["int8"] += microseconds(lambda: cpu_kernels.quantized_linear(x, *w["int8"], None, out_features))
                total["int4"] += microseconds(lambda: cpu_kernels.quantized_linear(x, *w["int4"], None, out_features))
            bf16_kernel = f"{total['bf16']:.0f}" if has_bf16_kernel else "-"
            amx_gemm = f"{total['amx']:.0f}" if amx else "-"
            print(f"{rows}: {total['onednn']:.0f} / {bf16_kernel} | {total['gemm']:.0f} / {amx_gemm} / "
                  f"{total['int8']:.0f} | {total['int4']:.0f}")


if __name__ == "__main__":
    main()
