"""The CPU attention kernels: cpu_attention.cpp, compiled on first use and called via ctypes.

On CUDA, attention is flash-attn. On CPU, pure torch has no way to read the paged cache in place
for decode (the gather it needs instead roughly triples the step's memory traffic), and torch's
SDPA is slow at prefill's short prompts (see the .cpp file). The kernels are small, so they are
compiled with the system C++ compiler, for the model's head size, the first time a model needs
them (about a second), and cached under ~/.cache/nanoengine. Without a compiler the engine still
runs, on the pure-torch references, and says so once.
"""

import ctypes
import functools
import os
import platform
import subprocess
import warnings
from pathlib import Path

import torch
import xxhash

from nanoengine.attention import flash_attn_varlen_func_torch, flash_attn_with_kvcache_torch

_SOURCE = Path(__file__).with_name("cpu_attention.cpp")
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
def _load(head_dim: int) -> ctypes.CDLL | None:
    flags = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", f"-DHEAD_DIM={head_dim}"]
    compiler = os.environ.get("CXX", "g++")
    key = xxhash.xxh64(_SOURCE.read_bytes() + " ".join([compiler, *flags, _cpu_features()]).encode()).hexdigest()
    cache_dir = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nanoengine"
    library = cache_dir / f"cpu_attention_{key}.so"
    try:
        if not library.exists():
            cache_dir.mkdir(parents=True, exist_ok=True)
            partial = library.with_suffix(f".{os.getpid()}.tmp")  # concurrent builds never see half a file
            subprocess.run([compiler, *flags, str(_SOURCE), "-o", str(partial)], check=True, capture_output=True)
            os.replace(partial, library)
        return ctypes.CDLL(str(library))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.decode(errors="replace")[-500:] if isinstance(e, subprocess.CalledProcessError) else e
        warnings.warn(f"could not build the CPU attention kernels ({detail}); "
                      "attention runs on the slower pure-torch references")
        return None


def flash_attn_varlen_func_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale=None, causal=False, block_table=None):
    """``flash_attn_varlen_func`` on CPU (prefill), by the C++ kernel; same arguments and semantics.

    A float16 cache, or no compiler, goes to the pure-torch reference instead.
    """
    num_heads, head_dim = q.shape[1:]
    library = _load(head_dim) if q.dtype in _DTYPES and k.dtype == q.dtype else None
    if library is None:
        return flash_attn_varlen_func_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            softmax_scale, causal, block_table)
    if block_table is None:
        # Packed K/V read as a paged cache whose blocks hold one token each: sequence i's "blocks"
        # are its own rows, cu_seqlens_k[i], cu_seqlens_k[i] + 1, ...
        block_table = cu_seqlens_k[:-1, None] + torch.arange(max_seqlen_k, device=q.device, dtype=torch.int32)
        k, v = k.unsqueeze(1), v.unsqueeze(1)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    tables, cu_q = block_table.int().contiguous(), cu_seqlens_q.int().contiguous()
    seqlens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).int().contiguous()
    pointers = [ctypes.c_void_p(t.data_ptr()) for t in (q, k, v, tables, cu_q, seqlens, out)]
    getattr(library, "prefill_" + _DTYPES[q.dtype])(
        *pointers, len(seqlens), tables.shape[1], k.shape[1], num_heads, k.shape[2],
        ctypes.c_float(softmax_scale or head_dim ** -0.5), int(causal), torch.get_num_threads())
    return out


def flash_attn_with_kvcache_cpu(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None, causal=False):
    """``flash_attn_with_kvcache`` for decode on CPU (one query per sequence), by the C++ kernel.

    Cases the kernel does not cover (several queries per sequence, a float16 cache, no compiler)
    go to the pure-torch reference, which has the same semantics.
    """
    batch, seqlen_q, num_heads, head_dim = q.shape
    library = _load(head_dim) if seqlen_q == 1 and k_cache.dtype in _DTYPES else None
    if library is None:
        return flash_attn_with_kvcache_torch(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal)
    # q and out are tiny (one row per sequence), so they cross in float32; the cache never moves.
    q32 = q.reshape(batch, num_heads, head_dim).float().contiguous()
    out = torch.empty_like(q32)
    tables, seqlens = block_table.int().contiguous(), cache_seqlens.int().contiguous()
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    pointers = [ctypes.c_void_p(t.data_ptr()) for t in (q32, k_cache, v_cache, tables, seqlens, out)]
    getattr(library, "decode_" + _DTYPES[k_cache.dtype])(
        *pointers, batch, tables.shape[1], k_cache.shape[1], num_heads, k_cache.shape[2],
        ctypes.c_float(softmax_scale or head_dim ** -0.5), torch.get_num_threads())
    return out.view(batch, 1, num_heads, head_dim).to(q.dtype)
