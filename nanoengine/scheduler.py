"""The scheduler: which sequences run in the next step, and what happens to them after.

Each step is either all prefill (new sequences' prompts, computed in one packed batch) or all
decode (one new token for every running sequence). Prefill goes first, so new requests join the
running batch as soon as there is room: that is continuous batching. When decode needs a new
KV block and none is free, the most recently admitted sequence is preempted: its blocks are
freed and it returns to the head of the waiting queue, to be recomputed from its prompt plus
what it has generated so far.

After each step ``postprocess`` is the one place a sequence's new token lands: a request's first
sample forks its other samples here, and every stop condition (EOS, ``stop_token_ids``, a
``stop`` string in the detokenized text, length) is checked here, for ``generate`` and the server
alike.
"""

from collections import deque

from nanoengine.block_manager import BlockManager
from nanoengine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: set[int]):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()  # in order of admission: the tail is the newest
        self.num_preemptions = 0
        self.prefix_cache_hit_tokens = 0
        # (source, destination) block copies the next step must make before its forward: copy on write.
        self.blocks_to_copy: list[tuple[int, int]] = []

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Pick the next step's sequences; returns them and whether the step is a prefill."""
        self.blocks_to_copy = []
        scheduled = self._schedule_prefill()
        if scheduled:
            return scheduled, True

        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop to make room for an older sequence
            while not self.block_manager.can_append(seq):
                self._preempt(self.running[-1])  # the newest, possibly ``seq`` itself
                if seq.status != SequenceStatus.RUNNING:
                    break
            else:
                if (copy := self.block_manager.may_append(seq)) is not None:
                    self.blocks_to_copy.append(copy)
                scheduled.append(seq)
        assert scheduled, "nothing could be scheduled: the KV cache is smaller than one sequence"
        return scheduled, False

    def _schedule_prefill(self) -> list[Sequence]:
        """Admit waiting sequences while the token budget and the free blocks allow.

        All or nothing: if admitting one fails, those admitted before it in this call go back to
        the head of the waiting queue, so a failed schedule leaves the queues as they were.
        """
        scheduled, num_batched_tokens = [], 0
        try:
            while self.waiting and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                # Only tokens that will actually be computed count against the token budget.
                num_new_tokens = seq.num_tokens - self.block_manager.num_cached_tokens(seq)
                if (num_batched_tokens + num_new_tokens > self.max_num_batched_tokens
                        or not self.block_manager.can_allocate(seq)):
                    break
                self.block_manager.allocate(seq)
                num_batched_tokens += num_new_tokens
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

    def postprocess(self, seqs: list[Sequence], token_ids: list[int],
                    logprobs: list[dict[int, float] | None] | None = None,
                    prompt_logprobs: list[list[dict[int, float]] | None] | None = None) -> list[Sequence]:
        """Append each sequence's new token and retire the sequences that are done; returns the
        sequences that got a token (the step's, then the children it forked).

        ``token_ids`` (and ``logprobs``) hold one row per sample: ``seq.sample_indices`` of each
        sequence in turn, so a request's first sample brings ``n`` rows and forks ``n - 1`` children.
        """
        children, row = [], 0
        for i, seq in enumerate(seqs):
            self.block_manager.cache_full_blocks(seq)  # the step wrote its K/V: keep or add cache entries
            if prompt_logprobs is not None and prompt_logprobs[i] is not None:
                seq.prompt_logprobs = (seq.prompt_logprobs or [None]) + prompt_logprobs[i]
            indices = seq.sample_indices
            forked = [self.block_manager.fork(seq, index) for index in indices[1:]]
            self.running.extend(forked)  # the newest: preempted first
            children += forked
            for sample in [seq] + forked:
                self._append(sample, token_ids[row], None if logprobs is None else logprobs[row])
                row += 1
        return seqs + children

    def _append(self, seq: Sequence, token_id: int, logprobs: dict[int, float] | None) -> None:
        """Append one sampled token and finish the sequence if a stop condition is met."""
        seq.append_token(token_id, logprobs)
        params, reason = seq.sampling_params, None
        if (not params.ignore_eos and token_id in self.eos_token_ids) or token_id in params.stop_token_ids:
            reason = "stop"
        elif seq.num_completion_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if seq.detokenizer is not None:  # made by the engine; a unit test's bare sequence has none
            seq.detokenizer.add([token_id], finished=reason is not None)
            if seq.detokenizer.stopped:  # the text now holds a stop string, and is cut before it
                reason = "stop"
        if reason is not None:
            self.finish(seq, reason)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (done, or aborted by its caller) and free its blocks at once."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.deallocate(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
