"""The model runner: owns the model and the KV cache, and turns scheduled sequences into tokens.

Each step it packs the scheduled sequences into flat input tensors, builds the step's attention
metadata (slot mapping, cu_seqlens or context lengths, block tables), runs the model, and
samples one token per sample row: one per sequence, or ``n`` from one logit row at a request's
first sample. Logprobs are computed only when some sequence of the step asks for them.

With tensor parallelism every rank has a model runner over its shard of the model and its own KV
cache (its kv heads); rank 0's also sends each step's inputs to the others (``compute_logits``),
which run ``execute_model`` on them (worker.py).
"""

import dataclasses

import torch
from transformers import PretrainedConfig

from nanoengine.attention import Attention, get_backend
from nanoengine.config import Config
from nanoengine.context import Context
from nanoengine.cpu_runtime import keep_freed_memory_for_reuse, use_cpu_kernels, zeros
from nanoengine.graph_runner import DecodeGraphRunner
from nanoengine.linear import quantize_linears
from nanoengine.loader import load_dummy_weights, load_weights
from nanoengine.logits_processors import build_logits_processors
from nanoengine.model import build_model
from nanoengine.parallel import TensorParallelGroup
from nanoengine.sampler import Sampler, SamplerOutput, compute_logprobs
from nanoengine.sequence import Sequence

CPU_KVCACHE_BYTES = 1 << 30  # the RAM budget for the KV cache on CPU


def kvcache_budget_bytes(total: int, free: int, torch_reserved: int, torch_peak: int, graph_pool: int,
                         utilization: float) -> int:
    """Bytes left for the KV cache on a GPU, from memory figures taken after the warm-up.

    Our share is ``total * utilization``. From it come: what lives outside PyTorch's allocator
    (``total - free - torch_reserved``: the CUDA context, library workspaces, other processes; a
    process already using part of the GPU shrinks our share rather than being overrun), this
    process's peak of tensors (weights plus the largest step's activations), and room for the
    CUDA-graph pool, which is allocated after the cache because graphs capture its address.
    """
    outside_torch = total - free - torch_reserved
    return int(total * utilization) - outside_torch - torch_peak - graph_pool


def warmup_lengths(num_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths for the warm-up: the largest step the scheduler can form.

    All ``num_tokens`` of the step's budget, in as many sequences as a step may hold (each one
    logit row), none longer than ``max_model_len`` (the rotary table's length).
    """
    num_seqs = max(min(max_num_seqs, num_tokens), -(-num_tokens // max_model_len))
    return [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]


def kvcache_block_size(requested: int | None, attention_kernels: str) -> int:
    """The KV block size: 256 for flash-attn (its paged KV cache needs pages of a multiple of 256),
    else 16, which lets the prefix cache share prompts at a finer grain."""
    flash_attn = attention_kernels == "flash-attn"
    block_size = requested or (256 if flash_attn else 16)
    if flash_attn and block_size % 256:
        raise ValueError(f"kvcache_block_size={block_size}: flash-attn's paged KV cache needs a multiple of 256 "
                         "(leave it unset for 256, or pass attention_backend='triton')")
    return block_size


class ModelRunner:
    def __init__(self, config: Config, hf_config: PretrainedConfig, model_path: str,
                 tp: TensorParallelGroup | None = None, eos_token_ids: set[int] = frozenset()):
        self.device, self.dtype, self.tp = config.torch_device, config.torch_dtype, tp
        self.eos_token_ids = eos_token_ids  # held back by min_tokens (only rank 0 samples)
        self.block_size = kvcache_block_size(config.kvcache_block_size, config.attention_kernels)
        if self.device.type == "cpu":
            keep_freed_memory_for_reuse()
        self.model = build_model(hf_config, config.max_model_len, tp, self.device, self.dtype)
        if config.load_format == "dummy":
            load_dummy_weights(self.model)
        else:
            load_weights(self.model, model_path)
        if config.quantization is not None:
            quantize_linears(self.model, config.quantization)
        if self.device.type == "cpu" and not config.learner_mode:
            use_cpu_kernels(self.model, self.dtype)
        self.sampler = Sampler()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        backend = get_backend(config.attention_kernels, self.device, config.learner_mode)
        for layer in self.attention_layers:
            layer.backend = backend
        self.num_kvcache_blocks = config.num_kvcache_blocks or self._kvcache_blocks_for_budget(config)
        if tp is not None:  # one block table serves every rank's cache: the smallest cache sets the count
            blocks = torch.tensor([self.num_kvcache_blocks], device=self.device)
            self.num_kvcache_blocks = int(tp.all_reduce(blocks, torch.distributed.ReduceOp.MIN))
        self._allocate_kvcache(self.num_kvcache_blocks)
        # Decode replays graphs captured over the cache just allocated; prefill stays eager. On CPU only
        # over the C++ kernels, whose calls a CPU graph records, and not with tensor parallelism: a
        # replay would repeat gloo's collectives without their waits.
        self.graph_runner = None
        cpu_graphs = tp is None and config.attention_kernels == "cpu"
        if not (config.enforce_eager or config.learner_mode) and (self.device.type == "cuda" or cpu_graphs):
            self.graph_runner = DecodeGraphRunner(
                self.model, config.max_num_seqs, -(-config.max_model_len // self.block_size), hf_config.hidden_size,
                self.device, self.dtype, use_graphs=True)

    def _kvcache_block_bytes(self) -> int:
        a = self.attention_layers[0]
        per_token = 2 * len(self.attention_layers) * a.num_kv_heads * a.head_dim * self.dtype.itemsize
        return per_token * self.block_size

    def _kvcache_blocks_for_budget(self, config: Config) -> int:
        if self.device.type == "cuda":
            self._allocate_kvcache(1)  # a stand-in of the right shape; the warm-up's slots are -1
            torch.cuda.reset_peak_memory_stats()
            weights = torch.cuda.memory_allocated()
            num_tokens = max(config.max_num_batched_tokens or max(8192, config.max_model_len), config.max_num_seqs)
            self.warmup(warmup_lengths(num_tokens, config.max_num_seqs, config.max_model_len))
            peak = torch.cuda.max_memory_allocated()
            # The graphs' pool holds the largest decode batch's activations: max_num_seqs tokens,
            # no more than the warm-up's num_tokens, so the warm-up's activations bound it.
            graph_pool = 0 if config.enforce_eager or config.learner_mode else peak - weights
            torch.cuda.empty_cache()  # hand the warm-up's activations back before the cache is allocated
            free, total = torch.cuda.mem_get_info()
            budget = kvcache_budget_bytes(total, free, torch.cuda.memory_reserved(), peak, graph_pool,
                                          config.gpu_memory_utilization)
        else:
            # Enough for every sequence at full length, within a fixed RAM budget.
            needed = config.max_num_seqs * -(-config.max_model_len // self.block_size) * self._kvcache_block_bytes()
            budget = min(CPU_KVCACHE_BYTES, needed)
        num_blocks = int(budget) // self._kvcache_block_bytes()
        if num_blocks <= 0:
            raise ValueError("no memory is left for the KV cache: raise gpu_memory_utilization, lower "
                             "max_num_batched_tokens or max_num_seqs, or free the GPU of other processes")
        return num_blocks

    def _allocate_kvcache(self, num_blocks: int) -> None:
        """One tensor for all layers; each layer sees ``[num_blocks, block_size, num_kv_heads, head_dim]``
        for K and for V, the layout flash-attn's paged KV cache reads."""
        a = self.attention_layers[0]
        # Zeroed, not empty: attention masks unused slots, and 0 * NaN garbage would still be NaN.
        self.kv_cache = zeros((2, len(self.attention_layers), num_blocks, self.block_size, a.num_kv_heads, a.head_dim),
                              self.dtype, self.device)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    @torch.inference_mode()
    def warmup(self, lengths: list[int]) -> None:
        """One prefill forward over prompts of these lengths, logits included, to measure its peak memory."""
        cu = torch.tensor([0] + lengths, dtype=torch.int32, device=self.device).cumsum(0, dtype=torch.int32)
        num_tokens = sum(lengths)
        ctx = Context(True, torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
                      cu, cu, max(lengths), max(lengths), logits_indices=(cu[1:] - 1).long())
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lengths])
        self.execute_model(input_ids, positions, ctx)

    # -- per-step inputs ------------------------------------------------------------------------

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slots of the sequence's tokens ``start..end-1``."""
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(seq.block_table) for seq in seqs)
        # Padding entries point at block 0: never read past a sequence's length, always in range.
        return self._tensor([seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs], torch.int32)

    def _tensor(self, data, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, pin_memory=self.device.type == "cuda").to(self.device, non_blocking=True)

    def prepare_prefill(self, seqs: list[Sequence]):
        """Inputs of a step in which some sequence computes more than its newest token: prompts,
        chunks of prompts, and (with chunked prefill) decodes beside them, packed back to back.
        Each sequence computes its tokens ``num_computed_tokens`` to ``+ num_scheduled_tokens``; the
        ones before were cached or computed by earlier steps and are read back, not recomputed."""
        input_ids, positions, slots, cu_q, cu_k = [], [], [], [0], [0]
        for seq in seqs:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += self._slots(seq, start, end)
            cu_q.append(cu_q[-1] + end - start)
            cu_k.append(cu_k[-1] + end)
        reads_cache = any(seq.num_computed_tokens for seq in seqs)
        # The rows whose logits are needed: prompt positions that score prompt logprobs, then the sample.
        logits_indices = []
        for seq, first, end in zip(seqs, cu_q, cu_q[1:]):
            logits_indices += [first + p - seq.num_computed_tokens for p in seq.prompt_logprob_positions]
            logits_indices += [end - 1] if seq.samples else []
        ctx = Context(
            is_prefill=True, slot_mapping=self._tensor(slots, torch.int64),
            cu_seqlens_q=self._tensor(cu_q, torch.int32), cu_seqlens_k=self._tensor(cu_k, torch.int32),
            max_seqlen_q=max(b - a for a, b in zip(cu_q, cu_q[1:])),
            max_seqlen_k=max(b - a for a, b in zip(cu_k, cu_k[1:])),
            block_tables=self._block_tables(seqs) if reads_cache else None,
            logits_indices=self._tensor(logits_indices, torch.int64))
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), ctx

    def prepare_decode(self, seqs: list[Sequence]):
        # Each sequence feeds its newest token, whose K/V is not in the cache yet.
        input_ids = [seq.token_ids[-1] for seq in seqs]
        positions = [seq.num_tokens - 1 for seq in seqs]
        slots = [seq.block_table[p // self.block_size] * self.block_size + p % self.block_size
                 for seq, p in zip(seqs, positions)]
        ctx = Context(is_prefill=False, slot_mapping=self._tensor(slots, torch.int64),
                      context_lens=self._tensor([seq.num_tokens for seq in seqs], torch.int32),
                      block_tables=self._block_tables(seqs))
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), ctx

    # -- the step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], blocks_to_copy: list[tuple[int, int]] = ()) -> SamplerOutput:
        """One step; rows of sampled tokens for each sequence whose computed tokens reach its end
        (``seq.sample_indices``), a None row for a prompt chunk with more to come. First, the
        scheduler's copy-on-write block copies."""
        is_decode = all(seq.is_decode for seq in seqs)
        input_ids, positions, ctx = (self.prepare_decode if is_decode else self.prepare_prefill)(seqs)
        if blocks_to_copy:
            ctx.blocks_to_copy = self._tensor(blocks_to_copy, torch.int64)
        logits = self.compute_logits(input_ids, positions, ctx)
        prompt_logprobs = None
        if any(seq.needs_prompt_logprobs for seq in seqs):  # rows per sequence: prompt positions, then its sample
            prompt_logprobs, sample_rows, row = [], [], 0
            for seq in seqs:
                span = seq.prompt_logprob_positions
                targets = torch.tensor(seq.token_ids[span.start + 1:span.stop + 1], device=logits.device)
                prompt_logprobs.append(compute_logprobs(logits[row:row + len(span)], targets,
                                                        [seq.sampling_params.prompt_logprobs] * len(span))
                                       if seq.needs_prompt_logprobs else None)
                row += len(span)
                if seq.samples:
                    sample_rows.append(row)
                    row += 1
            logits = logits[sample_rows]
        samples = [seq.samples for seq in seqs]
        sampled = self._sample(logits, [seq for seq, s in zip(seqs, samples) if s]) if any(samples) else SamplerOutput([])
        sampled.prompt_logprobs = prompt_logprobs
        if all(samples) and len(sampled.token_ids) == len(seqs):  # the usual step: one row per sequence
            return sampled
        # Back to a row per sample and a None row per sequence that did not sample.
        is_sample = [s for seq, s in zip(seqs, samples) for _ in (seq.sample_indices if s else [None])]
        tokens, logprobs = iter(sampled.token_ids), iter(sampled.logprobs or [])
        return SamplerOutput([next(tokens) if s else None for s in is_sample],
                             None if sampled.logprobs is None else [next(logprobs) if s else None for s in is_sample],
                             prompt_logprobs)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        rows = [(seq.sampling_params, index, seq.num_tokens) for seq in seqs for index in seq.sample_indices]
        if len(rows) > len(seqs):  # a request's first sample: n rows from its one row of logits
            counts = torch.tensor([len(seq.sample_indices) for seq in seqs], device=logits.device)
            logits = logits.repeat_interleave(counts, dim=0)
        # A row per sample: at a request's first sample, its n rows share the (empty) completion.
        processors = build_logits_processors(
            [(seq.sampling_params, seq.token_ids, seq.num_prompt_tokens, seq.output_token_counts)
             for seq in seqs for _ in seq.sample_indices], self.eos_token_ids, logits.device)
        token_ids = self.sampler(logits, [p.temperature for p, _, _ in rows], [p.top_k for p, _, _ in rows],
                                 [p.top_p for p, _, _ in rows], [p.sample_seed(i) for p, i, _ in rows],
                                 [n for _, _, n in rows], [p.min_p for p, _, _ in rows], processors)
        logprobs = None
        if any(p.logprobs is not None for p, _, _ in rows):
            logprobs = compute_logprobs(logits, token_ids, [p.logprobs for p, _, _ in rows])
        return SamplerOutput(token_ids.tolist(), logprobs)

    def compute_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Context) -> torch.Tensor:
        """Rank 0's forward. With tensor parallelism it first sends the step's inputs to the other
        ranks, which run the same forward alongside (every layer's collectives pair up)."""
        if self.tp is not None:
            self.tp.send_step(input_ids=input_ids, positions=positions,
                              **{f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)})
        return self.execute_model(input_ids, positions, ctx)

    @torch.inference_mode()
    def execute_model(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Context) -> torch.Tensor | None:
        """The logits of the rows that need them (on rank 0; None on the other ranks): every rank runs
        this on the same inputs, so what it computes must follow from them alone."""
        if ctx.blocks_to_copy is not None:
            # In order: a block copied from early in the list may since have been freed and handed
            # out as a later copy's destination.
            for src, dst in ctx.blocks_to_copy.tolist():
                self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])
        if ctx.is_prefill or self.graph_runner is None:
            hidden = self.model(input_ids, positions, ctx)
        else:
            hidden = self.graph_runner.run(input_ids, positions, ctx)
        if ctx.is_prefill:
            hidden = hidden[ctx.logits_indices]
        return self.model.compute_logits(hidden)
