"""CPU graphs: record a decode step's work once, then replay it without the Python around it.

A CUDA graph (graph_runner.py) records a step's kernel launches and replays them with one call,
because at small batches launching costs more than computing. A CPU decode step has the same
problem: at batch 1 the default model makes some 300 calls into the C++ kernels, and the Python
around them (module calls, argument checks, output allocation) took longer than the kernels.
A ``CPUGraph`` removes it the same way. While it captures, the step runs as usual and everything
that computes is appended to a list:

- each C++ kernel call (``cpu_library.Kernel``) with its arguments, already checked pointers and sizes;
- each torch op that writes: an in-place op as it was called, an op that made a new tensor
  through its ``out=`` form, into the very tensor capture got back, and a copy (``contiguous``,
  ``to``, which have no ``out=`` form) as a ``copy_`` into it.

Views and allocations compute nothing, so they are not replayed; the graph keeps every tensor made
during capture alive, so the addresses in the list stay valid. Replay calls the list again, on the
same tensors, so the step's inputs go into static buffers first. Each run of kernel calls is made
by one call into cpu_graph.cpp, which calls the kernels from C++ (at batch 1 in int4, 301 of the
step's 303 calls, in one run): called one by one through ctypes, they took 0.6-0.9 ms more a step.

As with a CUDA graph, only the contents of tensors may change between replays: shapes, Python
values and the choices Python made are those of the captured step. So capture refuses what a
replay could not repeat, where it can see it: reading a tensor's value into Python (``.item()``),
an op whose result's shape depends on values (``nonzero``, a boolean mask), and new tensors from
an op with no ``out=`` form. The caller then runs the step eagerly. Kernels still check index
values on every replay; one that refuses them makes ``replay`` raise ``ReplayError`` (its Python
wrapper, run eagerly, names the problem).
"""

import contextlib
import ctypes
import functools
import itertools
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanoengine import cpu_library
from nanoengine.cpu_library import KernelCall

aten = torch.ops.aten
# They return a new tensor whose contents are undefined: nothing to repeat.
ALLOCATIONS = {aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default,
               aten.empty_strided.default, aten.new_empty_strided.default}
# When they do not return their input itself, they return a copy of it.
COPIES = {aten.contiguous.default, aten.to.dtype, aten.to.dtype_layout}
# Their result's shape depends on their input's values, which a replay would not re-read.
VALUE_SHAPED = {aten.nonzero.default, aten.masked_select.default}
# They hand a tensor's value to Python (.item(), bool(t), torch.equal): what Python does with it is
# not replayed. (.tolist() and .numpy() read values without an op, unseen here.)
VALUE_READS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.equal.default}


class GraphCaptureError(RuntimeError):
    """The captured step did something a replay would not repeat."""


class ReplayError(RuntimeError):
    """A kernel refused its index arguments during replay (and changed nothing)."""


def _storages(values) -> set[int]:
    return {v.untyped_storage().data_ptr() for v in values if isinstance(v, torch.Tensor)}


class _Recorder(TorchDispatchMode):
    """Runs each torch op as usual and appends the ones that write to ``graph``'s calls."""

    def __init__(self, graph: "CPUGraph"):
        super().__init__()
        self.graph = graph
        self.tried = set()  # ops whose out= form has been called once

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch's default wraps __torch_dispatch__ to keep torch.compile out of it, and that
        # imports torch._dynamo at the first op: 2 s, here in a decode step. Nothing compiles here.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in VALUE_READS:
            raise GraphCaptureError(f"the step reads a tensor's value into Python ({func}, as .item() does), "
                                    "which a replay would not repeat")
        if func in VALUE_SHAPED or (func is aten.index.Tensor and any(
                i is not None and i.dtype == torch.bool for i in args[1])):
            raise GraphCaptureError(f"{func}'s result takes its shape from its input's values, which a "
                                    "replay would not repeat")
        result = func(*args, **kwargs)
        results = result if isinstance(result, (list, tuple)) else [result]
        self.graph.tensors += [r for r in results if isinstance(r, torch.Tensor)]
        if func._schema.is_mutable:  # in place (or out=): repeat it as called
            self.graph.calls.append(functools.partial(func, *args, **kwargs))
        elif func in ALLOCATIONS or _storages(results) <= _storages([*args, *kwargs.values()]):
            pass  # an allocation, or a view of its inputs
        elif func in COPIES:
            self.graph.calls.append(functools.partial(aten.copy_.default, result, args[0]))
        elif isinstance(result, torch.Tensor) and _out_form(func) is not None:
            call = functools.partial(_out_form(func), *args, **kwargs, out=result)
            if func not in self.tried:  # an out= form that does not fit fails here, not in a replay
                self.tried.add(func)
                try:
                    call()
                except (RuntimeError, TypeError) as e:
                    raise GraphCaptureError(f"{func}'s out= form does not replay it: {e}") from e
            self.graph.calls.append(call)
        else:
            raise GraphCaptureError(f"{func} returns new tensors, with no out= form to replay into them")
        return result


def _out_form(func):
    """aten's ``out=`` overload of ``func`` ("add.out" for "add.Tensor", "softmax.int_out" for
    "softmax.int"...), or None."""
    packet, name = func.overloadpacket, func._overloadname
    for out_name in ("out", f"{name}_out") if name in ("default", "Tensor") else (f"{name}_out",):
        if out_name in packet.overloads():
            return getattr(packet, out_name)
    return None


class _Step(ctypes.Structure):  # cpu_graph.cpp's Step
    _fields_ = [("kernel", ctypes.c_void_p), ("words", ctypes.c_void_p)]


class _KernelRun:
    """Consecutive recorded kernel calls, made by cpu_graph.cpp's replay in one call from Python."""

    def __init__(self, calls: list[KernelCall]):
        library = cpu_library.load("cpu_graph.cpp")
        if library is None:  # a compiler that built the kernels failed on this file: replay them eagerly
            raise GraphCaptureError("cpu_graph.cpp, which replays the kernel calls, could not be built")
        self.calls, self.replay = calls, library.replay
        self.steps = (_Step * len(calls))(*[(call.twin, ctypes.addressof(call.words)) for call in calls])

    def __call__(self) -> None:
        made = self.replay(self.steps, len(self.calls))
        if made < len(self.calls):
            raise ReplayError(f"{self.calls[made].function.__name__} refused its arguments")


class CPUGraph:
    """``torch.cuda.CUDAGraph``'s role on a CPU: ``with graph.capture(): step()``, then ``graph.replay()``."""

    def __init__(self):
        self.calls: list[Callable] = []  # KernelCalls and torch ops, in the order the step made them
        self.tensors: list[torch.Tensor] = []  # made during capture; the calls hold their addresses
        self.program: list[Callable] = []  # what replay calls: the calls, each run of KernelCalls as one

    @contextlib.contextmanager
    def capture(self):
        """Run the block, recording what this thread computes in it (other threads' work is theirs)."""
        with cpu_library.recording(self.calls), _Recorder(self):
            yield
        for is_kernel, run in itertools.groupby(self.calls, key=lambda call: isinstance(call, KernelCall)):
            self.program += [_KernelRun(list(run))] if is_kernel else list(run)

    @torch.inference_mode()  # capture is, in the model runner: writes to its tensors must be too
    def replay(self) -> None:
        for call in self.program:
            call()
