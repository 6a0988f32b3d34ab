"""Scheduler: prefill-first continuous batching, LIFO preemption by recomputation, finishing.

A fake model runner stands in for the model, so thousands of steps take seconds. It keeps a
shadow KV cache (which token prefix each slot holds), checks that every step reads back only
K/V of the sequence's own prefix and writes only into blocks nobody else holds, and "samples"
``next_token(token_ids)``, a deterministic function of everything before. So a sequence's
completion is fixed by its prompt, and must come out the same however often it is preempted
and recomputed, whatever else shares its batches.
"""

import copy
from dataclasses import dataclass

import pytest

pytest.importorskip("hypothesis")  # a test extra: a bare GPU machine may lack it (`pytest -m cuda` there)
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st

from nanoengine.block_manager import BlockManager
from nanoengine.sampling_params import SamplingParams
from nanoengine.scheduler import Scheduler
from nanoengine.sequence import Sequence, SequenceStatus

EOS, VOCAB = 0, 13


def next_token(token_ids: list[int]) -> int:
    """The fake model: a token that depends on every token so far; EOS about one time in 13."""
    h = 0
    for t in token_ids:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
    return h % VOCAB


def never_eos(token_ids: list[int]) -> int:
    return 1 + next_token(token_ids) % (VOCAB - 1)


def expected_completion(prompt: list[int], params: SamplingParams, max_model_len: int,
                        model=next_token) -> tuple[list[int], str]:
    """What one sequence generates alone, never preempted: its completion and finish reason."""
    token_ids = list(prompt)
    while True:
        token_ids.append(model(token_ids))
        if len(token_ids) - len(prompt) >= params.max_tokens or len(token_ids) >= max_model_len:
            return token_ids[len(prompt):], "length"  # first, as in vLLM: EOS as the last token allowed too
        if not params.ignore_eos and token_ids[-1] == EOS:
            return token_ids[len(prompt):], "stop"


class FakeRunner:
    """Stands in for ModelRunner: checks each step's reads and writes against a shadow KV cache."""

    def __init__(self, block_manager: BlockManager, model=next_token):
        self.bm, self.block_size, self.model = block_manager, block_manager.block_size, model
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (key of the token prefix it ends, token id)
        self.inputs: list[tuple[int, bool, list[int]]] = []  # (seq_id, is_prefill, tokens computed)

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def run(self, seqs: list[Sequence]) -> list[list[int] | None]:
        """Each sequence's new tokens: the model's next token, or with speculative drafts the drafts
        it agrees with and its own token after them (greedy verification)."""
        rows = []
        for seq in seqs:  # in batch order: a later sequence may read what an earlier one wrote
            assert seq.status == SequenceStatus.RUNNING
            first, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
            tokens, drafts = seq.token_ids + seq.spec_token_ids, seq.spec_token_ids
            assert len(seq.block_table) * self.block_size >= end and len(seq.block_table) >= seq.num_blocks
            assert first < end <= len(tokens) and first >= seq.num_cached_tokens
            assert seq.num_cached_tokens % self.block_size == 0
            key = 0
            for pos, token in enumerate(tokens[:end]):
                key = hash((key, token))
                slot = self.slot(seq, pos)
                if pos < first:  # read back from the cache: it must be this very prefix's K/V
                    assert self.kv.get(slot) == (key, token), f"seq {seq.seq_id} reads wrong K/V at {pos}"
                else:
                    # A prefill may write a block that a later sequence of the same batch already
                    # shares (it reads after the write); a decode step writes only its own blocks.
                    assert seq.num_computed_tokens < seq.num_prompt_tokens or \
                        all(self.bm.blocks[b].ref_count == 1 for b in seq.block_table[first // self.block_size:])
                    self.kv[slot] = (key, token)
            self.inputs.append((seq.seq_id, not seq.is_decode, tokens[first:end]))
            if end < seq.num_tokens:  # a prompt chunk with more to come
                rows.append(None)
                continue
            new = [self.model(seq.token_ids)]
            while len(new) <= len(drafts) and new[-1] == drafts[len(new) - 1]:
                new.append(self.model(seq.token_ids + drafts[:len(new)]))
            rows.append(new)
        return rows


def make_scheduler(num_blocks: int = 16, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                   caching: bool = True, model=next_token, chunked: bool = False) -> tuple[Scheduler, FakeRunner]:
    max_model_len = max_model_len or num_blocks * block_size
    bm = BlockManager(num_blocks, block_size, caching)
    scheduler = Scheduler(bm, max_num_seqs, max_num_batched_tokens or max_model_len, max_model_len, {EOS}, chunked)
    return scheduler, FakeRunner(bm, model)


def add(scheduler: Scheduler, prompt: list[int], max_tokens: int = 16, ignore_eos: bool = True) -> Sequence:
    seq = Sequence(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos),
                   scheduler.block_manager.block_size)
    scheduler.add(seq)
    return seq


def step(scheduler: Scheduler, runner: FakeRunner) -> tuple[list[Sequence], bool]:
    """One step; returns its sequences and whether any of them computed prompt tokens."""
    seqs, blocks_to_copy = scheduler.schedule()
    assert not blocks_to_copy  # no forked samples here
    is_prefill = not all(seq.is_decode for seq in seqs)
    scheduler.postprocess(seqs, runner.run(seqs))
    return seqs, is_prefill


def run_until_done(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> int:
    for steps in range(max_steps):
        if scheduler.is_finished():
            return steps
        step(scheduler, runner)
    raise AssertionError("the scheduler did not finish")


def check_books(scheduler: Scheduler, runner: FakeRunner) -> None:
    """Block accounting matches the queues, and every cache entry names a block holding its tokens."""
    bm, bs = scheduler.block_manager, scheduler.block_manager.block_size
    assert bm.num_free_blocks + bm.num_used_blocks == len(bm.blocks)
    holders = [0] * len(bm.blocks)
    for seq in scheduler.running:
        assert seq.status == SequenceStatus.RUNNING and len(seq.block_table) * bs >= seq.num_tokens - 1
        for b in seq.block_table:
            holders[b] += 1
    for seq in scheduler.waiting:
        assert seq.status == SequenceStatus.WAITING and seq.block_table == []
    assert [block.ref_count for block in bm.blocks] == holders
    assert bm.num_used_blocks == sum(1 for h in holders if h)
    for h, b in bm.hash_to_block_id.items():
        block = bm.blocks[b]
        assert block.hash == h
        assert block.token_ids == [runner.kv.get(b * bs + i, (None, None))[1] for i in range(bs)]


def check_all_released(scheduler: Scheduler) -> None:
    bm = scheduler.block_manager
    assert bm.num_free_blocks == len(bm.blocks) and bm.num_used_blocks == 0
    assert all(block.ref_count == 0 for block in bm.blocks)


# -- admission ----------------------------------------------------------------------------------

def test_new_sequence_is_prefilled_before_running_ones_decode():
    scheduler, runner = make_scheduler()
    a = add(scheduler, [1, 2, 3])
    assert step(scheduler, runner) == ([a], True)
    b = add(scheduler, [4, 5, 6])
    assert step(scheduler, runner) == ([b], True)
    assert a.num_completion_tokens == 1  # a did not decode in b's prefill step
    assert step(scheduler, runner) == ([a, b], False)
    assert a.num_completion_tokens == b.num_completion_tokens == 2


def test_prefill_admits_at_most_max_num_seqs():
    scheduler, runner = make_scheduler(max_num_seqs=2)
    a = add(scheduler, [1, 2], max_tokens=2)
    b = add(scheduler, [3, 4], max_tokens=5)
    c = add(scheduler, [5, 6], max_tokens=5)
    assert step(scheduler, runner) == ([a, b], True)
    assert step(scheduler, runner) == ([a, b], False)  # c waits: the batch is full
    assert a.is_finished and list(scheduler.waiting) == [c]
    assert step(scheduler, runner) == ([c], True)  # a's place is taken at once


def test_prefill_admits_in_arrival_order_and_stops_at_token_budget():
    scheduler, runner = make_scheduler(max_num_batched_tokens=24, max_model_len=24)
    a = add(scheduler, list(range(1, 21)))  # 20 tokens
    b = add(scheduler, list(range(30, 40)))  # 10 tokens: 30 > 24
    c = add(scheduler, [50, 51])  # would fit, but does not jump the queue
    assert step(scheduler, runner) == ([a], True)
    assert step(scheduler, runner) == ([b, c], True)


def test_token_budget_counts_only_tokens_not_served_from_the_cache():
    scheduler, runner = make_scheduler(max_num_batched_tokens=24, max_model_len=24)
    prefix = list(range(1, 17))  # four full blocks
    first = add(scheduler, prefix)
    step(scheduler, runner)
    b = add(scheduler, prefix + [1, 2, 3, 4])  # 20 tokens, 16 of them cached
    c = add(scheduler, list(range(20, 40)))  # 20 tokens, none cached
    assert step(scheduler, runner) == ([b, c], True)  # 4 + 20 computed tokens fit 24
    assert (b.num_cached_tokens, c.num_cached_tokens) == (16, 0)
    assert scheduler.prefix_cache_hit_tokens == 16
    assert b.block_table[:4] == first.block_table[:4]


# -- preemption ---------------------------------------------------------------------------------

def fill_cache_with_three_sequences(caching: bool = True):
    """a, b, c admitted in that order, 2 blocks each, the cache full, d waiting behind them."""
    scheduler, runner = make_scheduler(num_blocks=6, block_size=2, caching=caching, model=never_eos)
    a = add(scheduler, [1, 2, 3], max_tokens=4)
    step(scheduler, runner)
    b = add(scheduler, [4, 5, 6], max_tokens=4)
    step(scheduler, runner)
    c = add(scheduler, [7, 8, 9], max_tokens=6)
    step(scheduler, runner)
    d = add(scheduler, [10, 11, 12], max_tokens=2)
    assert step(scheduler, runner) == ([a, b, c], False)  # d does not fit; position 3 fits block 1
    assert scheduler.block_manager.num_free_blocks == 0
    return scheduler, runner, (a, b, c, d)


def test_preemption_evicts_the_most_recently_admitted_sequence_to_the_head_of_the_queue():
    scheduler, runner, (a, b, c, d) = fill_cache_with_three_sequences()
    seqs, is_prefill = step(scheduler, runner)  # a needs a third block: c, the newest, makes room
    assert (seqs, is_prefill) == ([a, b], False)
    assert scheduler.num_preemptions == 1
    assert list(scheduler.running) == [a, b] and list(scheduler.waiting) == [c, d]
    assert c.status == SequenceStatus.WAITING and c.block_table == []
    assert c.completion_token_ids == [never_eos([7, 8, 9]), never_eos([7, 8, 9, never_eos([7, 8, 9])])]
    check_books(scheduler, runner)


def test_preempted_sequence_is_reprefilled_with_prompt_and_generated_tokens():
    scheduler, runner, (a, b, c, d) = fill_cache_with_three_sequences(caching=False)
    step(scheduler, runner)  # c preempted with two generated tokens
    generated = c.completion_token_ids
    runner.inputs.clear()
    run_until_done(scheduler, runner)
    c_prefills = [tokens for seq_id, is_prefill, tokens in runner.inputs if seq_id == c.seq_id and is_prefill]
    assert c_prefills[0] == [7, 8, 9] + generated
    assert c.completion_token_ids[:2] == generated
    check_all_released(scheduler)


@pytest.mark.parametrize("caching", [True, False])
def test_preempted_sequence_recomputes_to_same_tokens(caching):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [1, 2, 3, 4, 9], [2, 2], [1, 2, 3, 4, 5, 6, 7]]
    results = {}
    for num_blocks in (5, 64):  # forced preemptions, then none
        scheduler, runner = make_scheduler(num_blocks=num_blocks, block_size=2, max_model_len=10, caching=caching)
        seqs = [add(scheduler, p, max_tokens=9, ignore_eos=i % 2 == 0) for i, p in enumerate(prompts)]
        run_until_done(scheduler, runner)
        results[num_blocks] = [(s.completion_token_ids, s.finish_reason) for s in seqs]
        assert (scheduler.num_preemptions > 0) == (num_blocks == 5)
        check_all_released(scheduler)
    assert results[5] == results[64]
    assert results[64] == [expected_completion(p, s.sampling_params, 10) for p, s in zip(prompts, seqs)]


# -- finishing ----------------------------------------------------------------------------------

def scripted(eos_after: int):
    """A fake model that says EOS once the sequence has ``eos_after`` tokens, and 5 otherwise."""
    return lambda token_ids: EOS if len(token_ids) >= eos_after else 5


def test_sequence_finishes_on_eos_and_frees_its_blocks_at_once():
    scheduler, runner = make_scheduler(model=scripted(eos_after=6))
    seq = add(scheduler, [1, 2, 3], max_tokens=50, ignore_eos=False)
    for _ in range(3):
        step(scheduler, runner)
    assert seq.completion_token_ids == [5, 5, 5] and not seq.is_finished
    seqs, _ = step(scheduler, runner)
    assert seqs == [seq] and seq.is_finished and seq.finish_reason == "stop"
    assert seq.completion_token_ids == [5, 5, 5, EOS]
    assert scheduler.is_finished() and seq.block_table == []
    check_all_released(scheduler)


def test_ignore_eos_generates_through_eos_up_to_max_tokens():
    scheduler, runner = make_scheduler(model=scripted(eos_after=4))
    seq = add(scheduler, [1, 2, 3], max_tokens=5, ignore_eos=True)
    assert run_until_done(scheduler, runner) == 5
    assert seq.completion_token_ids == [5, EOS, EOS, EOS, EOS] and seq.finish_reason == "length"
    check_all_released(scheduler)


def test_sequence_finishes_at_max_tokens():
    scheduler, runner = make_scheduler(model=never_eos)
    short, long = add(scheduler, [1], max_tokens=1), add(scheduler, [2], max_tokens=7)
    step(scheduler, runner)
    assert short.is_finished and short.num_completion_tokens == 1 and list(scheduler.running) == [long]
    run_until_done(scheduler, runner)
    assert long.num_completion_tokens == 7 and long.finish_reason == "length"


def test_sequence_finishes_at_max_model_len():
    scheduler, runner = make_scheduler(num_blocks=4, block_size=4, max_model_len=10, model=never_eos)
    seq = add(scheduler, [1] * 7, max_tokens=100)
    full = add(scheduler, [2] * 10, max_tokens=100)  # a prompt of exactly max_model_len
    run_until_done(scheduler, runner)
    assert seq.num_tokens == 10 and seq.finish_reason == "length"
    assert full.num_completion_tokens == 1 and full.finish_reason == "length"
    check_all_released(scheduler)


def test_finish_drops_a_waiting_or_running_sequence():
    scheduler, runner = make_scheduler(num_blocks=2, block_size=4)
    running = add(scheduler, [1, 2, 3, 4, 5])
    waiting = add(scheduler, [6, 7, 8, 9, 10])
    step(scheduler, runner)
    assert list(scheduler.running) == [running] and list(scheduler.waiting) == [waiting]
    scheduler.finish(waiting, "abort")
    scheduler.finish(running, "abort")
    assert scheduler.is_finished() and running.finish_reason == waiting.finish_reason == "abort"
    check_all_released(scheduler)


# -- random workloads ---------------------------------------------------------------------------

@dataclass
class Request:
    arrival: int
    prompt: list[int]
    params: SamplingParams
    abort_at: int | None  # a step at which the caller drops it, if still unfinished


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(1, 12))
    capacity = min(num_blocks * block_size, 32)
    max_model_len = draw(st.one_of(st.just(capacity), st.integers(1, capacity)))  # often as large as allowed
    chunked = draw(st.booleans())
    # Chunked prefill splits prompts, so its budget may be smaller than one prompt.
    config = dict(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
                  max_num_batched_tokens=draw(st.integers(1 if chunked else max_model_len, 2 * max_model_len + 4)),
                  max_num_seqs=draw(st.integers(1, 5)), caching=draw(st.booleans()), chunked=chunked,
                  speculate=draw(st.sampled_from([0, 1, 3, 6])), wrong_every=draw(st.integers(2, 5)))
    bases = draw(st.lists(st.lists(st.integers(1, VOCAB - 1), max_size=24), min_size=1, max_size=3))
    requests = []
    for _ in range(draw(st.integers(1, 12))):
        base = bases[draw(st.integers(0, len(bases) - 1))]
        tail = draw(st.lists(st.integers(0, VOCAB - 1), max_size=8))
        shared = draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))
        prompt = (base[:shared] + tail)[:max_model_len] or [1]
        params = SamplingParams(temperature=0, max_tokens=draw(st.integers(1, 24)), ignore_eos=draw(st.booleans()))
        abort_at = draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, 40)))
        requests.append(Request(draw(st.integers(0, 15)), prompt, params, abort_at))
    return config, requests


def propose_drafts(seqs: list[Sequence], k: int, max_model_len: int, wrong_every: int) -> None:
    """Speculative drafts for the sequences that just got tokens: the model's own continuation, with
    every ``wrong_every``-th position guessed wrong. Unlike the engine's proposer they may run past
    ``max_tokens`` (the scheduler must cut the run there); never past ``max_model_len``."""
    for seq in seqs:
        if seq.is_finished:
            continue
        tokens = list(seq.token_ids)
        for j in range(max(0, min(k, max_model_len - seq.num_tokens - 1))):
            guess = next_token(tokens)
            tokens.append(guess if len(tokens) % wrong_every else (guess + 1) % VOCAB)
        seq.spec_token_ids = tokens[seq.num_tokens:]


def drive(config: dict, requests: list[Request]) -> Scheduler:
    """Run a workload to the end, checking the scheduler's contract at every step. With ``speculate``
    (a number of drafts) the sequences bring drafts to their steps, and every output must be as
    without them."""
    config = dict(config)
    speculate, wrong_every = config.pop("speculate", 0), config.pop("wrong_every", 2)
    scheduler, runner = make_scheduler(**config)
    bm, max_num_seqs, budget = scheduler.block_manager, config["max_num_seqs"], scheduler.max_num_batched_tokens
    seqs: dict[int, Sequence] = {}
    # Every model step gives at least one sequence a token, or (chunked) computes at least one prompt
    # token: more steps than that is a livelock.
    max_steps = max(r.arrival for r in requests) + sum(r.params.max_tokens for r in requests) + 1
    if config.get("chunked"):
        max_steps += sum(len(r.prompt) + r.params.max_tokens for r in requests) * (1 + len(requests))
    for now in range(max_steps + 1):
        for i, r in enumerate(requests):
            if r.arrival == now:
                seqs[i] = add(scheduler, r.prompt, r.params.max_tokens, r.params.ignore_eos)
            if r.abort_at == now and i in seqs and not seqs[i].is_finished:
                scheduler.finish(seqs[i], "abort")
        if len(seqs) == len(requests) and scheduler.is_finished():
            break
        if scheduler.is_finished():
            continue
        waiting, running = list(scheduler.waiting), list(scheduler.running)
        hits_before, preemptions_before = scheduler.prefix_cache_hit_tokens, scheduler.num_preemptions
        num_tokens = [s.num_tokens for s in waiting + running]
        head_fits = bool(waiting) and len(running) < max_num_seqs and bm.can_allocate(waiting[0])

        without_drafts = copy.deepcopy(scheduler)  # the same step had nobody brought drafts
        for s in without_drafts.waiting + without_drafts.running:
            s.spec_token_ids = []
        batch = scheduler.schedule().seqs
        assert batch and len(set(batch)) == len(batch)
        check_drafts_come_last(scheduler, batch, without_drafts)
        assert [s.num_tokens for s in waiting + running] == num_tokens, "preemption keeps generated tokens"
        computed = sum(s.num_scheduled_tokens for s in batch)
        assert computed <= budget and len(scheduler.running) <= max_num_seqs
        admitted = [s for s in batch if s not in running]
        assert scheduler.prefix_cache_hit_tokens == hits_before + sum(s.num_cached_tokens for s in admitted)
        if not config["caching"]:
            assert all(s.num_cached_tokens == 0 for s in admitted)
        if config.get("chunked"):
            check_chunked_step(scheduler, batch, admitted, running, waiting, preemptions_before, budget)
        elif admitted:
            assert head_fits, "prefill must go first whenever the queue's head can be admitted"
            assert batch == admitted == waiting[:len(batch)] and list(scheduler.running) == running + batch
            assert all(s.num_computed_tokens + s.num_scheduled_tokens == s.num_tokens for s in batch)
            if scheduler.waiting and len(scheduler.running) < max_num_seqs:  # the next one could not join
                head = scheduler.waiting[0]
                assert (computed + head.num_tokens - bm.num_hit_tokens(head) > budget
                        or not bm.can_allocate(head))
        else:
            assert not head_fits, "prefill must go first whenever the queue's head can be admitted"
            kept = list(scheduler.running)
            assert batch == kept == running[:len(kept)], "only the newest sequences may be preempted"
            preempted = running[len(kept):]
            assert list(scheduler.waiting) == preempted + waiting  # back at the head, oldest first
            assert scheduler.num_preemptions == preemptions_before + len(preempted)
        stepped = scheduler.postprocess(batch, runner.run(batch))
        for seq in batch:
            assert not seq.is_finished or (seq.block_table == [] and seq not in scheduler.running)
            assert seq.is_finished or len(seq.block_table) <= seq.num_blocks, "blocks of rejected drafts are freed"
        check_books(scheduler, runner)
        if speculate:
            propose_drafts(stepped, speculate, config["max_model_len"], wrong_every)
    else:
        raise AssertionError(f"not finished after {max_steps} steps")

    check_all_released(scheduler)
    counts = scheduler.spec_decode_counts
    assert counts["num_accepted_tokens"] <= counts["num_draft_tokens"]
    for i, r in enumerate(requests):
        seq = seqs[i]
        completion, reason = expected_completion(r.prompt, r.params, config["max_model_len"])
        if seq.finish_reason == "abort":
            assert completion[:seq.num_completion_tokens] == seq.completion_token_ids
        else:
            assert (seq.completion_token_ids, seq.finish_reason) == (completion, reason)
    return scheduler


def check_drafts_come_last(scheduler: Scheduler, batch: list[Sequence], without_drafts: Scheduler) -> None:
    """Drafts get only what the step would leave unused without them: the same sequences run (in the
    same order, each with the same required tokens), the same prompts are admitted and the same
    sequences preempted, as if no sequence had brought a draft."""
    plain = without_drafts.schedule().seqs
    assert [s.seq_id for s in batch] == [s.seq_id for s in plain], "a draft displaced another sequence"
    assert [s.num_scheduled_tokens - len(s.spec_token_ids) for s in batch] == \
        [s.num_scheduled_tokens for s in plain], "a draft took a required token's place"
    assert scheduler.num_preemptions == without_drafts.num_preemptions, "a draft caused a preemption"
    assert [s.seq_id for s in scheduler.waiting] == [s.seq_id for s in without_drafts.waiting]


def check_chunked_step(scheduler: Scheduler, batch: list[Sequence], admitted: list[Sequence],
                       running: list[Sequence], waiting: list[Sequence], preemptions_before: int, budget: int):
    """vLLM V1's rule: running sequences first (oldest first, the newest preempted when blocks run
    out), then waiting ones fill what is left of the budget, only the last admitted one in part."""
    kept = [s for s in running if s.status == SequenceStatus.RUNNING]
    preempted = running[len(kept):]
    assert kept == running[:len(kept)], "only the newest sequences may be preempted"
    assert scheduler.num_preemptions == preemptions_before + len(preempted)
    assert list(scheduler.running) == kept + admitted
    assert admitted == waiting[:len(admitted)], "admitted in queue order"
    assert not (admitted and preempted), "no admission in a step that had to preempt"
    assert list(scheduler.waiting) == (preempted + waiting)[len(admitted):]
    from_running = batch[:len(batch) - len(admitted)]
    assert batch[len(batch) - len(admitted):] == admitted and from_running == kept[:len(from_running)]
    computed = sum(s.num_scheduled_tokens for s in batch)
    if len(from_running) < len(kept):
        assert computed == budget, "a running sequence was skipped although the budget had room"
    for s in batch:
        remaining = s.num_tokens - s.num_computed_tokens + len(s.spec_token_ids)  # drafts too, as they fit
        assert 1 <= s.num_scheduled_tokens <= remaining
        assert s.num_scheduled_tokens == remaining or (s is batch[-1] and computed == budget), \
            "only the step's last sequence is cut short, and only by the budget"


@settings(max_examples=300, deadline=None)
@given(workloads())
def test_random_workloads_end_with_exactly_the_tokens_asked_for(workload):
    drive(*workload)


def test_fixed_workload_exercises_preemption_and_prefix_hits():
    """The random test's driver on a workload known to preempt and to hit the prefix cache."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = [3, 1, 4, 1, 5, 9, 2, 6]
    requests = [Request(i % 3, base[:4 + i] + [i], params, None) for i in range(6)]
    scheduler = drive(dict(num_blocks=8, block_size=2, max_model_len=16, max_num_batched_tokens=16,
                           max_num_seqs=4, caching=True), requests)
    assert scheduler.num_preemptions > 0 and scheduler.prefix_cache_hit_tokens > 0


def test_drafts_that_do_not_fit_the_free_blocks_are_cut_and_preempt_nobody():
    scheduler, runner = make_scheduler(num_blocks=3, block_size=4, max_model_len=12)
    a, b = add(scheduler, [1, 2, 3, 4, 5]), add(scheduler, [6, 7, 8])  # 2 blocks and 1: the cache is full
    step(scheduler, runner)
    assert scheduler.block_manager.num_free_blocks == 0 and (a.num_tokens, b.num_tokens) == (6, 4)
    a.spec_token_ids = [9, 10, 11]  # positions 6..8: the third needs a block there is none of
    seqs, _ = scheduler.schedule()
    assert seqs == [a, b] and scheduler.num_preemptions == 0
    assert a.spec_token_ids == [9, 10] and a.num_scheduled_tokens == 3 and len(a.block_table) == 2


def test_drafts_get_only_the_budget_and_blocks_that_required_tokens_and_prompts_leave():
    """Chunked prefill, a budget of 4: the older sequence's 3 drafts wait for the younger one's token
    and a new prompt; then, with 3 free blocks, they take none that a younger sequence's token needs."""
    scheduler, runner = make_scheduler(num_blocks=7, block_size=2, max_num_batched_tokens=4, chunked=True)
    a, b = add(scheduler, [1, 2, 3]), add(scheduler, [4])
    step(scheduler, runner)  # a: 3 prompt tokens and 1 generated, b: 1 + 1
    a.spec_token_ids = [5, 6, 7]
    c = add(scheduler, [8, 9])
    seqs, _ = scheduler.schedule()
    assert seqs == [a, b, c] and [s.num_scheduled_tokens for s in seqs] == [1, 1, 2] and a.spec_token_ids == []
    scheduler.postprocess(seqs, runner.run(seqs))
    assert scheduler.block_manager.num_free_blocks == 3
    a.spec_token_ids = [5, 6, 7]  # each token needs a new block; a's drafts after the first, another
    seqs, _ = scheduler.schedule()
    assert seqs == [a, b, c] and scheduler.num_preemptions == 0 and a.spec_token_ids == [5]


@pytest.mark.parametrize("chunked", [False, True])
def test_speculative_drafts_give_the_same_tokens_and_their_rejected_slots_are_taken_back(chunked):
    """The driver with drafts that are right two times in three: each output is as without them, every
    K/V read is of the right tokens (the fake runner checks), the blocks of rejected drafts are
    freed after each step, and all of them at the end, through preemptions and prefix hits."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = [3, 1, 4, 1, 5, 9, 2, 6]
    requests = [Request(i % 3, base[:4 + i] + [i], params, None) for i in range(6)]
    scheduler = drive(dict(num_blocks=8, block_size=2, max_model_len=16, max_num_batched_tokens=16, max_num_seqs=4,
                           caching=True, chunked=chunked, speculate=3, wrong_every=3), requests)
    counts = scheduler.spec_decode_counts
    assert 0 < counts["num_accepted_tokens"] < counts["num_draft_tokens"]
    assert scheduler.num_preemptions > 0 and scheduler.prefix_cache_hit_tokens > 0


def test_chunked_prefill_mixes_running_decodes_with_chunks_of_a_new_prompt():
    scheduler, runner = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=6, chunked=True)
    a = add(scheduler, [1, 2, 3])
    assert step(scheduler, runner) == ([a], True)
    b = add(scheduler, list(range(1, 12)))  # 11 tokens: chunks of 5, 5 and 1 beside a's decodes
    for _ in range(3):
        assert step(scheduler, runner) == ([a, b], True)
    assert [(seq_id, list(tokens)) for seq_id, _, tokens in runner.inputs[1:]] == [
        (a.seq_id, [a.token_ids[3]]), (b.seq_id, list(range(1, 6))),  # b's first chunk ends mid-block
        (a.seq_id, [a.token_ids[4]]), (b.seq_id, list(range(6, 11))),  # its second starts mid-block
        (a.seq_id, [a.token_ids[5]]), (b.seq_id, [11])]
    assert b.num_completion_tokens == 1  # only the step that reached b's last token sampled
    run_until_done(scheduler, runner)
    for seq, prompt in ((a, [1, 2, 3]), (b, list(range(1, 12)))):
        assert (seq.completion_token_ids, seq.finish_reason) == expected_completion(prompt, seq.sampling_params, 64)
    check_all_released(scheduler)


def test_chunked_prefill_keeps_decoding_while_a_burst_of_prompts_is_computed():
    scheduler, runner = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=16, max_num_batched_tokens=8,
                                       max_model_len=64, chunked=True)
    streams = [add(scheduler, [i + 1], max_tokens=30) for i in range(2)]
    step(scheduler, runner)
    burst = [add(scheduler, list(range(1, 20)), max_tokens=2) for _ in range(4)]
    for _ in range(10):  # every step decodes both streams while the burst is computed in chunks
        batch, _ = step(scheduler, runner)
        assert batch[:2] == streams
    assert all(seq.num_completion_tokens == 11 for seq in streams)  # a token every step
    assert any(seq.num_completion_tokens for seq in burst)  # and the burst got computed meanwhile
    run_until_done(scheduler, runner)
    assert all(seq.finish_reason == "length" for seq in streams + burst)
