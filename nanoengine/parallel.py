"""Tensor parallelism's plumbing: which part of a weight a rank holds, and what travels between ranks.

Megatron-style tensor parallelism splits each large weight over ``size`` processes (ranks), so
each rank computes a slice of every layer (linear.py says which slice). Two collectives stitch
the slices back together: an all-reduce sums the partial results of a row-parallel layer and of
the vocab-parallel embedding, and the LM head's vocabulary slices are gathered to rank 0, which
samples. Once per step, rank 0 (the driver, which alone schedules) broadcasts the step's inputs
to the others (``send_step`` / ``receive_step``): the workers need no scheduler, no tokenizer and
no sampling RNG, and run the same forward on the same inputs.

Everything travels over torch.distributed (gloo on CPU, NCCL on CUDA), never shared memory, so
the same code runs across machines. The group is a process group object of our own on the
engine's own store, not torch.distributed's default group: a process has only one default group,
and two engines in one process must not collide.
"""

import datetime
import math
from dataclasses import dataclass, fields
from typing import Callable

import torch
import torch.distributed as dist

from nanoengine.context import Context

# A live rank answers within seconds (a dead one's closed connection fails a collective at once);
# these bound only a rank that hangs. Generous for the first collective, which waits for every rank
# to load its shard. After it, ranks meet at every layer of a step, each computing the same layer on
# the same inputs, so a peer later than a minute has hung: the group fails, and with it the engine
# (a server's /health answers 503), rather than every request waiting out ten minutes.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
STEP_COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=1)
# A worker waits for the next step as long as the engine is idle (a server with no requests).
IDLE_TIMEOUT = datetime.timedelta(days=365)

STEP_FIELDS = ("input_ids", "positions", *(f.name for f in fields(Context)))
MAX_NDIM = 2
FIELD_LEN = 3 + MAX_NDIM  # kind, value (or dtype), ndim, shape
HEADER_LEN = 2 + FIELD_LEN * len(STEP_FIELDS)  # "step" or "shutdown", payload length, then the fields
NONE, INT, BOOL, TENSOR = range(4)
DTYPES = (torch.int64, torch.int32, torch.bool)  # integer tensors travel widened to int64
SHUTDOWN, STEP = 0, 1


@dataclass(frozen=True)
class Shard:
    """Rows ``[start, start + size)`` of a checkpoint dimension ``total`` long: the part a rank holds.

    Rows past ``total`` are padding, left zero: the last rank's share of a vocabulary that does not
    divide evenly.
    """

    total: int
    start: int
    size: int

    @classmethod
    def whole(cls, total: int) -> "Shard":
        return cls(total, 0, total)

    @classmethod
    def split(cls, total: int, tp: "TensorParallelGroup | None") -> "Shard":
        """This rank's equal share of ``total`` rows (the last one padded if they do not divide)."""
        if tp is None:
            return cls.whole(total)
        per_rank = -(-total // tp.size)
        return cls(total, tp.rank * per_rank, per_rank)


class TensorParallelGroup:
    """This process's ``rank`` among ``size`` ranks, and the collectives between them.

    A failed collective (a rank died, or one timed out) leaves the ranks out of step for good: every
    later call raises the same error at once rather than waiting on a partner that is not coming.
    So does a step that rank 0 started but did not finish (an exception or Ctrl-C mid-forward).
    """

    def __init__(self, rank: int, size: int, store: dist.Store, device: torch.device):
        self.rank, self.size, self.device = rank, size, device
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = COLLECTIVE_TIMEOUT
            self._pg = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            self._pg = dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)
        self.failure: str | None = None
        self.timeout = COLLECTIVE_TIMEOUT  # STEP_COLLECTIVE_TIMEOUT once a collective has completed
        self.in_step = False  # rank 0: a step was sent and its logits not yet gathered
        # Rank 0's explanation of a failed collective (which worker died); set by worker.py.
        self.describe_failure: Callable[[], str | None] = lambda: None

    def _run(self, start_work: Callable) -> None:
        if self.failure is not None:
            raise RuntimeError(self.failure)
        try:
            start_work().wait()
        except RuntimeError as e:
            self.failure = (f"tensor-parallel rank {self.rank} lost its peers ({self.describe_failure() or e}); "
                            "the ranks are out of step: create a new engine")
            raise RuntimeError(self.failure) from e
        self.timeout = STEP_COLLECTIVE_TIMEOUT  # every rank has loaded: see STEP_COLLECTIVE_TIMEOUT

    def all_reduce(self, x: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """x summed (or reduced by ``op``) over the ranks, in place."""
        options = dist.AllreduceOptions()
        options.reduceOp, options.timeout = op, self.timeout
        self._run(lambda: self._pg.allreduce([x], options))
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x concatenated along the last dimension, on rank 0; None elsewhere."""
        x = x.contiguous()
        options = dist.GatherOptions()
        options.rootRank, options.timeout = 0, self.timeout
        parts = [[torch.empty_like(x) for _ in range(self.size)]] if self.rank == 0 else []
        self._run(lambda: self._pg.gather(parts, [x], options))
        self.in_step = False
        return torch.cat(parts[0], dim=-1) if self.rank == 0 else None

    def _broadcast(self, x: torch.Tensor, timeout: datetime.timedelta | None = None) -> None:
        options = dist.BroadcastOptions()
        options.rootRank, options.timeout = 0, timeout or self.timeout
        self._run(lambda: self._pg.broadcast([x], options))

    def send_step(self, **step) -> None:
        """Rank 0: send a step's inputs (``STEP_FIELDS``: the input ids, positions and the Context's
        fields, each a tensor, an int, a bool or None) to every other rank; two broadcasts."""
        if self.in_step and self.failure is None:
            self.failure = ("a tensor-parallel step was interrupted mid-forward, so the ranks are out of step: "
                            "create a new engine")
        if self.failure is not None:
            raise RuntimeError(self.failure)
        header, payload = torch.zeros(HEADER_LEN, dtype=torch.int64), []
        header[0] = STEP
        for i, name in enumerate(STEP_FIELDS):
            field = header[2 + i * FIELD_LEN:2 + (i + 1) * FIELD_LEN]
            value = step[name]
            if isinstance(value, torch.Tensor):
                assert value.dtype in DTYPES and value.dim() <= MAX_NDIM, f"{name} cannot travel: {value.dtype}"
                field[:3 + value.dim()] = torch.tensor([TENSOR, DTYPES.index(value.dtype), value.dim(), *value.shape])
                payload.append(value.flatten().to(torch.int64))
            elif value is not None:
                field[:2] = torch.tensor([BOOL if isinstance(value, bool) else INT, int(value)])
        payload = torch.cat(payload) if payload else torch.zeros(0, dtype=torch.int64, device=self.device)
        header[1] = payload.numel()
        self._broadcast(header.to(self.device))
        self._broadcast(payload.to(self.device))
        self.in_step = True

    def receive_step(self) -> dict | None:
        """Every other rank: the next step's inputs as rank 0 sent them, or None when it shuts down."""
        header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
        self._broadcast(header, IDLE_TIMEOUT)
        header = header.tolist()
        if header[0] == SHUTDOWN:
            return None
        payload = torch.empty(header[1], dtype=torch.int64, device=self.device)
        self._broadcast(payload)
        step, offset = {}, 0
        for i, name in enumerate(STEP_FIELDS):
            kind, value, ndim, *shape = header[2 + i * FIELD_LEN:2 + (i + 1) * FIELD_LEN]
            if kind == TENSOR:
                shape = shape[:ndim]
                numel = math.prod(shape)
                step[name] = payload[offset:offset + numel].view(shape).to(DTYPES[value])
                offset += numel
            else:
                step[name] = None if kind == NONE else bool(value) if kind == BOOL else value
        return step

    def send_shutdown(self) -> None:
        """Rank 0: tell every other rank to leave its loop, then close this rank's end of the group.

        A collective's tensors are released by the process group's own thread, a moment after
        ``wait()`` has returned. Had their Python objects gone by then, that thread would need the
        GIL to free them, and at interpreter exit (where this usually runs) Python ends such a
        thread mid-destructor: std::terminate, a SIGABRT at exit in 4 of 41 torchrun runs here. So the
        group is destroyed here, joining its threads, while ``header`` is still referenced.
        """
        header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
        header[0] = SHUTDOWN
        self._broadcast(header)
        self.failure = "this tensor-parallel group was shut down: create a new engine"
        self._pg = None  # its only reference: the destructor runs, and joins the group's threads, now
