"""The other ranks of a tensor-parallel engine: starting them, their loop, and stopping them.

Rank 0 (the driver) runs the scheduler, prepares each step's inputs and sends them to the other
ranks (parallel.py), and samples from the logits gathered back to it. Every other rank (a worker)
only loops: receive a step, run the forward on it, take part in its collectives. The alternative,
every rank running the same deterministic scheduler (vLLM's torchrun mode), would need the
requests, the tokenizer and bit-identical sampling on every rank; here a worker holds only its
shard of the model and its KV cache, and one rank decides everything.

Two ways to start the ranks:

- ``LLM(model, tensor_parallel_size=N)`` on one machine starts N-1 processes
  (``python -m nanoengine.worker``), which meet on a store the driver opens on a free port of
  127.0.0.1, so two engines in one process never share a port or a group. Not multiprocessing's
  spawn: that re-runs the user's script in every worker unless it is guarded by ``if __name__``.
- ``torchrun`` (one machine or several) starts every rank with the same script; there ``LLM(...)``
  joins through torchrun's env:// rendezvous (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
  ``WORLD_SIZE``). On ranks other than 0 it serves as a worker and, when rank 0 shuts down, ends
  the process (``SystemExit``), so the rest of the script runs on rank 0 only.

Failure: a worker that dies closes its connections, so the driver's next collective fails at once
and the error names the worker and its exit code. Workers are stopped when the engine is deleted
or the interpreter exits (a ``weakref.finalize``); a worker whose driver dies sees its connection
close and exits.
"""

import os
import pickle
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from nanoengine.config import Config
from nanoengine.context import Context
from nanoengine.loader import load_hf_config
from nanoengine.model import check_tensor_parallel_size
from nanoengine.model_runner import ModelRunner
from nanoengine.parallel import COLLECTIVE_TIMEOUT, TensorParallelGroup

SHUTDOWN_GRACE_SECONDS = 10  # a worker asked to stop gets this long before it is killed


class Workers:
    """Rank 0's handle on the other ranks: their group and the processes it started (none under torchrun)."""

    def __init__(self, group: TensorParallelGroup, processes: list[subprocess.Popen], threads: int,
                 store: dist.Store | None = None):
        # The store's server runs in this process: it is kept as long as the workers.
        self.group, self.processes, self.store = group, processes, store
        # A closure over the processes, not a bound method: the group must not keep this object alive.
        group.describe_failure = lambda: describe_exits(processes)
        previous_threads = torch.get_num_threads()
        torch.set_num_threads(threads)  # rank 0's share of the cores, given back at shutdown
        self.shutdown = weakref.finalize(self, stop, group, processes, previous_threads)


def start_workers(config: Config, hf_config: PretrainedConfig, path: str) -> Workers:
    """Check that the model splits over ``config.tensor_parallel_size`` ranks, then start the other
    ranks, or join torchrun's (where ranks other than 0 serve here and then exit the process)."""
    size = config.tensor_parallel_size
    check_tensor_parallel_size(hf_config, size)
    device = config.torch_device
    if "TORCHELASTIC_RUN_ID" in os.environ or "WORLD_SIZE" in os.environ:
        return join_torchrun(config, path)
    if device.type == "cuda" and size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={size} needs a GPU per rank, but torch sees "
                         f"{torch.cuda.device_count()}")
    threads = ranks_threads(size)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT)
    store.set("engine", pickle.dumps((config, path, threads)))
    # The worker imports this very nanoengine, wherever it was imported from.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent.parent),
                                                                    os.environ.get("PYTHONPATH")])))
    processes = [subprocess.Popen([sys.executable, "-m", "nanoengine.worker", "127.0.0.1", str(store.port), str(rank),
                                   str(size)], env=env) for rank in range(1, size)]
    try:
        while not store.check([f"joined/{rank}" for rank in range(1, size)]):
            if (exits := describe_exits(processes, wait_seconds=0)) is not None:
                raise RuntimeError(f"tensor-parallel {exits} while starting (its output is above)")
            time.sleep(0.05)
        group = TensorParallelGroup(0, size, dist.PrefixStore("group", store), device)
    except BaseException:
        stop(None, processes, torch.get_num_threads())
        raise
    return Workers(group, processes, threads, store)


def join_torchrun(config: Config, path: str) -> Workers:
    """Rank 0's group under torchrun; on any other rank, serve steps and then end the process."""
    store, rank, world_size = next(dist.rendezvous("env://"))
    if world_size != config.tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size}, but torchrun started "
                         f"{world_size} processes (WORLD_SIZE): pass the same number to both")
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if config.torch_device.type == "cuda":
        if local_ranks > torch.cuda.device_count():
            raise ValueError(f"{local_ranks} ranks on this machine need a GPU each, but torch sees "
                             f"{torch.cuda.device_count()}")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    group = TensorParallelGroup(rank, world_size, dist.PrefixStore("nanoengine", store), config.torch_device)
    if rank == 0:
        return Workers(group, [], ranks_threads(local_ranks))
    torch.set_num_threads(ranks_threads(local_ranks))
    serve(config, path, group)
    raise SystemExit(0)


def ranks_threads(local_ranks: int) -> int:
    """Threads per rank on CPU: the cores split among the ranks on this machine (never more than
    torch was already allowed, so OMP_NUM_THREADS still caps it)."""
    return max(1, min(torch.get_num_threads(), len(os.sched_getaffinity(0)) // local_ranks))


def serve(config: Config, path: str, group: TensorParallelGroup) -> None:
    """A worker's life: build its model runner (its shard, its KV cache), then run every step rank 0
    sends until it says stop."""
    runner = ModelRunner(config, load_hf_config(path, config.hf_overrides), path, group)
    while (step := group.receive_step()) is not None:
        input_ids, positions = step.pop("input_ids"), step.pop("positions")
        runner.execute_model(input_ids, positions, Context(**step))


def describe_exits(processes: list[subprocess.Popen], wait_seconds: float = 2.0) -> str | None:
    """Which workers have exited, and how; None if all run. A worker whose connection just closed
    may take a moment to be reaped, so wait up to ``wait_seconds`` for one to show."""
    deadline = time.monotonic() + wait_seconds
    while processes and all(p.poll() is None for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    exits = [f"worker rank {rank} (pid {p.pid}) " + (f"was killed by {signal.Signals(-p.returncode).name}"
                                                      if p.returncode < 0 else f"exited with code {p.returncode}")
             for rank, p in enumerate(processes, start=1) if p.poll() is not None]
    return "; ".join(exits) or None


def stop(group: TensorParallelGroup | None, processes: list[subprocess.Popen], previous_threads: int) -> None:
    """Ask the workers to leave their loop, then make sure each process has ended."""
    healthy = group is not None and group.failure is None and not group.in_step
    if healthy:
        try:
            group.send_shutdown()
        except RuntimeError:
            healthy = False
    for p in processes:
        try:
            p.wait(timeout=SHUTDOWN_GRACE_SECONDS if healthy else 0)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    torch.set_num_threads(previous_threads)


def main() -> None:
    """A worker started by ``start_workers``: ``python -m nanoengine.worker HOST PORT RANK SIZE``."""
    host, port, rank, size = sys.argv[1], *map(int, sys.argv[2:5])
    store = dist.TCPStore(host, port, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    config, path, threads = pickle.loads(store.get("engine"))
    torch.set_num_threads(threads)
    if config.torch_device.type == "cuda":
        torch.cuda.set_device(rank)
    store.set(f"joined/{rank}", b"")
    serve(config, path, TensorParallelGroup(rank, size, dist.PrefixStore("group", store), config.torch_device))


if __name__ == "__main__":
    main()
