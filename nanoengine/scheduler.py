"""The scheduler: which sequences run in the next step, how many tokens each, and what happens after.

Every step has a token budget, ``max_num_batched_tokens``, and each scheduled sequence computes
``num_scheduled_tokens`` of its tokens past the ones already in the KV cache: a whole prompt, a
chunk of one, or 1 (decode: the token sampled last step). New requests join the running batch as
soon as there is room: that is continuous batching. Two policies share that rule:

- prefill-first (the default): a step admits waiting prompts, whole, or if none can be admitted
  decodes every running sequence. A burst of long prompts holds every running stream until they
  are all computed.
- chunked prefill (``enable_chunked_prefill``, vLLM V1's rule): the running sequences go first (a
  decode token each, or the next chunk of a prompt that is still being computed), and waiting
  prompts fill what is left of the budget, the last one admitted possibly only in part. One step
  then mixes decodes and prompt chunks, and running streams keep a steady pace.
  An admitted prompt gets blocks for all its tokens at once, not chunk by chunk as in vLLM V1:
  once admitted it cannot run out of blocks halfway, so only a decode ever preempts, and never a
  half-computed prompt; the price is blocks held idle for the chunks still to come. (Where every
  layer slides, chunks take blocks as they run: block_manager.py.)

When a running sequence needs a new KV block and none is free, the most recently admitted sequence
is preempted: its blocks are freed and it returns to the head of the waiting queue, to be
recomputed from its prompt plus what it has generated so far (much of it usually comes back from
the prefix cache).

After each step ``postprocess`` is the one place a sequence's new token lands: a request's first
sample forks its other samples here, and every stop condition (EOS, ``stop_token_ids``, a
``stop`` string in the detokenized text, length) is checked here, for ``generate`` and the server
alike.

With speculative decoding (spec_decode.py) a decoding sequence may also bring drafts, guesses at
its next tokens: its step computes them after its newest token, in *lookahead slots*. Drafts are
optional, so they come last: every running sequence's required tokens and every prompt admitted
this step get the budget and the blocks first, and drafts get what is left, oldest sequence first.
A draft never displaces another sequence's token and never causes a preemption. ``postprocess``
then appends the tokens the rejection sampler accepted, and takes the rejected drafts' positions
back.
"""

import logging
from collections import deque
from typing import NamedTuple

from nanoengine.block_manager import BlockManager
from nanoengine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


class ScheduledStep(NamedTuple):
    """What one step must do: run ``seqs`` (each ``num_scheduled_tokens`` of its tokens), after
    making the ``(source, destination)`` block copies of ``blocks_to_copy`` (copy on write: a
    forked sample about to write into a block it still shares)."""
    seqs: list[Sequence]
    blocks_to_copy: list[tuple[int, int]]


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: set[int], enable_chunked_prefill: bool = False):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()  # in order of admission: the tail is the newest
        self.num_preemptions = 0
        self.prefix_cache_hit_tokens = 0
        self.num_generated_tokens = 0  # appended to completions (tokens past a stop are not)
        # Speculative decoding's tally (vLLM's names): sequences that brought drafts to a step,
        # the drafts, and how many of them the target accepted.
        self.spec_decode_counts = dict.fromkeys(["num_drafts", "num_draft_tokens", "num_accepted_tokens"], 0)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledStep:
        """Pick the next step's sequences and set each one's ``num_scheduled_tokens``."""
        budget, blocks_to_copy = self.max_num_batched_tokens, []
        if self.enable_chunked_prefill:
            preemptions = self.num_preemptions
            scheduled = self._schedule_running(budget, blocks_to_copy)
            if self.num_preemptions == preemptions:  # else blocks ran out: admitting now would thrash
                scheduled += self._schedule_waiting(budget - sum(seq.num_scheduled_tokens for seq in scheduled))
        else:
            scheduled = self._schedule_waiting(budget) or self._schedule_running(budget, blocks_to_copy)
        assert scheduled, "nothing could be scheduled: the KV cache is smaller than one sequence"
        self._schedule_drafts(scheduled, budget - sum(seq.num_scheduled_tokens for seq in scheduled))
        return ScheduledStep(scheduled, blocks_to_copy)

    def _schedule_running(self, budget: int, blocks_to_copy: list[tuple[int, int]]) -> list[Sequence]:
        """Oldest first, each running sequence's next tokens: its newest token, or the next chunk of a
        prompt still being computed (whose blocks it already holds, or with a sliding window takes as it
        goes: block_manager.py). A sequence whose last block is shared (forked samples) gets a copy of
        it, added to ``blocks_to_copy``."""
        scheduled = []
        for seq in list(self.running):
            if budget == 0 or len(scheduled) == self.max_num_seqs:  # forked samples may outnumber a step
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop to make room for an older sequence
            num_new_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.can_append(seq, num_new_tokens=num_new_tokens):
                self._preempt(self.running[-1])  # the newest, possibly ``seq`` itself
                if seq.status != SequenceStatus.RUNNING:
                    break
            else:
                if (copy := self.block_manager.may_append(seq, num_new_tokens=num_new_tokens)) is not None:
                    blocks_to_copy.append(copy)
                seq.num_scheduled_tokens = num_new_tokens
                budget -= seq.num_scheduled_tokens
                scheduled.append(seq)
        return scheduled

    def _schedule_drafts(self, scheduled: list[Sequence], budget: int) -> None:
        """Give the step's decoding sequences, oldest first, as many of their drafts as the budget
        left over and the free blocks allow (lookahead slots after the newest token), and drop the
        rest. A sequence not in this step keeps its drafts for the step that takes it."""
        for seq in scheduled:
            if not seq.spec_token_ids:
                continue
            drafts = seq.spec_token_ids[:budget]
            while drafts and not self.block_manager.can_append(seq, len(drafts)):
                drafts.pop()
            self.block_manager.may_append(seq, len(drafts))  # its newest token's slot is already its own
            seq.spec_token_ids = drafts
            seq.num_scheduled_tokens += len(drafts)
            budget -= len(drafts)

    def _schedule_waiting(self, budget: int) -> list[Sequence]:
        """Admit waiting sequences while the token budget and the free blocks allow; without chunked
        prefill only whole prompts.

        All or nothing: if admitting one fails, those admitted before it in this call go back to
        the head of the waiting queue, so a failed schedule leaves the queues as they were.
        """
        # Seats counted in samples: a sequence's first sample forks n - 1 more running sequences.
        scheduled, seats = [], sum(len(seq.sample_indices) for seq in self.running)
        try:
            while self.waiting and budget > 0 and seats + len(self.waiting[0].sample_indices) <= self.max_num_seqs:
                seq = self.waiting[0]
                seats += len(seq.sample_indices)
                # Only tokens that will actually be computed count against the token budget.
                num_new_tokens = seq.num_tokens - self.block_manager.num_hit_tokens(seq)
                if num_new_tokens > budget and self.enable_chunked_prefill:
                    num_new_tokens = budget
                if num_new_tokens > budget or not self.block_manager.can_allocate(seq, num_new_tokens):
                    break
                self.block_manager.allocate(seq, num_new_tokens)
                seq.num_scheduled_tokens, seq.spec_token_ids = num_new_tokens, []  # a prompt verifies no drafts
                budget -= num_new_tokens
                seq.status = SequenceStatus.RUNNING
                self.running.append(self.waiting.popleft())
                scheduled.append(seq)
        except BaseException:
            for seq in reversed(scheduled):
                self.running.remove(seq)
                self.block_manager.deallocate(seq)
                seq.status = SequenceStatus.WAITING
                self.waiting.appendleft(seq)
            raise
        self.prefix_cache_hit_tokens += sum(seq.num_cached_tokens for seq in scheduled)
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence], token_ids: list[list[int] | None],
                    logprobs: list[list[dict[int, float]] | None] | None = None,
                    prompt_logprobs: list[list[dict[int, float]] | None] | None = None,
                    pooled: list | None = None) -> list[Sequence]:
        """Record each sequence's computed tokens, append the new tokens of those that sampled and
        retire the sequences that are done; returns the sequences that got tokens (the step's,
        then the children it forked). A pooling step (``pooled``) appends none: see ``_pool``.

        ``token_ids`` (and ``logprobs``) hold a row per sample, ``seq.sample_indices`` of each
        sequence that samples (``seq.is_sampling``: a request's first sample brings ``n`` rows and forks
        ``n - 1`` children), and one None row for a prompt chunk with more to come. A row is the
        sample's new tokens: one, or with speculative drafts the accepted ones and the token after.
        """
        stepped, children, row = [], [], 0
        for i, seq in enumerate(seqs):
            start, samples = seq.num_computed_tokens, seq.is_sampling
            seq.num_computed_tokens += seq.num_scheduled_tokens
            if prompt_logprobs is not None and prompt_logprobs[i] is not None:
                # Entry p is token p's; a prompt recomputed after a preemption overwrites its own.
                seq.prompt_logprobs = (seq.prompt_logprobs or [None])[:start + 1] + prompt_logprobs[i]
            if pooled is not None:
                stepped += self._pool(seq, pooled[i])
                continue
            if not samples:
                self.block_manager.cache_full_blocks(seq)  # the step wrote its K/V: keep or add cache entries
                row += 1
                continue
            forked = [self.block_manager.fork(seq, index) for index in seq.sample_indices[1:]]
            self.running.extend(forked)  # the newest: preempted first
            children += forked
            stepped.append(seq)
            for sample in [seq] + forked:
                self._append(sample, token_ids[row], None if logprobs is None else logprobs[row])
                row += 1
        return stepped + children

    def _append(self, seq: Sequence, token_ids: list[int], logprobs: list[dict[int, float]] | None) -> None:
        """Append a sample's new tokens, one at a time until a stop condition is met (the rest, if a
        stop lands inside an accepted run of drafts, are dropped), then take back the positions of
        rejected drafts: the K/V of every token but the newest is in the cache, and what the step
        wrote past that is never read (attention stops at the sequence's length) and is overwritten
        when those positions are computed again; blocks holding only such slots are freed."""
        if num_drafts := len(seq.spec_token_ids):
            self.spec_decode_counts["num_drafts"] += 1
            self.spec_decode_counts["num_draft_tokens"] += num_drafts
            self.spec_decode_counts["num_accepted_tokens"] += len(token_ids) - 1
            seq.spec_token_ids = []
        for i, token_id in enumerate(token_ids):
            seq.num_new_tokens = i + 1
            if (reason := self._append_token(seq, token_id, None if logprobs is None else logprobs[i])) is not None:
                break
        seq.num_computed_tokens = seq.num_tokens - 1
        self.block_manager.cache_full_blocks(seq)  # only accepted tokens' blocks: they are all that count
        self.block_manager.free_lookahead_blocks(seq)
        if reason is not None:
            self.finish(seq, reason)

    def _append_token(self, seq: Sequence, token_id: int, logprobs: dict[int, float] | None) -> str | None:
        """Append one sampled token; returns why the sequence is done, or None."""
        seq.append_token(token_id, logprobs)
        self.num_generated_tokens += 1
        params, reason = seq.sampling_params, None
        if seq.grammar is not None and (not seq.grammar.consume_token(token_id) or seq.grammar.is_error()):
            # The sampler allowed only the grammar's tokens, so its library gave up on the grammar (a
            # resource limit, or no token could go on: it then allows EOS alone): this sample ends
            # ("abort", the text without the token), no other does.
            logger.warning("request %d: its grammar failed: %s", seq.request_id, seq.grammar.get_error()[:500])
            if seq.detokenizer is not None:  # the token adds no text, and what was held back is final
                seq.detokenizer.add([], finished=True)
            return "abort"
        at_length = seq.num_completion_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len
        # A stop token that is also the last one allowed is a stop by length, as in vLLM (whose length
        # check comes first), and its text is shown.
        eos = not params.ignore_eos and token_id in self.eos_token_ids
        stop_token = not at_length and (eos or token_id in params.stop_token_ids)
        if stop_token:
            reason = "stop"
            seq.stop_reason = None if eos else token_id  # vLLM's: a stop_token_ids id, EOS checked first there
        elif seq.grammar is not None and seq.grammar.is_stopped():  # nothing may follow: the output is whole
            reason = "stop"
        elif at_length:
            reason = "length"
        if seq.detokenizer is not None:  # made by the engine; a unit test's bare sequence has none
            # a stop token's own text is left out, as in vLLM, unless the stop is to be shown
            shown = [] if stop_token and not params.include_stop_str_in_output else [token_id]
            seq.detokenizer.add(shown, finished=reason is not None)
            if seq.detokenizer.stopped:  # the text now holds a stop string, and is cut before it
                reason, seq.stop_reason = "stop", seq.detokenizer.stop_string
        return reason

    def _pool(self, seq: Sequence, pooled) -> list[Sequence]:
        """A pooling request's step (runner="pooling", pooler.py): its K/V are kept as any prompt
        chunk's are, and it holds what the model runner pooled. Once its whole prompt is computed it
        is done, its vector attached: no decode, no sampler. Returns it then, else nothing."""
        self.block_manager.cache_full_blocks(seq)
        seq.pooled = pooled
        if seq.num_computed_tokens < seq.num_tokens:
            return []
        self.finish(seq, "stop")
        return [seq]

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (done, or aborted by its caller) and free its blocks at once."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.deallocate(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
