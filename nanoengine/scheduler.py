"""The scheduler: which sequences run in the next step, and what happens to them after.

Each step is either all prefill (new sequences' prompts, computed in one packed batch) or all
decode (one new token for every running sequence). Prefill goes first, so new requests join the
running batch as soon as there is room: that is continuous batching. When decode needs a new
KV block and none is free, the most recently admitted sequence is preempted: its blocks are
freed and it returns to the head of the waiting queue, to be recomputed from its prompt plus
what it has generated so far.
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

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Pick the next step's sequences; returns them and whether the step is a prefill."""
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
                self.block_manager.may_append(seq)
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

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> None:
        """Append each sequence's new token and retire the sequences that are done."""
        for seq, token_id in zip(seqs, token_ids):
            self.block_manager.cache_full_blocks(seq)  # the step wrote its K/V: keep or add cache entries
            seq.append_token(token_id)
            params = seq.sampling_params
            if not params.ignore_eos and token_id in self.eos_token_ids:
                self.finish(seq, "stop")
            elif seq.num_completion_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                self.finish(seq, "length")

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (done, or aborted by its caller) and free its blocks at once."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.deallocate(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
