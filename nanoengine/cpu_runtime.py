"""What the model runner does differently on a CPU: where tensors' memory comes from, and which
of the model's layers run the C++ kernels (cpu_kernels.py).

Both are process-level concerns kept out of the runner's story: glibc's malloc is told to keep
freed memory (so each step's large activations are not mapped and faulted in again), the KV cache
comes from fresh zero pages that take RAM only when written, and the norms, activation, rotary
embedding and (in bf16, on CPUs with AVX512-BF16) linear layers are pointed at their kernels.
"""

import ctypes
import math
import mmap

import torch

from nanoengine import cpu_kernels
from nanoengine.cpu_library import cpu_features, load
from nanoengine.activation import SiluAndMul
from nanoengine.layernorm import RMSNorm
from nanoengine.rotary_embedding import RotaryEmbedding
from nanoengine.linear import Linear


def keep_freed_memory_for_reuse() -> None:
    """On CPU, stop glibc's malloc from handing large freed buffers back to the kernel.

    Every step allocates the same large activations again (a prefill's MLP output alone is tens
    of MB). By default glibc serves such sizes with a fresh ``mmap`` and unmaps them on free, so
    each step pays a page fault per 4 KiB touched; measured here, that made SiLU and the
    element-wise products of prefill 3-10x slower than the arithmetic, and the whole benchmark
    ~20% slower. Raising the mmap and trim thresholds keeps freed memory in the heap, where the
    next step finds it already mapped; the cost is that resident memory stays at its peak.
    A no-op where the C library is not glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    except (OSError, AttributeError):
        pass


def use_cpu_kernels(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Point the model's RMSNorms, SiLU-and-muls and rotary embedding at the C++ kernels, if they
    build for ``dtype``; in bf16 on a CPU with AVX512-BF16, its linear layers too."""
    if dtype not in cpu_kernels.DTYPES or load("cpu_layers.cpp") is None:
        return
    kernels = {RMSNorm: cpu_kernels.add_rms_norm, SiluAndMul: cpu_kernels.silu_and_mul,
               RotaryEmbedding: cpu_kernels.rotary}
    packs_linears = (dtype == torch.bfloat16 and "avx512_bf16" in cpu_features().split()
                     and load("cpu_linear.cpp") is not None)
    for module in model.modules():
        if type(module) in kernels:
            module.kernel = kernels[type(module)]
        elif packs_linears and isinstance(module, Linear) and not module.quantized and module.in_features % 2 == 0:
            module.use_cpu_kernel()


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros``, but on CPU in fresh anonymous memory (``mmap``), which the kernel hands out as
    zero pages, each faulted in when first written: the 1 GiB CPU KV cache is ready at once (filling
    it with zeros took 1-1.6 s here) and takes RAM only for blocks that have held tokens; the step
    that first fills a block pays for its pages instead. Unlike memory from the heap, it never holds
    a freed tensor's bytes, and it goes back to the kernel when the tensor is freed."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # Private, as heap memory is: Python's default for an anonymous map is shared, which here took
    # 1.5x as long to fault in and would be written through by a forked child.
    buffer = mmap.mmap(-1, math.prod(shape) * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps it alive
