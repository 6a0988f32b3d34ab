"""nanoengine's CPU kernels: small C++ files, compiled on first use and called through ctypes.

On CUDA, attention is flash-attn. On CPU, pure torch has no way to read the paged cache in place
for decode (the gather it needs instead roughly triples the step's memory traffic), torch's SDPA
is slow at prefill's short prompts (cpu_attention.cpp), the decoder's element-wise ops cost
more to launch than to compute at decode batch sizes (cpu_layers.cpp), and torch's bf16 matmul
reads a decode step's weights slower than memory allows (cpu_linear.cpp). The kernels are small, so
they are compiled with the system C++ compiler (attention for the model's head size) the first
time a model needs them, in about 3.5 s, and cached under ~/.cache/nanoengine. Without a
compiler the engine still runs, on the pure-torch code, and says so once.
"""

import ctypes
import functools
import os
import platform
import subprocess
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
import xxhash

from nanoengine.attention import flash_attn_varlen_func_torch, flash_attn_with_kvcache_torch
from nanoengine.layers import Linear, RMSNorm, RotaryEmbedding, SiluAndMul
from nanoengine.store_kvcache import store_kvcache_torch

_HEADER = Path(__file__).with_name("cpu_bfloat16.h")
_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}  # a kernel for each


def _cpu_features() -> str:
    """What ``-march=native`` compiles for. Part of the cache key, so that a home directory shared
    by different machines never hands one a kernel with instructions its CPU lacks."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.machine()


@functools.cache
def _load(source: str, head_dim: int | None = None) -> ctypes.CDLL | None:
    """The compiled ``source`` (a .cpp file beside this one), for ``head_dim`` if it needs one."""
    path = Path(__file__).with_name(source)
    flags = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]
    flags += [f"-DHEAD_DIM={head_dim}"] if head_dim else []
    compiler = os.environ.get("CXX", "g++")
    source_and_flags = path.read_bytes() + _HEADER.read_bytes() + " ".join([compiler, *flags, _cpu_features()]).encode()
    key = xxhash.xxh64(source_and_flags)
    cache_dir = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nanoengine"
    library = cache_dir / f"{path.stem}_{key.hexdigest()}.so"
    try:
        if not library.exists():
            cache_dir.mkdir(parents=True, exist_ok=True)
            partial = library.with_suffix(f".{os.getpid()}.tmp")  # concurrent builds never see half a file
            subprocess.run([compiler, *flags, str(path), "-o", str(partial)], check=True, capture_output=True)
            os.replace(partial, library)
        return ctypes.CDLL(str(library))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.decode(errors="replace")[-500:] if isinstance(e, subprocess.CalledProcessError) else e
        warnings.warn(f"could not build the CPU kernels in {source} ({detail}); "
                      "they are replaced by slower pure-torch code")
        return None


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x ``[..., heads, head_dim]`` as the kernels read it: each token's heads side by side, tokens
    ``x.stride(0)`` apart. Views into the qkv projection's output already are; others are copied."""
    return x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous()


def store_kvcache_cpu(key, value, k_cache, v_cache, slot_mapping) -> None:
    """``store_kvcache`` on CPU: one C++ call per layer, where torch needs five ops."""
    library = _load("cpu_attention.cpp", k_cache.shape[-1])
    if library is None or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return store_kvcache_torch(key, value, k_cache, v_cache, slot_mapping)
    key, value = _heads_contiguous(key), _heads_contiguous(value)
    size, slots = key.element_size(), slot_mapping.long().contiguous()  # slots must outlive the call
    library.store_kvcache(
        ctypes.c_void_p(key.data_ptr()), ctypes.c_void_p(value.data_ptr()),
        ctypes.c_int64(key.stride(0) * size), ctypes.c_int64(value.stride(0) * size),
        *[ctypes.c_void_p(t.data_ptr()) for t in (k_cache, v_cache, slots)],
        key.shape[0], ctypes.c_int64(key[0].numel() * size), torch.get_num_threads())


def flash_attn_varlen_func_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale=None, causal=False, block_table=None):
    """``flash_attn_varlen_func`` on CPU (prefill), by the C++ kernel; same arguments and semantics.

    A float16 cache, or no compiler, goes to the pure-torch reference instead.
    """
    num_heads, head_dim = q.shape[1:]
    ok = q.dtype in _DTYPES and k.dtype == q.dtype
    library = _load("cpu_attention.cpp", head_dim) if ok else None
    if library is None:
        return flash_attn_varlen_func_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            softmax_scale, causal, block_table)
    if block_table is None:
        # Packed K/V read as a paged cache whose blocks hold one token each: sequence i's "blocks"
        # are its own rows, cu_seqlens_k[i], cu_seqlens_k[i] + 1, ...
        block_table = cu_seqlens_k[:-1, None] + torch.arange(max_seqlen_k, device=q.device, dtype=torch.int32)
        k, v = k.unsqueeze(1), v.unsqueeze(1)
    q, k, v = _heads_contiguous(q), k.contiguous(), v.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    tables, cu_q = block_table.int().contiguous(), cu_seqlens_q.int().contiguous()
    seqlens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).int().contiguous()
    pointers = [ctypes.c_void_p(t.data_ptr()) for t in (q, k, v, tables, cu_q, seqlens, out)]
    getattr(library, "prefill_" + _DTYPES[q.dtype])(
        pointers[0], ctypes.c_int64(q.stride(0)), *pointers[1:], len(seqlens), tables.shape[1], k.shape[1],
        num_heads, k.shape[2], ctypes.c_float(softmax_scale or head_dim ** -0.5), int(causal), torch.get_num_threads())
    return out


def flash_attn_with_kvcache_cpu(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None, causal=False):
    """``flash_attn_with_kvcache`` for decode on CPU (one query per sequence), by the C++ kernel.

    Cases the kernel does not cover (several queries per sequence, a float16 cache, no compiler)
    go to the pure-torch reference, which has the same semantics.
    """
    batch, seqlen_q, num_heads, head_dim = q.shape
    ok = seqlen_q == 1 and q.dtype in _DTYPES and k_cache.dtype == q.dtype
    library = _load("cpu_attention.cpp", head_dim) if ok else None
    if library is None:
        return flash_attn_with_kvcache_torch(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal)
    q, k_cache, v_cache = _heads_contiguous(q), k_cache.contiguous(), v_cache.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    tables, seqlens = block_table.int().contiguous(), cache_seqlens.int().contiguous()
    pointers = [ctypes.c_void_p(t.data_ptr()) for t in (q, k_cache, v_cache, tables, seqlens, out)]
    getattr(library, "decode_" + _DTYPES[q.dtype])(
        pointers[0], ctypes.c_int64(q.stride(0)), *pointers[1:], batch, tables.shape[1], k_cache.shape[1],
        num_heads, k_cache.shape[2], ctypes.c_float(softmax_scale or head_dim ** -0.5), torch.get_num_threads())
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """``RMSNorm.forward`` in one pass (cpu_layers.cpp). With a residual, the sum is written into it."""
    assert residual is None or (residual.is_contiguous() and residual.shape == x.shape)
    x = x.contiguous()
    out = torch.empty_like(x)
    rows, cols = x.numel() // x.shape[-1], x.shape[-1]
    pointers = [ctypes.c_void_p(t.data_ptr() if t is not None else None) for t in (x, residual, weight, out)]
    getattr(_load("cpu_layers.cpp"), "add_rms_norm_" + _DTYPES[x.dtype])(
        *pointers, rows, cols, ctypes.c_float(eps), torch.get_num_threads())
    return out if residual is None else (out, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``SiluAndMul.forward`` in one pass (cpu_layers.cpp)."""
    x = x.contiguous()
    out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
    getattr(_load("cpu_layers.cpp"), "silu_and_mul_" + _DTYPES[x.dtype])(
        ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()), out.numel() // out.shape[-1], out.shape[-1],
        torch.get_num_threads())
    return out


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor):
    """``RotaryEmbedding.forward`` in one pass over q and k, rotating them in place (cpu_layers.cpp)."""
    q, k, positions = _heads_contiguous(q), _heads_contiguous(k), positions.long().contiguous()
    getattr(_load("cpu_layers.cpp"), "rotary_" + _DTYPES[q.dtype])(
        ctypes.c_void_p(q.data_ptr()), ctypes.c_void_p(k.data_ptr()), ctypes.c_int64(q.stride(0)),
        ctypes.c_int64(k.stride(0)), q.shape[-2], k.shape[-2], q.shape[-1], ctypes.c_void_p(positions.data_ptr()),
        ctypes.c_void_p(cos_sin_cache.data_ptr()), len(positions), torch.get_num_threads())
    return q, k


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight ``[N, K]`` in cpu_linear.cpp's layout ``[ceil(N / 32), K / 2, 32, 2]``: strips of 32
    output columns, each k pair's 32 x 2 values side by side; zero rows pad N to whole strips."""
    n, k = weight.shape
    return F.pad(weight, (0, 0, 0, -n % 32)).view(-1, 32, k // 2, 2).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int):
    """``Linear.forward`` in bf16 by cpu_linear.cpp, over a weight from ``pack_linear_weight``."""
    rows = x.reshape(-1, x.shape[-1])
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    out = x.new_empty(rows.shape[0], out_features)
    _load("cpu_linear.cpp").linear_bfloat16(
        ctypes.c_void_p(rows.data_ptr()), ctypes.c_int64(rows.stride(0)), ctypes.c_void_p(packed_weight.data_ptr()),
        ctypes.c_void_p(bias.data_ptr() if bias is not None else None), ctypes.c_void_p(out.data_ptr()),
        rows.shape[0], out_features, rows.shape[1], torch.get_num_threads())
    return out.view(*x.shape[:-1], out_features)


def use_cpu_kernels(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Point the model's RMSNorms, SiLU-and-muls and rotary embedding at the kernels above, if they
    build for ``dtype``; in bf16 on a CPU with AVX512-BF16, its linear layers too."""
    if dtype not in _DTYPES or _load("cpu_layers.cpp") is None:
        return
    kernels = {RMSNorm: add_rms_norm, SiluAndMul: silu_and_mul, RotaryEmbedding: rotary}
    for module in model.modules():
        if type(module) in kernels:
            module.kernel = kernels[type(module)]
    if dtype != torch.bfloat16 or "avx512_bf16" not in _cpu_features().split() or _load("cpu_linear.cpp") is None:
        return
    for module in model.modules():
        if isinstance(module, Linear) and module.in_features % 2 == 0:
            module.packed_weight = pack_linear_weight(module.weight.detach())
            module.weight, module.kernel = None, linear
