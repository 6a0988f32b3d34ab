"""Compile nanoengine's Triton kernels to GPU code without a GPU: ``python tests/compile_triton_kernels.py``.

Triton lowers a kernel to PTX and ``ptxas`` assembles it on the CPU; only launching needs the
device. So the kernels' compiled form (every construct Triton's interpreter accepts but a GPU
might not: ``tl.dot`` shapes, early returns, pointer arguments left None, shared memory) is checked
here for each target (A100's sm_80, H100's sm_90), with the tile sizes the wrappers pick, and
each kernel's shared memory is held to the target's limit. Run without TRITON_INTERPRET: the
interpreter is chosen when triton is imported. Prints one line a kernel and configuration, and
exits non-zero on the first that fails.
"""

import inspect
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from nanoengine.triton_store_kvcache import _store_kvcache_kernel
from nanoengine.triton_attention import _attention_kernel, _merge_kernel, tile_sizes
from nanoengine.triton_fp8 import E4M3, E5M2, from_fp8, to_fp8
from nanoengine.triton_layers import _add_rms_norm_kernel, _rotary_kernel, _silu_and_mul_kernel

SHARED_MEMORY_LIMIT = {80: 163 * 1024, 90: 227 * 1024}  # bytes a block may use: A100, H100
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
POINTERS = {"q_ptr", "k_ptr", "v_ptr", "out_ptr", "key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr", "part_ptr",
            "x_ptr", "residual_ptr", "weight_ptr"}


def compile_kernel(kernel, target: GPUTarget, dtype: str, constexprs: dict, types: dict):
    """``kernel`` for ``target``: pointers to ``dtype`` unless ``types`` names another type, ints else."""
    names = list(inspect.signature(kernel).parameters)
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = types.get(name, f"*{dtype}" if name in POINTERS else "i32")
    source = ASTSource(fn=JITFunction(kernel), signature=signature,
                       constexprs={(names.index(n),): v for n, v in constexprs.items()})
    return triton.compile(source, target=target)


def attention_configs(dtype: str):
    """(label, constexprs, types) as ``_attention`` launches them: packed prefill, paged prefill, split decode;
    and, at head size 64, paged prefill and split decode over an 8-bit cache (its bytes decoded by
    triton_fp8.from_fp8), one in each format."""
    for head_dim in (64, 256):
        fp8 = ((16, 1, 1024, E4M3), (16, 8, 2, E5M2)) if head_dim == 64 else ()
        for page, splits, rows, fmt in ((0, 1, 1024, 0), (16, 1, 1024, 0), (16, 8, 2, 0), (256, 4, 2, 0), *fp8):
            block_m, block_n, block_d = tile_sizes(rows, head_dim, ITEMSIZE[dtype])
            constexprs = dict(GROUP=2, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
                              PAGE=page, NUM_SPLITS=splits, CAUSAL=True,
                              PRECISION="ieee" if dtype == "fp32" else "tf32", WINDOW=-1, SOFTCAP=0.0, FMT=fmt,
                              FROM_FP8=JITFunction(from_fp8) if fmt else None)
            types = {"cu_q_ptr": "*i32", "cu_k_ptr": "*i32", "block_table_ptr": "*i32", "scale": "fp32",
                     "v_scale": "fp32", "out_ptr": f"*{dtype}" if splits == 1 else "*fp32", "lse_ptr": "*fp32"}
            if fmt:
                types |= {"k_ptr": "*u8", "v_ptr": "*u8"}
            if splits == 1:
                constexprs["lse_ptr"] = None
            if not page:
                constexprs["block_table_ptr"] = None
            yield f"attention head_dim={head_dim} page={page} splits={splits} fp8={fmt}", constexprs, types


def main() -> None:
    for arch in (80, 90):
        target = GPUTarget("cuda", arch, 32)
        for dtype in ("bf16", "fp32"):
            for label, constexprs, types in attention_configs(dtype):
                compiled = compile_kernel(_attention_kernel, target, dtype, constexprs, types)
                print(f"sm_{arch} {dtype} {label}: {compiled.metadata.shared} bytes of shared memory")
                if compiled.metadata.shared > SHARED_MEMORY_LIMIT[arch]:
                    return f"sm_{arch} {dtype} {label} needs more shared memory than the GPU has"
            for splits in (2, 64):
                compile_kernel(_merge_kernel, target, "fp32", dict(HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=splits),
                               {"out_ptr": f"*{dtype}", "lse_ptr": "*fp32"})
                print(f"sm_{arch} {dtype} merge splits={splits}: ok")
            for fmt in (0, E4M3, E5M2):  # into a cache of the model's dtype, or of fp8 codes as bytes
                compile_kernel(_store_kvcache_kernel, target, dtype,
                               dict(HEAD_DIM=64, ROW=192, BLOCK=256, FMT=fmt,
                                    TO_FP8=JITFunction(to_fp8) if fmt else None),
                               {"slot_mapping_ptr": "*i64", "k_inverse_scale": "fp32", "v_inverse_scale": "fp32"}
                               | ({"k_cache_ptr": "*u8", "v_cache_ptr": "*u8"} if fmt else {}))
                print(f"sm_{arch} {dtype} store_kvcache fp8={fmt}: ok")
            for residual in (True, False):
                compile_kernel(_add_rms_norm_kernel, target, dtype,
                               dict(HAS_RESIDUAL=residual, BLOCK=1024, **({} if residual else {"residual_ptr": None})),
                               {"eps": "fp32"})
                print(f"sm_{arch} {dtype} add_rms_norm residual={residual}: ok")
            compile_kernel(_silu_and_mul_kernel, target, dtype, dict(BLOCK=1024), {})
            compile_kernel(_rotary_kernel, target, dtype, dict(HEAD_DIM=80, BLOCK_H=16, BLOCK_D=128),
                           {"positions_ptr": "*i64", "cos_sin_ptr": "*fp32"})
            print(f"sm_{arch} {dtype} silu_and_mul, rotary: ok")


if __name__ == "__main__":
    sys.exit(main())
