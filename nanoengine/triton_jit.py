"""What every Triton kernel module imports: triton itself (None without it: a CPU-only install runs
without Triton, and config.py says so if it is asked for) and ``jit``, which compiles a kernel at
its first launch rather than at import.
"""

import functools

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


@functools.cache
def _jit(kernel, interpret: bool):
    return triton.jit(kernel)


def jit(kernel):
    """``triton.jit(kernel)``, made at first use: ``triton.jit`` decides when it is called whether to
    compile or to interpret (``TRITON_INTERPRET``), so a test can still choose after import."""
    if triton is None:
        raise ImportError("the Triton kernels need triton: pip install triton")
    return _jit(kernel, triton.knobs.runtime.interpret)
