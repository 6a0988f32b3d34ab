"""Decode through graphs: capture each batch-size bucket once, then replay it every step.

A decode step is tiny (one token per sequence), so on a GPU its time goes mostly to launching
hundreds of small kernels from Python. A CUDA graph records those launches once and replays them
with a single call. A graph is frozen: the same tensor addresses and shapes every replay. So
the runner owns static input/output buffers sized for ``max_num_seqs``, captures one graph per
bucket of batch sizes, and at run time pads a batch up to its bucket and copies it in.

A CPU has the same problem at small batches, with Python between the C++ kernels in place of
launches, and the same cure: a ``CPUGraph`` (cpu_graph.py) records a step's kernel calls and
replays them. Recording is nearly free (the step runs as it is recorded), so on CPU each bucket
is captured by its first real step, not at start-up; and only up to ``CPU_GRAPH_MAX_BATCH``,
where the Python is still a large share of the step. A batch with no graph to replay (past that
size, or with graphs off or failed) runs eagerly as it is, unpadded, with the same results.

Speculative decoding's verify steps are the same problem again: a handful of tokens per sequence
(the newest and its drafts), through the prefill attention. On CPU, a verify step whose sequences
all bring the same number of drafts is recorded and replayed too, keyed by its batch bucket and
its tokens per sequence; padded rows are sequences of slot -1 whose keys are block 0's. (At batch
1 that is every verify step; on CUDA they run eagerly, like prefill.)
"""

import warnings

import torch
from torch import nn

from nanoengine.context import Context
from nanoengine.cpu_graph import CPUGraph, GraphCaptureError, ReplayError

# Measured on the default model, 2 cores, ms per decode step with a CPU graph against without: int4
# 8.4-8.9 vs 19-22 at batch 1, 27-33 vs 46-49 at batch 8. The Python a graph removes is about the
# same at every batch size, 10-20 ms a step; once the matmuls ran on AMX tiles (bf16, Sapphire
# Rapids) that was still a fifth of a step at 48 and 64 (39-66 vs 56-72 ms, 52-60 vs 62-82), and
# bench.py's decode went from 617-713 to 790-898 tok/s. The cap bounds what graphs keep alive,
# every activation of their step (32 MB at batch 64 in bf16); past 64 the gain is unmeasured.
CPU_GRAPH_MAX_BATCH = 64


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every 16, and always ``max_num_seqs``.

    Small batches are common (the tail of a generate call) and cheap to pad finely; past 8, steps
    of 16 bound the padding waste while keeping the number of graphs (and capture time) small.
    """
    steps = [1, 2, 4, 8] + list(range(16, max_num_seqs, 16))
    return [b for b in steps if b < max_num_seqs] + [max_num_seqs]


class DecodeGraphRunner:
    """Decode steps (and, on CPU, speculative verify steps of up to ``max_query_len`` tokens per
    sequence) over static buffers sized for ``max_num_seqs``; graphs only if ``use_graphs``.
    A graph is keyed by ``(batch bucket, tokens per sequence)``: 1 for decode."""

    def __init__(self, model: nn.Module, max_num_seqs: int, max_num_blocks_per_seq: int, hidden_size: int,
                 device: torch.device, dtype: torch.dtype, use_graphs: bool, max_query_len: int = 1):
        self.model, self.max_query_len, self.max_seqlen_k = model, max_query_len, 0
        self.buckets = decode_buckets(max_num_seqs)
        # Verify steps (several tokens a sequence) are recorded only up to CPU_GRAPH_MAX_BATCH sequences.
        max_tokens = max(max_num_seqs, min(max_num_seqs, CPU_GRAPH_MAX_BATCH) * max_query_len)
        with torch.device(device):
            self.input_ids = torch.zeros(max_tokens, dtype=torch.int64)
            self.positions = torch.zeros(max_tokens, dtype=torch.int64)
            self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64)
            self.context_lens = torch.zeros(max_num_seqs, dtype=torch.int32)
            self.cu_seqlens_k = torch.zeros(max_num_seqs + 1, dtype=torch.int32)
            self.block_tables = torch.zeros(max_num_seqs, max_num_blocks_per_seq, dtype=torch.int32)
            self.hidden = torch.zeros(max_tokens, hidden_size, dtype=dtype)
        self.cu_seqlens_q: dict[int, torch.Tensor] = {}  # q -> 0, q, 2q, ...: a verify step's query offsets
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph | CPUGraph] = {}
        self.records_cpu_graphs = use_graphs and device.type == "cpu"
        if use_graphs and device.type == "cuda":
            self._capture_cuda_graphs()

    def _forward(self, n: int, q: int = 1) -> None:
        """One eager forward over the first ``n`` sequences of the static buffers, ``q`` tokens each:
        a decode step, or a verify step through the prefill attention (keys read from the cache)."""
        if q == 1:
            ctx = Context(is_prefill=False, slot_mapping=self.slot_mapping[:n], context_lens=self.context_lens[:n],
                          block_tables=self.block_tables[:n])
        else:
            cu_seqlens_q = self.cu_seqlens_q[q][:n + 1]
            # max_seqlen_k: the recorded step's (the C++ kernel reads the lengths from cu_seqlens_k).
            ctx = Context(is_prefill=True, slot_mapping=self.slot_mapping[:n * q], cu_seqlens_q=cu_seqlens_q,
                          cu_seqlens_k=self.cu_seqlens_k[:n + 1], max_seqlen_q=q, max_seqlen_k=self.max_seqlen_k,
                          block_tables=self.block_tables[:n])
        self.hidden[:n * q] = self.model(self.input_ids[:n * q], self.positions[:n * q], ctx)

    @torch.inference_mode()
    def _capture_cuda_graphs(self) -> None:
        """Capture one CUDA graph per bucket, largest first, all in one memory pool.

        The buffers hold slot -1 and context length 0 here, so capturing writes nothing to the KV
        cache. Graphs replay one at a time, so they can share one pool of intermediate memory;
        capturing the largest first lets every smaller graph fit inside what it already reserved.
        A kernel that syncs with the host breaks capture (flash-attn after 2.8.3 does, in its paged
        decode); then every bucket decodes eagerly, slower but with the same results.
        """
        pool = None
        try:
            for batch_size in reversed(self.buckets):
                self._forward(batch_size)  # warm-up: lazy set-up (cuBLAS handles, Triton jit) stays out of the graph
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._forward(batch_size)
                if pool is None:
                    pool = graph.pool()
                self.graphs[batch_size, 1] = graph
            torch.cuda.synchronize()
        except RuntimeError as e:
            self.graphs.clear()
            warnings.warn(f"CUDA graph capture failed, so decode runs eagerly (slower, same results): {e}. "
                          "A kernel synced with the host during capture; see docs/gpu.md "
                          "for a flash-attn version that does not, or pass enforce_eager=True to skip capture.",
                          RuntimeWarning)

    def can_run(self, ctx: Context, num_tokens: int) -> bool:
        """Whether this runner takes the step: every decode step; a verify step on CPU when each of
        its sequences computes the same number of tokens, no more than ``max_query_len``, reading
        its earlier keys from the cache."""
        if not ctx.is_prefill:
            return True
        n = len(ctx.cu_seqlens_q) - 1
        # (One token each through the prefill path, a prompt's last after a prefix hit, stays eager:
        # a key of one token per sequence is decode's.)
        return (ctx.block_tables is not None and ctx.max_seqlen_q * n == num_tokens
                and 1 < ctx.max_seqlen_q <= self.max_query_len
                and ctx.block_tables.shape[1] <= self.block_tables.shape[1])

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Context) -> torch.Tensor:
        """Decode or verify ``n`` sequences of ``q`` tokens each (``can_run``); returns their hidden
        states ``[n * q, hidden]``.

        The result may be a view of the static output buffer: use it before the next ``run``.
        """
        q = ctx.max_seqlen_q if ctx.is_prefill else 1
        n = input_ids.shape[0] // q
        batch_size = next(b for b in self.buckets if b >= n)
        graph = self.graphs.get((batch_size, q))
        records = graph is None and self.records_cpu_graphs and batch_size <= CPU_GRAPH_MAX_BATCH
        if graph is None and not records:
            return self.model(input_ids, positions, ctx)  # nothing to replay, so nothing to pad for
        self.input_ids[:n * q] = input_ids
        self.positions[:n * q] = positions
        self.slot_mapping[:n * q] = ctx.slot_mapping
        # Padded rows keep stale (valid) token ids and positions; what makes them harmless is slot
        # -1 (their K/V are written nowhere) and, decoding, context length 0 (they attend to
        # nothing, giving 0); verifying, q keys each, block 0's, whatever it holds.
        self.slot_mapping[n * q:batch_size * q] = -1
        if q == 1:
            self.context_lens[:n] = ctx.context_lens
            self.context_lens[n:batch_size] = 0
        else:
            if q not in self.cu_seqlens_q:  # made here, not while recording: a graph replays no allocation
                self.cu_seqlens_q[q] = torch.arange(0, len(self.cu_seqlens_k) * q, q, dtype=torch.int32,
                                                    device=input_ids.device)
            self.max_seqlen_k = ctx.max_seqlen_k
            self.cu_seqlens_k[:n + 1] = ctx.cu_seqlens_k
            self.cu_seqlens_k[n + 1:batch_size + 1] = ctx.cu_seqlens_k[n] + q * torch.arange(
                1, batch_size - n + 1, dtype=torch.int32, device=input_ids.device)
        # Zeroed first, so padded rows and the columns past this step's widest table name block 0:
        # always a valid index, and never read past a row's length.
        self.block_tables[:batch_size] = 0
        self.block_tables[:n, :ctx.block_tables.shape[1]] = ctx.block_tables
        if records:
            self._record_cpu_graph(batch_size, q)
            return self.hidden[:n * q]
        try:
            graph.replay()
        except ReplayError:
            self._forward(batch_size, q)  # the kernel's wrapper raises the error, with what was wrong
        return self.hidden[:n * q]

    def _record_cpu_graph(self, batch_size: int, q: int) -> None:
        """This step, recorded into its key's CPU graph as it runs. If the model does something a
        replay would not repeat, the step runs again eagerly (its kernels rewrite the same values)
        and so does every step after: the model is the same at every batch size."""
        graph = CPUGraph()
        try:
            with graph.capture():
                self._forward(batch_size, q)
        except GraphCaptureError as e:
            self.records_cpu_graphs = False
            warnings.warn(f"CPU graph capture failed, so decode runs eagerly (slower, same results): {e}",
                          RuntimeWarning)
            self._forward(batch_size, q)
            return
        self.graphs[batch_size, q] = graph
