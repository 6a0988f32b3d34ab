"""Watch the engine work: per step, what the scheduler decided and why, and what the model runner built.

``StepObserver`` wraps three methods of one engine's instances (``Scheduler.schedule`` and
``Scheduler.postprocess``, and the model runner's ``prepare_prefill``/``prepare_decode``) and reads
their state around each call; the engine's own code is unchanged, and an engine that is not
observed pays nothing. It keeps one small record per step (``records``: the numbers
``bench.py --timeline`` plots and its roofline line adds up, roofline.py) and, with ``write``,
prints each step as a block of aligned text:
the sequences admitted, preempted and finished, each sequence's block table and slot mapping,
``cu_seqlens`` or context lengths, the blocks' reference counts, which blocks carry a prefix hash,
the free list's head, and the tokens sampled, as text; with chunked prefill the step's token
budget, spent; and the copies on write and the forks of ``n > 1``; with speculative decoding, each
step's drafts, the ones accepted and the slots and blocks taken back; with structured output, how
many tokens each sample's grammar allowed and the one taken; with a sliding window, the blocks that
fell out of it, released; with ``graphs=True``, which decode steps recorded a graph and which
replayed one. trace_scenes.py plays the scenes of ``python example.py --trace`` and
docs/walkthrough.md.

When each part is read: the header (why, admitted, preempted, budget, copies) right after
``schedule``; the table and the block lines as the step's inputs are built, before the forward
(so "cached" does not yet hold the full blocks this step writes, except a prompt's, cached
pending at admission); the grammar's masks before ``postprocess`` (which advances the matchers);
"sampled", "forked", "graph" and "finished" after it.
"""

import time
from typing import Callable

from nanoengine.context import Context
from nanoengine.scheduler import ScheduledStep
from nanoengine.sequence import Sequence, SequenceStatus
from nanoengine.structured_output import allowed_tokens


def ranges(values: list[int]) -> str:
    """``[0..9, 12, 13]``: runs of consecutive integers folded, the way slot mappings usually look."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return "[" + ", ".join(f"{r[0]}..{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs) + "]"


class StepObserver:
    def __init__(self, engine, write: Callable[[str], None] | None = None, graphs: bool = False):
        self.engine, self.write, self.graphs = engine, write, graphs
        self.records: list[dict] = []
        self.ctx: Context | None = None
        scheduler, runner = engine.scheduler, engine.model_runner
        self._schedule, self._postprocess = scheduler.schedule, scheduler.postprocess
        scheduler.schedule, scheduler.postprocess = self._observe_schedule, self._observe_postprocess
        if write is not None:  # the text needs the step's tensors; the records do not
            for name in ("prepare_prefill", "prepare_decode"):
                setattr(runner, name, self._capture(getattr(runner, name)))

    def _capture(self, prepare: Callable) -> Callable:
        def prepare_and_keep(seqs: list[Sequence]):
            input_ids, positions, self.ctx = prepare(seqs)
            return input_ids, positions, self.ctx
        return prepare_and_keep

    def _observe_schedule(self) -> ScheduledStep:
        scheduler, graph_runner = self.engine.scheduler, self.engine.model_runner.graph_runner
        graphs_before = set(graph_runner.graphs) if self.graphs and graph_runner is not None else set()
        was_running, was_waiting = list(scheduler.running), list(scheduler.waiting)
        preemptions, hits = scheduler.num_preemptions, scheduler.prefix_cache_hit_tokens
        why = self._why(scheduler, was_waiting)
        step = self._schedule()
        seqs = step.seqs
        # A decode step's batch size, and the graphs the runner held before it ran.
        self.graph_step = (len(seqs), graphs_before) if all(seq.is_decode for seq in seqs) else None
        # What each sequence brought to verify, and the blocks it held for them (lookahead included).
        self.drafts = {seq.seq_id: (list(seq.spec_token_ids), list(seq.block_table)) for seq in seqs
                       if seq.spec_token_ids}
        admitted = [seq for seq in seqs if seq in was_waiting]
        self.records.append({
            "step": len(self.records) + 1,
            "prefill_tokens": sum(seq.num_scheduled_tokens for seq in seqs if not seq.is_decode),
            "decode_seqs": sum(seq.is_decode for seq in seqs),
            "kv_blocks_used": self.engine.block_manager.num_used_blocks,
            "num_kv_blocks": len(self.engine.block_manager.blocks),
            "preemptions": scheduler.num_preemptions - preemptions,
            "prefix_hit_tokens": scheduler.prefix_cache_hit_tokens - hits,
            # For roofline.py: the engine's phase for the step (a step with any prompt token is a prefill),
            # each sequence's (tokens already in the cache, tokens computed now), the sequences that
            # sample, and (set by postprocess) the step's seconds, timed as the engine times them.
            "phase": "decode" if all(seq.num_computed_tokens >= seq.num_prompt_tokens for seq in seqs) else "prefill",
            "spans": [(seq.num_computed_tokens, seq.num_scheduled_tokens) for seq in seqs],
            "sampling_seqs": sum(seq.is_sampling for seq in seqs),
        })
        if self.write is not None:
            preempted = [seq for seq in was_running if seq.status == SequenceStatus.WAITING]
            self._header(seqs, why, admitted, preempted)
            if scheduler.enable_chunked_prefill:
                self._budget(seqs, scheduler.max_num_batched_tokens)
            self._copies(seqs, step.blocks_to_copy)
            for seq in seqs:
                if seq.spec_token_ids:
                    newest = seq.num_tokens - 1
                    self.write(f"         drafts    #{seq.seq_id} brings {len(seq.spec_token_ids)}: positions "
                               f"{newest + 1}..{newest + len(seq.spec_token_ids)} after its newest token's "
                               f"{newest}, in lookahead slots of its blocks")
        self.step_start = time.perf_counter()
        return step

    def _why(self, scheduler, waiting: list[Sequence]) -> str:
        """The rule that decides this step, read before the scheduler applies it."""
        if scheduler.enable_chunked_prefill:
            return "chunked prefill: running sequences first, then waiting prompts fill the token budget"
        if not waiting and any(seq.spec_token_ids for seq in scheduler.running):
            return "prefill-first, and nothing is waiting: every running sequence computes its newest token and drafts"
        if not waiting:
            return "prefill-first, and nothing is waiting: every running sequence decodes one token"
        head = waiting[0]
        if len(scheduler.running) < scheduler.max_num_seqs and self.engine.block_manager.can_allocate(head):
            return "prefill-first: waiting prompts are admitted before anyone decodes"
        return (f"prefill-first, but #{head.seq_id} ({head.num_tokens} tokens) does not fit in "
                f"{self.engine.block_manager.num_free_blocks} free blocks: the running sequences decode")

    def _header(self, seqs, why, admitted, preempted) -> None:
        phase = ("verify" if any(seq.spec_token_ids for seq in seqs) else
                 "decode" if all(seq.is_decode for seq in seqs) else "prefill")
        self.write(f"step {len(self.records):<3} {phase:<8} {why}")
        bs = self.engine.block_manager.block_size
        for seq in admitted:
            cached = seq.num_cached_tokens
            hit = f": prefix hit, blocks {seq.block_table[:cached // bs]}" if cached else ""
            self.write(f"         admitted  #{seq.seq_id} ({seq.num_tokens} tokens, {cached} from the prefix cache{hit})")
        for seq in preempted:
            self.write(f"         preempted #{seq.seq_id}: a running sequence needed a block and none was free; "
                       f"the newest gives its blocks back and waits to be recomputed ({seq.num_tokens} tokens)")

    def _budget(self, seqs: list[Sequence], budget: int) -> None:
        """Chunked prefill's arithmetic: what each sequence takes of the step's token budget."""
        parts = []
        for seq in seqs:
            start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
            parts.append(f"#{seq.seq_id} decodes 1" if seq.is_decode else
                         f"#{seq.seq_id} prompt {start}..{start + n - 1} ({n} of its {seq.num_tokens})")
        used = sum(seq.num_scheduled_tokens for seq in seqs)
        self.write(f"         budget    {' + '.join(parts)} = {used} of {budget} tokens")

    def _copies(self, seqs: list[Sequence], blocks_to_copy: list[tuple[int, int]]) -> None:
        """Copy on write: a sequence about to write into a block it shares gets a copy of it."""
        for src, dst in blocks_to_copy:
            (copier,) = [seq for seq in seqs if seq.block_table and seq.block_table[-1] == dst]
            keepers = [f"#{seq.seq_id}" for seq in seqs if seq.block_table and seq.block_table[-1] == src]
            self.write(f"         copy      #{copier.seq_id} writes into block {src}, which it shares: it gets a copy, "
                       f"block {dst}; {', '.join(keepers) or 'nobody'} keeps block {src} (ref count now "
                       f"{self.engine.block_manager.blocks[src].ref_count})")

    def _observe_postprocess(self, seqs: list[Sequence], token_ids, *args) -> list[Sequence]:
        rows, row = {}, 0  # each sampling sequence's first row of ``token_ids``, as postprocess reads them
        for seq in seqs:
            rows[seq.seq_id], row = row, row + (len(seq.sample_indices) if seq.is_sampling else 1)
        if self.write is not None:
            self._body(seqs)  # before postprocess: the step's own positions and block tables
            # The masks the sampler applied: each matcher is still where it was (postprocess advances it).
            constrained = [seq for seq in seqs if seq.is_sampling and seq.grammar is not None]
            masks = dict(zip(constrained, allowed_tokens([seq.grammar for seq in constrained],
                                                         self.engine.vocab_size)[1])) if constrained else {}
        tables = [list(seq.block_table) for seq in seqs]
        stepped = self._postprocess(seqs, token_ids, *args)
        self.records[-1]["seconds"] = time.perf_counter() - self.step_start
        if self.write is not None:
            for seq, table in zip(seqs, tables):
                self._released(seq, table)
            decode = self.engine.tokenizer.decode
            words = "  ".join(f"#{seq.seq_id} {decode(seq.token_ids[-seq.num_new_tokens:])!r}" for seq in stepped)
            self.write(f"  sampled   {words or '(nothing: only prompt chunks ran)'}")
            for seq, mask in masks.items():
                self._grammar(seq, mask, token_ids[rows[seq.seq_id]][0])
            for seq in seqs:
                if seq.seq_id in self.drafts:
                    self._verified(seq, *self.drafts[seq.seq_id], token_ids[rows[seq.seq_id]])
            for child in stepped[len([seq for seq in seqs if seq in stepped]):]:  # postprocess lists them last
                refs = " ".join(f"{b}:{self.engine.block_manager.blocks[b].ref_count}" for b in child.block_table)
                self.write(f"  forked    #{child.seq_id} from #{child.request_id}: shares its blocks by reference "
                           f"count (id:refs now {refs}), and samples on its own")
            if self.graphs:
                self._graph()
            for seq in seqs:
                if seq.is_finished:
                    self.write(f"  finished  #{seq.seq_id} ({seq.finish_reason}): "
                               f"{seq.detokenizer.text.strip()!r}; its blocks are freed, their hashes kept")
            self.write("")
        return stepped

    def _released(self, seq: Sequence, table: list[int]) -> None:
        """A sliding window's blocks going back: the entries postprocess pointed at the null block."""
        bm = self.engine.block_manager
        released = [b for b, now in zip(table, seq.block_table) if now != b and now == bm.null_block_id]
        if released:
            first = seq.num_computed_tokens - bm.sliding_window + 1
            self.write(f"  released  #{seq.seq_id}: blocks {released} hold only tokens before {first}, the oldest key "
                       f"its next query sees (window {bm.sliding_window}): back to the pool, hashes kept; their "
                       f"entries now point at the null block {bm.null_block_id}")

    def _verified(self, seq: Sequence, drafts: list[int], table: list[int], given: list[int]) -> None:
        """Speculative decoding: which drafts the step accepted, what a stop cut, and what it took back
        out of the cache. ``given``: the step's tokens for the sequence, the accepted drafts then the
        model's own; a stop among them keeps only those up to it (``num_new_tokens``)."""
        decode, bs = self.engine.tokenizer.decode, self.engine.block_manager.block_size
        accepted, kept = len(given) - 1, seq.num_new_tokens
        self.write(f"  verified  #{seq.seq_id} proposed {decode(drafts)!r} ({len(drafts)} drafts): accepted "
                   f"{decode(drafts[:accepted])!r} ({accepted}), then the model's own {decode(given[-1:])!r}")
        if kept < len(given):
            self.write(f"  stopped   at {decode(given[kept - 1:kept])!r}: {decode(given[kept:])!r} after it "
                       f"{'is' if len(given) - kept == 1 else 'are'} dropped")
        if taken := drafts[min(accepted, kept):]:  # drafts whose position the sequence does not keep
            first = seq.num_tokens - kept + min(accepted, kept)  # the first one's position
            slots = [table[p // bs] * bs + p % bs for p in range(first, first + len(taken))]
            freed = [b for b in table if b not in seq.block_table] if not seq.is_finished else []
            # refused by the model, or (a stop inside the accepted run) dropped with what followed the stop
            self.write(f"  {'rejected' if kept > accepted else 'dropped '}  {decode(taken)!r}: their K/V in slots "
                       f"{ranges(slots)} are past the sequence's length, never read, overwritten later"
                       + (f"; blocks {freed}, which held only them, are freed" if freed else ""))
            if not seq.is_finished:
                self.write(f"  goes on   #{seq.seq_id} with {seq.num_tokens} tokens: num_computed_tokens set back to "
                           f"{seq.num_computed_tokens} (all but the newest), block table now {seq.block_table}")

    def _grammar(self, seq: Sequence, mask, token_id: int) -> None:
        """Structured output: the tokens the sample's grammar allowed at this step (its bitmask, as the
        sampler applied it), the token taken, and the matcher, which ``postprocess`` advanced by it."""
        allowed, token = int(mask.sum()), self.engine.tokenizer.decode([token_id])
        matcher = ("stopped: the grammar is complete, so the sequence finishes" if seq.grammar.is_stopped() else
                   "moves past it")
        self.write(f"  grammar   #{seq.seq_id} allowed {allowed} of {len(mask)} tokens{' (forced)' * (allowed == 1)}, "
                   f"took {token!r} ({'allowed' if mask[token_id] else 'NOT allowed'}); its matcher {matcher}")

    def _graph(self) -> None:
        """Which graph the step's forward used: a decode step pads its batch to a bucket and replays the
        bucket's graph, or records it if it has none yet (on CPU, by running the step); prefill runs eagerly.
        (A speculative verify step, which the CPU records and replays too, is reported as prefill.)"""
        runner = self.engine.model_runner.graph_runner
        if runner is None:
            self.write("  graph     none: this engine runs every step eagerly")
            return
        buckets = sorted(b for b, q in runner.graphs if q == 1)
        if self.graph_step is None:
            self.write(f"  graph     none: a prefill step runs eagerly; graphs kept for buckets {buckets}")
            return
        n, before = self.graph_step
        bucket = next(b for b in runner.buckets if b >= n)
        padded = f", {bucket - n} padded row{'s' * (bucket - n > 1)} with slot -1" if bucket > n else ""
        how = ("replayed its graph from C++ (the model's Python did not run)" if (bucket, 1) in before
               else "recorded its graph as the step ran" if (bucket, 1) in runner.graphs else "ran eagerly")
        self.write(f"  graph     batch {n} -> bucket {bucket}{padded}: {how}; graphs now for buckets {buckets}")

    def _body(self, seqs: list[Sequence]) -> None:
        ctx, bm = self.ctx, self.engine.block_manager
        slots = ctx.slot_mapping.tolist()
        if ctx.is_prefill:
            cu_q = ctx.cu_seqlens_q.tolist()
            per_seq = [slots[a:b] for a, b in zip(cu_q, cu_q[1:])]
            last = "keys"
        else:
            per_seq, context_lens = [[s] for s in slots], ctx.context_lens.tolist()
            last = "context len"
        self.write(f"  {'seq':<5} {'positions':<13} {'block table':<29} {'slot mapping':<21} {last}")
        for i, (seq, seq_slots) in enumerate(zip(seqs, per_seq)):
            start = seq.num_computed_tokens
            positions = ranges(list(range(start, start + seq.num_scheduled_tokens)))
            oldest = max(0, start - bm.sliding_window + 1) if bm.sliding_window else 0  # the first query's first key
            keys = (f"{oldest}..{start + seq.num_scheduled_tokens - 1}" if ctx.is_prefill else context_lens[i])
            self.write(f"  #{seq.seq_id:<4} {positions:<13} {str(seq.block_table):<29} {ranges(seq_slots):<21} {keys}")
        if ctx.is_prefill:
            self.write(f"  cu_seqlens_q {ctx.cu_seqlens_q.tolist()}   cu_seqlens_k {ctx.cu_seqlens_k.tolist()}")
        in_use = " ".join(f"{b.block_id}:{b.ref_count}" for b in bm.blocks if b.ref_count)
        cached = [b.block_id for b in bm.blocks if b.hash != -1]
        free = list(bm.free_block_ids)
        head = str(free[:6])[:-1] + (", ...]" if len(free) > 6 else "]")
        self.write(f"  blocks    in use (id:refs) {in_use}   cached {cached}")
        self.write(f"            free {len(free)}/{len(bm.blocks)}, free list head {head}")
