"""The model runner: owns the model and the KV cache, and turns scheduled sequences into tokens.

Each step it packs the scheduled sequences into flat input tensors, builds the step's attention
metadata (slot mapping, cu_seqlens or context lengths, block tables), runs the model, and
samples one token per sample row: one per sequence, or ``n`` from one logit row at a request's
first sample; a sequence that brought speculative drafts is scored at each of them too, and the
rejection sampler decides how many tokens it keeps. Logprobs are computed only when some sequence
of the step asks for them.

With tensor parallelism every rank has a model runner over its shard of the model and its own KV
cache (its kv heads); rank 0's also sends each step's inputs to the others (``compute_logits``),
which run ``execute_model`` on them (worker.py).
"""

import dataclasses

import torch
from transformers import PretrainedConfig

from nanoengine.attention import Attention, get_backend
from nanoengine.config import Config, kvcache_block_size, kvcache_budget_bytes, warmup_lengths
from nanoengine.context import Context
from nanoengine.cpu_runtime import keep_freed_memory_for_reuse, use_cpu_kernels, zeros
from nanoengine.graph_runner import DecodeGraphRunner
from nanoengine.kv_cache_dtype import is_fp8, kv_cache_torch_dtype
from nanoengine.linear import quantize_linear, quantize_linears
from nanoengine.loader import load_dummy_weights, load_weights
from nanoengine.model import build_model
from nanoengine.moe import Experts
from nanoengine.parallel import TensorParallelGroup
from nanoengine.pooler import Pooler
from nanoengine.spec_rejection_sampler import RejectionSampler
from nanoengine.sampler import Sampler, SamplerOutput, compute_logprobs
from nanoengine.sampling_metadata import LogitRows, SamplingMetadata
from nanoengine.sequence import Sequence
from nanoengine.triton_layers import use_triton_kernels

CPU_KVCACHE_BYTES = 1 << 30  # the RAM budget for the KV cache on CPU


class ModelRunner:
    def __init__(self, config: Config, hf_config: PretrainedConfig, model_path: str,
                 tp: TensorParallelGroup | None = None, eos_token_ids: set[int] = frozenset()):
        self.device, self.dtype, self.tp = config.torch_device, config.torch_dtype, tp
        self.eos_token_ids = eos_token_ids  # held back by min_tokens (only rank 0 samples)
        self.block_size = kvcache_block_size(config.kvcache_block_size, config.attention_kernels)
        self.kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)  # 1 byte a value with fp8
        if self.device.type == "cpu":
            keep_freed_memory_for_reuse()
        self.model = build_model(hf_config, config.max_model_len, tp, self.device, self.dtype)
        # Quantized a module at a time, as each is filled: the float weights are never all held at once.
        fmt = config.quantization
        loaded = (lambda name, module: module.quantize(fmt) if isinstance(module, Experts)
                  else quantize_linear(name, module, fmt)) if fmt else (lambda name, module: None)
        if config.load_format == "dummy":
            load_dummy_weights(self.model, loaded)
        else:
            load_weights(self.model, model_path, lm_head=config.runner == "generate", loaded=loaded)
        if fmt is not None:
            quantize_linears(self.model, fmt)  # a tied LM head, from the embedding now loaded
        if self.device.type == "cpu" and not config.learner_mode:
            use_cpu_kernels(self.model, self.dtype)
        elif not config.learner_mode:  # on a GPU: the norms, SiLU and rotary in one Triton kernel each
            use_triton_kernels(self.model)
        self.sampler = Sampler(self.device.type == "cpu" and not config.learner_mode, config.seed)
        # runner="pooling": a vector per prompt instead of tokens (pooler.py), from the final norm's output.
        self.pooler = Pooler(config.pooler_config, hf_config) if config.runner == "pooling" else None
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        backend = get_backend(config.attention_kernels, self.device, config.learner_mode)
        for layer in self.attention_layers:
            layer.backend = backend
        self.graph_runner = None  # until the cache exists: the warm-up that sizes it runs eagerly
        self.num_kvcache_blocks = config.num_kvcache_blocks or self._kvcache_blocks_for_budget(config)
        if tp is not None:  # one block table serves every rank's cache: the smallest cache sets the count
            blocks = torch.tensor([self.num_kvcache_blocks], device=self.device)
            self.num_kvcache_blocks = int(tp.all_reduce(blocks, torch.distributed.ReduceOp.MIN))
        self._allocate_kvcache(self.num_kvcache_blocks)
        # Decode replays graphs captured over the cache just allocated; prefill stays eager. On CPU only
        # over the C++ kernels, whose calls a CPU graph records, and not with tensor parallelism: a
        # replay would repeat gloo's collectives without their waits.
        cpu_graphs = tp is None and config.attention_kernels == "cpu"
        # A pooling runner never decodes: it has no graphs; nor does a mixture of experts, whose layer
        # reads each step's tokens per expert into Python (moe.py), which no replay would repeat.
        no_graphs = (config.enforce_eager or config.learner_mode or self.pooler is not None
                     or self.model.spec.moe is not None)
        if not no_graphs and (self.device.type == "cuda" or cpu_graphs):
            spec = config.speculative_config
            self.graph_runner = DecodeGraphRunner(
                self.model, config.max_num_seqs, -(-config.max_model_len // self.block_size), hf_config.hidden_size,
                self.device, self.dtype, use_graphs=True, max_query_len=1 + (spec.num_speculative_tokens if spec else 0))

    def _kvcache_block_bytes(self) -> int:
        a = self.attention_layers[0]
        per_token = 2 * len(self.attention_layers) * a.num_kv_heads * a.head_dim * self.kv_cache_dtype.itemsize
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
                              self.kv_cache_dtype, self.device)
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
        """``[len(seqs), longest table]`` int32. Padding entries point at block 0: never read past a
        sequence's length, always in range. Filled a row at a time through numpy's view of the host
        tensor: torch.tensor parses a nested list of ints a few times slower (1 ms a decode step at
        batch 166, where the whole step's host work is about 4 ms)."""
        host = torch.zeros(len(seqs), max(len(seq.block_table) for seq in seqs), dtype=torch.int32,
                           pin_memory=self.device.type == "cuda")
        for row, seq in zip(host.numpy(), seqs):
            row[:len(seq.block_table)] = seq.block_table
        return host.to(self.device, non_blocking=True)

    def _tensor(self, data, dtype: torch.dtype) -> torch.Tensor:
        """Host data on the device; on CUDA through pinned memory, so the copy does not wait."""
        return torch.tensor(data, dtype=dtype, pin_memory=self.device.type == "cuda").to(self.device, non_blocking=True)

    def prepare_prefill(self, seqs: list[Sequence]):
        """Inputs of a step in which some sequence computes more than its newest token: prompts,
        chunks of prompts, and (with chunked prefill) decodes beside them, packed back to back.
        Each sequence computes its tokens ``num_computed_tokens`` to ``+ num_scheduled_tokens``; the
        ones before were cached or computed by earlier steps and are read back, not recomputed."""
        input_ids, positions, slots, cu_q, cu_k = [], [], [], [0], [0]
        for seq in seqs:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
            input_ids += seq.scheduled_token_ids  # with drafts, past the sequence's own tokens
            positions += range(start, end)
            slots += self._slots(seq, start, end)
            cu_q.append(cu_q[-1] + end - start)
            cu_k.append(cu_k[-1] + end)
        # An 8-bit cache is always read back, so that a prompt attends over the same 8-bit keys whether
        # or not they came from the prefix cache (vLLM attends over the cache in every step too).
        reads_cache = is_fp8(self.kv_cache_dtype) or any(seq.num_computed_tokens for seq in seqs)
        # The rows whose logits are needed: prompt positions that score prompt logprobs, then the
        # sample's (the newest token's, and each draft's after it).
        logits_indices = []
        for seq, first, end in zip(seqs, cu_q, cu_q[1:]):
            logits_indices += [first + p - seq.num_computed_tokens for p in seq.prompt_logprob_positions]
            logits_indices += range(end - 1 - len(seq.spec_token_ids), end) if seq.is_sampling else []
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
        if self.pooler is not None:  # a pooling runner's forward returns hidden states: pooled, not sampled
            return self._pool(self.compute_logits(input_ids, positions, ctx), seqs)
        logits = self.compute_logits(input_ids, positions, ctx)
        rows = LogitRows.of([len(seq.prompt_logprob_positions) if seq.needs_prompt_logprobs else None for seq in seqs],
                            [len(seq.sample_indices) if seq.is_sampling else 0 for seq in seqs],
                            [len(seq.spec_token_ids) for seq in seqs])
        prompt_logprobs = None
        if any(seq.needs_prompt_logprobs for seq in seqs):  # each scores the prompt token after its position
            prompt_logprobs = [None if span is None else compute_logprobs(
                logits[span], torch.tensor(seq.token_ids[p.start + 1:p.stop + 1], device=logits.device),
                [seq.sampling_params.prompt_logprobs] * len(span))
                for seq, span, p in zip(seqs, rows.prompt_logprobs, (s.prompt_logprob_positions for s in seqs))]
        sampling = [seq for seq in seqs if seq.is_sampling]
        sampled = self._sample(rows.sample_logits(logits), sampling) if sampling else SamplerOutput([])
        return SamplerOutput(rows.per_output(sampled.token_ids),
                             None if sampled.logprobs is None else rows.per_output(sampled.logprobs), prompt_logprobs)

    def _pool(self, hidden: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """Each sequence's pooled state after this step's rows, or, once its prompt is whole, its vector."""
        pooled = []
        for seq, rows in zip(seqs, hidden.split([seq.num_scheduled_tokens for seq in seqs])):
            state = self.pooler.update(seq.pooled, rows, seq.num_computed_tokens)
            pooled.append(self.pooler.finish(state, seq.num_tokens, seq.pooling_params.dimensions)
                          if seq.is_sampling else state)
        return SamplerOutput([None] * len(seqs), pooled=pooled)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """Each sample's new tokens from its rows of ``logits`` (``LogitRows.sample_logits``): a token
        from its one row, or, for a sequence with speculative drafts, the rejection sampler's verdict
        over its ``1 + drafts`` rows."""
        meta = SamplingMetadata.of(seqs, self.eos_token_ids, logits.shape[-1], logits.device)
        if meta.has_drafts:
            token_ids, chosen = self.rejection_sampler(logits, meta.draft_token_ids, *meta.sampler_args)
        else:
            chosen = self.sampler(logits, *meta.sampler_args)
            token_ids = [[t] for t in chosen.tolist()]
        return SamplerOutput(token_ids, meta.emitted_logprobs(logits, chosen, token_ids))

    def compute_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Context) -> torch.Tensor:
        """Rank 0's forward. With tensor parallelism it first sends the step's inputs to the other
        ranks, which run the same forward alongside (every layer's collectives pair up)."""
        if self.tp is not None:
            self.tp.send_step(input_ids=input_ids, positions=positions,
                              **{f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)})
        return self.execute_model(input_ids, positions, ctx)

    @torch.inference_mode()
    def execute_model(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Context) -> torch.Tensor | None:
        """The logits of the rows that need them (on rank 0; None on the other ranks), or for a pooling
        runner every row's hidden state: every rank runs this on the same inputs, so what it computes
        must follow from them alone."""
        if ctx.blocks_to_copy is not None:
            # In order: a block copied from early in the list may since have been freed and handed
            # out as a later copy's destination.
            for src, dst in ctx.blocks_to_copy.tolist():
                self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])
        if self.graph_runner is not None and self.graph_runner.can_run(ctx, len(input_ids)):
            hidden = self.graph_runner.run(input_ids, positions, ctx)  # a decode step, or a small verify step
        else:
            hidden = self.model(input_ids, positions, ctx)
        if self.pooler is not None:
            return hidden
        if ctx.is_prefill:
            hidden = hidden[ctx.logits_indices]
        return self.model.compute_logits(hidden)
