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

When a running sequence needs a new KV block and none is free, the most recently admitted sequence
is preempted: its blocks are freed and it returns to the head of the waiting queue, to be
recomputed from its prompt plus what it has generated so far (much of it usually comes back from
the prefix cache).
"""

from collections import deque

from nanoengine.block_manager import BlockManager
from nanoengine.sequence import Sequence, SequenceStatus


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

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[Sequence]:
        """Pick the next step's sequences and set each one's ``num_scheduled_tokens``."""
        budget = self.max_num_batched_tokens
        if self.enable_chunked_prefill:
            scheduled = self._schedule_running(budget)
            scheduled += self._schedule_waiting(budget - sum(seq.num_scheduled_tokens for seq in scheduled))
        else:
            scheduled = self._schedule_waiting(budget) or self._schedule_running(budget)
        assert scheduled, "nothing could be scheduled: the KV cache is smaller than one sequence"
        return scheduled

    def _schedule_running(self, budget: int) -> list[Sequence]:
        """Oldest first, each running sequence's next tokens: its newest token, or the next chunk of a
        prompt still being computed (whose blocks it already holds)."""
        scheduled = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop to make room for an older sequence
            while not self.block_manager.can_append(seq):
                self._preempt(self.running[-1])  # the newest, possibly ``seq`` itself
                if seq.status != SequenceStatus.RUNNING:
                    break
            else:
                self.block_manager.may_append(seq)
                seq.num_scheduled_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
                budget -= seq.num_scheduled_tokens
                scheduled.append(seq)
        return scheduled

    def _schedule_waiting(self, budget: int) -> list[Sequence]:
        """Admit waiting sequences while the token budget and the free blocks allow; without chunked
        prefill only whole prompts.

        All or nothing: if admitting one fails, those admitted before it in this call go back to
        the head of the waiting queue, so a failed schedule leaves the queues as they were.
        """
        scheduled = []
        try:
            while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
                seq = self.waiting[0]
                # Only tokens that will actually be computed count against the token budget.
                num_new_tokens = seq.num_tokens - self.block_manager.num_cached_tokens(seq)
                if num_new_tokens > budget and self.enable_chunked_prefill:
                    num_new_tokens = budget
                if num_new_tokens > budget or not self.block_manager.can_allocate(seq):
                    break
                self.block_manager.allocate(seq, num_new_tokens)
                seq.num_scheduled_tokens = num_new_tokens
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

    def postprocess(self, seqs: list[Sequence], token_ids: list[int | None]) -> None:
        """Record each sequence's computed tokens; append the new token of those that sampled one
        (None: a prompt chunk that is not the last) and retire the sequences that are done."""
        for seq, token_id in zip(seqs, token_ids):
            seq.num_computed_tokens += seq.num_scheduled_tokens
            self.block_manager.cache_full_blocks(seq)  # the step wrote its K/V: keep or add cache entries
            if token_id is None:
                continue
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
