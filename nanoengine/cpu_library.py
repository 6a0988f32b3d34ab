"""Building, caching and loading the CPU kernels' C++ files (csrc/cpu_*.cpp), and their C signatures.

The kernels are small, so they are compiled with the system C++ compiler (attention for the
model's head size) the first time a model needs them, in about 3.5 s, and cached under
~/.cache/nanoengine. Without a compiler the engine still runs, on the pure-torch code, and says
so once.

Loading a kernel changes nothing else in the process. ``-ffast-math`` lets the compiler vectorise
the kernels' reductions, but linked into a shared object it also brings the compiler's fast-math
start-up code, which turns on flush-to-zero for the whole process as the library loads (every
other library would then compute differently). So fast-math is a flag for compiling only: the
source becomes an object file with it, and the object a shared library without it.

Every entry point's argument types are declared once, when its library loads, so that ctypes
itself refuses an argument of the wrong kind rather than passing C++ whatever bits it holds; the
kernels that take index arguments check them and return an error code, an int. Each is then
wrapped in a ``Kernel``, which a CPU graph (cpu_graph.py) records calls through, each as a
``KernelCall``: the arguments ready for ctypes, and the same as the 64-bit words that the
kernel's C++ twin takes (cpu_graph.h), for a replay that makes its calls from C++. What is being
recorded is the calling thread's (``recording``): the libraries are shared by every engine in the
process, and two engines on two threads, one capturing, must not record each other's calls.
"""

import ctypes
import functools
import os
import platform
import struct
import subprocess
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import xxhash

CSRC = Path(__file__).parent / "csrc"  # the C++ sources, package data
_HEADERS = sorted(CSRC.glob("cpu_*.h"))  # every kernel file may include them
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_LAYERS_SIGNATURES = {  # the same for the bfloat16 and float32 kernels
    "add_rms_norm": [_P, _P, _P, _P, _I, _I, _F, _I],
    "silu_and_mul": [_P, _P, _I, _I, _I],
    "rotary": [_P, _P, _I64, _I64, _I, _I, _I, _P, _P, _I64, _I, _I],
}
_ATTENTION_SIGNATURES = {
    "decode": [_P, _I64, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _I, _F, _F, _I],
    "prefill": [_P, _I64, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _I, _I, _F, _F, _I],
    "store_kvcache": [_P, _P, _I64, _I64, _P, _P, _P, _I, _I64, _I64, _F, _F, _I],  # into an 8-bit cache
}
# Each attention kernel's query dtypes, and what a cache may hold beside the queries' dtype.
_ATTENTION_KERNELS = [f"{dtype}{cache}" for dtype in ("bfloat16", "float32")
                      for cache in ("", "_fp8_e4m3", "_fp8_e5m2")]
# These return an int: an error code, 0 if done (replay: how many of its steps it made).
RETURNS_INT = ("store_kvcache", "decode", "prefill", "rotary", "replay", "amx_")
SIGNATURES = {  # each file's extern "C" functions and their argument types
    "cpu_graph.cpp": {"replay": [_P, _I]},
    "cpu_attention.cpp": {"store_kvcache": [_P, _P, _I64, _I64, _P, _P, _P, _I, _I64, _I64, _I]}
    | {f"{name}_{kernel}": args for name, args in _ATTENTION_SIGNATURES.items() for kernel in _ATTENTION_KERNELS
       if "fp8" in kernel or name != "store_kvcache"},
    "cpu_layers.cpp": {f"{name}_{dtype}": args for name, args in _LAYERS_SIGNATURES.items()
                       for dtype in ("bfloat16", "float32")},
    "cpu_linear.cpp": {"linear_bfloat16": [_P, _I64, _P, _P, _P, _I, _I, _I, _I]},
    "cpu_int8_gemm.cpp": {"amx_ready": []} | {f"{name}_{dtype}": args for name, args in (
        ("quantize_activations", [_P, _I64, _I, _I, _I, _P, _I64, _P, _I]),
        ("rescale", [_P, _P, _P, _P, _P, _I, _I, _I]),
        ("amx_gemm", [_P, _P, _I, _I, _P, _P, _P, _P, _I, _I])) for dtype in ("bfloat16", "float32")},
    "cpu_quantized_linear.cpp": {f"quantized_linear_{dtype}": [_P, _I64, _P, _P, _P, _P, _I, _I, _I, _I]
                                 for dtype in ("bfloat16", "float32")},
    "cpu_sampler.cpp": {f"sample_{dtype}": [_P, _I64, _I, _I, _P, _P, _P, _I] for dtype in ("bfloat16", "float32")},
}


# Per thread, as torch's dispatch modes are: the list of calls the thread's CPU graph is capturing.
_capture = threading.local()


@contextmanager
def recording(calls: list):
    """Append each kernel call this thread makes in the block to ``calls`` (a ``KernelCall``)."""
    _capture.calls = calls
    try:
        yield
    finally:
        _capture.calls = None


class Kernel:
    """A C++ entry point, called like the ctypes function it wraps; ``twin`` is the address of its
    ``_words`` twin. Inside ``recording``, each call on that thread is also appended to its list."""

    def __init__(self, function: ctypes._CFuncPtr, twin: int):
        self.function, self.twin = function, twin

    def __call__(self, *args):
        if (calls := getattr(_capture, "calls", None)) is not None:
            calls.append(KernelCall(self, args))
        return self.function(*args)


class KernelCall:
    """A recorded kernel call: callable again, with its arguments already ctypes values, and those
    arguments as the words its twin takes (``words``), for cpu_graph.cpp's replay."""

    def __init__(self, kernel: Kernel, args: tuple):
        self.function, self.twin = kernel.function, kernel.twin
        self.args = [kind(arg) for kind, arg in zip(kernel.function.argtypes, args)]
        self.words = (ctypes.c_uint64 * len(args))(*map(_word, self.args))

    def __call__(self) -> int | None:
        return self.function(*self.args)


def _word(arg: ctypes._SimpleCData) -> int:
    """A ctypes argument as cpu_graph.h's from_word reads it back."""
    if isinstance(arg, ctypes.c_float):
        return struct.unpack("<I", struct.pack("<f", arg.value))[0]
    return (arg.value or 0) & 0xFFFF_FFFF_FFFF_FFFF  # a pointer (None: null) or an integer


def cpu_features() -> str:
    """What ``-march=native`` compiles for. Part of the cache key, so that a home directory shared
    by different machines never hands one a kernel with instructions its CPU lacks."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.machine()


def _build(source: Path, head_dim: int | None, library_dir: Path) -> Path:
    """The shared library of ``source``, compiled unless the cache already holds it."""
    compiler = os.environ.get("CXX", "g++")
    compile_cmd = [compiler, "-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-c"]
    compile_cmd += [f"-DHEAD_DIM={head_dim}"] if head_dim else []
    link_cmd = [compiler, "-shared", "-fopenmp"]  # no -ffast-math here: see the module docstring
    key = xxhash.xxh64(source.read_bytes() + b"".join(header.read_bytes() for header in _HEADERS)
                       + " ".join([*compile_cmd, "&&", *link_cmd, cpu_features()]).encode())
    library = library_dir / f"{source.stem}_{key.hexdigest()}.so"
    if not library.exists():
        library_dir.mkdir(parents=True, exist_ok=True)
        partial = library.with_suffix(f".{os.getpid()}.tmp")  # concurrent builds never see half a file
        obj = library.with_suffix(f".{os.getpid()}.o")
        try:
            subprocess.run([*compile_cmd, str(source), "-o", str(obj)], check=True, capture_output=True)
            subprocess.run([*link_cmd, str(obj), "-o", str(partial)], check=True, capture_output=True)
        finally:
            obj.unlink(missing_ok=True)
        os.replace(partial, library)
    return library


def cache_dir() -> Path:
    """Where nanoengine keeps what it builds once: compiled kernels, converted GGUF models."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nanoengine"


@functools.cache
def load(source: str, head_dim: int | None = None) -> ctypes.CDLL | None:
    """The compiled ``source`` (a .cpp file in csrc/), for ``head_dim`` if it needs one, with
    its functions' argument types declared and each kernel (an entry point with a ``_words`` twin)
    wrapped in a ``Kernel``; None, after a warning, if it cannot be built."""
    try:
        library = ctypes.CDLL(str(_build(CSRC / source, head_dim, cache_dir())))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.decode(errors="replace")[-500:] if isinstance(e, subprocess.CalledProcessError) else e
        warnings.warn(f"could not build the CPU kernels in {source} ({detail}); "
                      "they are replaced by slower pure-torch code")
        return None
    for name, argtypes in SIGNATURES[source].items():
        function = getattr(library, name)
        function.argtypes = argtypes
        function.restype = ctypes.c_int if name.startswith(RETURNS_INT) else None
        if hasattr(library, f"{name}_words"):
            twin = ctypes.cast(getattr(library, f"{name}_words"), ctypes.c_void_p).value
            setattr(library, name, Kernel(function, twin))
    return library
