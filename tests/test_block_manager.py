"""BlockManager: paged KV-cache accounting and prefix caching.

The unit tests check the behaviours vLLM's own block-manager tests check, one at a time. The
state machine at the end drives a BlockManager through long random runs of prefills, decode
steps, finishes and preemptions, side by side with a small reference model that keeps the same
books with plain lists and a content-addressed cache, and compares the two after every step.

No model runs here: a "prefill" is ``allocate`` -> (the model writes K/V) -> ``cache_full_blocks``
-> appending the token the model would have sampled, and a "decode step" is ``may_append`` -> (the model writes K/V) ->
``cache_full_blocks`` -> ``append_token``, the order in which the scheduler calls them.
"""

import pytest

pytest.importorskip("hypothesis")  # a test extra: a bare GPU machine may lack it (`pytest -m cuda` there)
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from nanoengine.block_manager import NULL_BLOCK_ID, BlockManager, compute_block_hash
from nanoengine.sampling_params import SamplingParams
from nanoengine.sequence import Sequence

BS = 4  # block size of the unit tests


def make_seq(token_ids: list[int], block_size: int = BS) -> Sequence:
    return Sequence(token_ids, SamplingParams(), block_size)


def computed(bm: BlockManager, seq: Sequence) -> None:
    """A step has written the K/V of every token the sequence has (the scheduler's postprocess)."""
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def admit(bm: BlockManager, seq: Sequence) -> None:
    """A prefill step that has run: blocks for every token, their K/V written, full ones cached."""
    bm.allocate(seq)
    computed(bm, seq)


def prefill(bm: BlockManager, seq: Sequence, sampled: int = 99) -> None:
    """What one prefill step does to the books: blocks for every token, then one sampled token."""
    assert bm.can_allocate(seq)
    admit(bm, seq)
    seq.append_token(sampled)


def decode(bm: BlockManager, seq: Sequence, sampled: int = 98) -> None:
    """What one decode step does: a slot for the newest token, its K/V written, the next token."""
    assert bm.can_append(seq)
    bm.may_append(seq)
    computed(bm, seq)
    seq.append_token(sampled)


def chain_hashes(token_ids: list[int], block_size: int = BS) -> list[int]:
    """The expected hash of each full block: each one folds in the hash of the block before."""
    hashes, prev = [], -1
    for i in range(len(token_ids) // block_size):
        prev = compute_block_hash(token_ids[i * block_size:(i + 1) * block_size], prev)
        hashes.append(prev)
    return hashes


# -- hashing ------------------------------------------------------------------------------------

def test_block_hash_depends_on_every_earlier_block():
    same_block = [5, 6, 7, 8]
    assert compute_block_hash(same_block, -1) == compute_block_hash(list(same_block), -1)
    assert compute_block_hash(same_block, -1) != compute_block_hash([5, 6, 7, 9], -1)
    first_a, first_b = compute_block_hash([1, 1, 1, 1], -1), compute_block_hash([2, 2, 2, 2], -1)
    # The same tokens after a different prefix are a different block of K/V.
    assert compute_block_hash(same_block, first_a) != compute_block_hash(same_block, first_b)
    assert compute_block_hash(same_block, first_a) != compute_block_hash(same_block, -1)


def test_full_blocks_get_chained_hashes_and_partial_block_none():
    bm = BlockManager(8, BS)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    seq = make_seq(tokens)
    bm.allocate(seq)
    assert len(seq.block_table) == 3
    hashes = [bm.blocks[b].hash for b in seq.block_table]
    assert hashes[:2] == chain_hashes(tokens)
    assert hashes[2] == -1  # 2 of 4 slots: a partial block is never a cache entry
    assert bm.hash_to_block_id == {hashes[0]: seq.block_table[0], hashes[1]: seq.block_table[1]}
    assert bm.blocks[seq.block_table[1]].token_ids == [5, 6, 7, 8]


def test_blocks_of_a_step_that_never_completes_lose_their_hashes():
    """A prefill caches its full blocks at once, so that a later prompt of the same step can
    share them; if the step fails, the engine frees them before it wrote their K/V, and they must
    not stay cache hits."""
    bm = BlockManager(8, BS)
    prefix = [1, 2, 3, 4, 5, 6, 7, 8]
    a, b = make_seq(prefix + [9]), make_seq(prefix + [10])
    bm.allocate(a)
    bm.allocate(b)  # the same step
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    bm.deallocate(b)  # the step raised: the engine aborts both
    bm.deallocate(a)
    assert bm.hash_to_block_id == {} and bm.num_hit_tokens(make_seq(prefix + [0])) == 0
    c = make_seq(prefix + [11])
    prefill(bm, c)  # a step that completes keeps them
    bm.deallocate(c)
    assert bm.num_hit_tokens(make_seq(prefix + [0])) == 8


def test_equal_block_after_different_prefix_is_not_shared():
    bm = BlockManager(8, BS)
    a = make_seq([1, 1, 1, 1, 7, 7, 7, 7, 0])
    b = make_seq([2, 2, 2, 2, 7, 7, 7, 7, 0])
    prefill(bm, a)
    prefill(bm, b)
    assert b.num_cached_tokens == 0
    assert not set(a.block_table) & set(b.block_table)


def test_hash_hit_is_confirmed_against_stored_tokens(monkeypatch):
    # Every block hashes alike: only the token check stands between a collision and wrong K/V.
    monkeypatch.setattr("nanoengine.block_manager.compute_block_hash", lambda token_ids, prefix_hash: 42)
    bm = BlockManager(8, BS)
    a = make_seq([1, 2, 3, 4, 5])
    prefill(bm, a)
    b = make_seq([9, 9, 9, 9, 5])
    assert bm.num_hit_tokens(b) == 0
    prefill(bm, b)
    assert b.num_cached_tokens == 0 and b.block_table[0] != a.block_table[0]


# -- sharing and reviving -----------------------------------------------------------------------

def test_live_sequences_with_common_prefix_share_blocks():
    bm = BlockManager(8, BS)
    prefix = [1, 2, 3, 4, 5, 6, 7, 8]
    a, b = make_seq(prefix + [9, 10]), make_seq(prefix + [11])
    prefill(bm, a)
    used = bm.num_used_blocks
    prefill(bm, b)
    assert b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in b.block_table] == [2, 2, 1]
    assert bm.num_used_blocks == used + 1
    bm.deallocate(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]


def test_prefix_is_revived_after_first_sequence_finished():
    bm = BlockManager(8, BS)
    prefix = [1, 2, 3, 4, 5, 6, 7, 8]
    a = make_seq(prefix + [9])
    prefill(bm, a)
    shared = a.block_table[:2]
    bm.deallocate(a)
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0
    b = make_seq(prefix + [20, 21])
    assert bm.num_hit_tokens(b) == 8
    prefill(bm, b)
    assert b.block_table[:2] == shared
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    assert bm.num_free_blocks == 5


def test_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(8, BS)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]  # exactly two full blocks, both cached
    a = make_seq(prompt)
    prefill(bm, a)
    b = make_seq(prompt)  # while a is live
    prefill(bm, b)
    # The last token's hidden state gives the next token's logits, so its block is recomputed.
    assert b.num_cached_tokens == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    bm.deallocate(a)
    bm.deallocate(b)
    c = make_seq(prompt)  # after both finished
    assert bm.num_hit_tokens(c) == 4
    one = BlockManager(8, 1)  # block size 1: every token but the last may be served
    prefill(one, make_seq([3, 1, 4], 1))
    assert one.num_hit_tokens(make_seq([3, 1, 4], 1)) == 2


def test_can_allocate_counts_revived_blocks_against_the_free_pool():
    bm = BlockManager(4, BS)
    prefix = [1, 2, 3, 4, 5, 6, 7, 8]
    a = make_seq(prefix + [9])
    prefill(bm, a)
    # While a holds the prefix, sharing it costs no free block: 2 shared + 1 new of 1 free.
    assert bm.can_allocate(make_seq(prefix + [30]))
    assert not bm.can_allocate(make_seq(prefix + [30, 31, 32, 33, 34]))
    bm.deallocate(a)
    # Once freed, the cached blocks sit in the free pool: reviving them uses it up too.
    assert bm.can_allocate(make_seq(prefix + list(range(30, 38))))  # 4 blocks, 2 revived
    assert not bm.can_allocate(make_seq(prefix + list(range(30, 39))))  # 5 blocks


def test_everything_is_free_after_all_sequences_finish():
    bm = BlockManager(10, BS)
    seqs = [make_seq([1, 2, 3, 4, 5, 6]), make_seq([1, 2, 3, 4, 7]), make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])]
    for seq in seqs:
        prefill(bm, seq)
    for _ in range(6):
        for seq in seqs:
            decode(bm, seq)
    assert bm.num_used_blocks > 0
    for seq in seqs:
        bm.deallocate(seq)
        assert seq.block_table == []
    assert bm.num_free_blocks == 10 and bm.num_used_blocks == 0
    assert all(block.ref_count == 0 for block in bm.blocks)


# -- eviction -----------------------------------------------------------------------------------

def test_least_recently_freed_blocks_are_reused_first():
    bm = BlockManager(6, BS)
    a, b, c = make_seq([1] * 4), make_seq([2] * 4), make_seq([3] * 4)
    for seq in (a, b, c):
        admit(bm, seq)  # one full, cached block each: 0, 1, 2
    assert [a.block_table, b.block_table, c.block_table] == [[0], [1], [2]]
    bm.deallocate(b)
    bm.deallocate(a)
    bm.deallocate(c)
    d = make_seq(list(range(100, 120)))  # five blocks of new content
    admit(bm, d)
    assert d.block_table == [3, 4, 5, 1, 0]  # never used first, then in the order freed
    assert bm.num_hit_tokens(make_seq([3] * 4 + [0])) == 4  # freed last: still cached
    assert bm.num_hit_tokens(make_seq([1] * 4 + [0])) == 0  # reused: gone


def test_sequence_frees_its_tail_blocks_before_its_head():
    bm = BlockManager(3, BS)
    a = make_seq(list(range(12)))
    admit(bm, a)
    bm.deallocate(a)
    b = make_seq([50, 51])
    admit(bm, b)  # takes the block that held a's last block
    assert b.block_table == [2]
    assert bm.num_hit_tokens(make_seq(list(range(9)))) == 8  # a's first two blocks survive


def test_reused_block_loses_its_stale_hash_entry():
    bm = BlockManager(2, BS)
    a = make_seq([1, 2, 3, 4, 5])
    prefill(bm, a)
    old_hash, old_block = bm.blocks[a.block_table[0]].hash, a.block_table[0]
    bm.deallocate(a)
    assert bm.hash_to_block_id[old_hash] == old_block  # kept while free
    b = make_seq([7, 7, 7, 7, 7, 7, 7, 7])
    prefill(bm, b)  # needs both blocks: a's cached block is overwritten
    assert old_hash not in bm.hash_to_block_id
    assert set(bm.hash_to_block_id.values()) == set(b.block_table)
    for h, block_id in bm.hash_to_block_id.items():
        assert bm.blocks[block_id].hash == h and bm.blocks[block_id].token_ids == [7, 7, 7, 7]
    bm.deallocate(b)
    assert bm.num_hit_tokens(make_seq([1, 2, 3, 4, 5])) == 0


# -- decode -------------------------------------------------------------------------------------

def test_decode_takes_one_new_block_exactly_at_each_block_boundary():
    bm = BlockManager(8, BS)
    seq = make_seq([1, 2, 3, 4, 5])
    prefill(bm, seq)
    assert len(seq.block_table) == 2
    grew_at = []
    for _ in range(12):
        before_table, before_free = len(seq.block_table), bm.num_free_blocks
        bm.may_append(seq)
        grew = len(seq.block_table) - before_table
        assert grew in (0, 1) and bm.num_free_blocks == before_free - grew
        assert len(seq.block_table) * BS >= seq.num_tokens  # the newest token has a slot
        if grew:
            grew_at.append(seq.num_tokens)
        computed(bm, seq)
        seq.append_token(0)
    # The token at position 8, 12, 16 (the 9th, 13th, 17th) is the first of a new block.
    assert grew_at == [9, 13, 17]


def test_decode_caches_a_block_only_once_its_kv_is_written():
    bm = BlockManager(8, BS)
    seq = make_seq([1, 2, 3, 4, 5, 6])
    prefill(bm, seq, sampled=7)
    decode(bm, seq, sampled=8)  # writes position 6
    assert seq.block(1) == [5, 6, 7, 8]
    bm.may_append(seq)  # the step that writes position 7 is scheduled, but has not run yet
    assert bm.blocks[seq.block_table[1]].hash == -1
    assert bm.num_hit_tokens(make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0])) == 4
    computed(bm, seq)  # it has run: block 1 is now full of K/V
    seq.append_token(0)
    block = bm.blocks[seq.block_table[1]]
    assert block.hash == chain_hashes([1, 2, 3, 4, 5, 6, 7, 8])[1]
    assert bm.hash_to_block_id[block.hash] == seq.block_table[1]
    probe = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0])
    prefill(bm, probe)
    assert probe.num_cached_tokens == 8 and probe.block_table[:2] == seq.block_table[:2]


def test_can_append_only_needs_a_free_block_at_a_boundary():
    bm = BlockManager(2, BS)
    seq = make_seq([1, 2, 3, 4, 5, 6])
    prefill(bm, seq)  # 7 tokens in 2 blocks, none free
    assert bm.num_free_blocks == 0
    decode(bm, seq)  # position 6 still fits the second block
    assert seq.num_tokens == 8
    decode(bm, seq)  # position 7 as well
    assert not bm.can_append(seq)  # position 8 needs a third block


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    a = make_seq(prompt)
    prefill(bm, a)
    for _ in range(4):
        decode(bm, a)
    b = make_seq(prompt)
    assert bm.num_hit_tokens(b) == 0
    prefill(bm, b)
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)
    bm.deallocate(a)
    assert bm.num_hit_tokens(make_seq(prompt)) == 0
    assert bm.hash_to_block_id == {} and all(block.hash == -1 for block in bm.blocks)


# -- random runs against a reference model ------------------------------------------------------

class ReferenceBooks:
    """The block manager's accounting kept the plain way, to compare against after every step.

    The cache here is content-addressed: a full block is known by the tuple of every token up to
    its end, so there are no hashes and no collisions. ``written[b]`` is the token prefix whose
    K/V physical block ``b`` holds (up to the last slot written), as a model runner would leave it.
    When a prefix is written twice, the newest block is the one the cache points at.
    """

    def __init__(self, num_blocks: int, block_size: int, caching: bool):
        self.block_size, self.caching = block_size, caching
        self.free = list(range(num_blocks))  # the front was freed longest ago
        self.ref = [0] * num_blocks
        self.cache: dict[tuple, int] = {}
        self.written: dict[int, tuple] = {}

    def hits(self, token_ids: list[int]) -> list[int]:
        if not self.caching:
            return []
        hits = []
        for i in range((len(token_ids) - 1) // self.block_size):
            block_id = self.cache.get(tuple(token_ids[:(i + 1) * self.block_size]))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def needs_from_pool(self, token_ids: list[int]) -> int:
        hits = self.hits(token_ids)
        num_blocks = -(-len(token_ids) // self.block_size)
        return num_blocks - len(hits) + sum(1 for b in hits if self.ref[b] == 0)

    def take(self) -> int:
        block_id = self.free.pop(0)
        self.cache = {k: v for k, v in self.cache.items() if v != block_id}
        self.written.pop(block_id, None)
        self.ref[block_id] = 1
        return block_id

    def write(self, block_id: int, token_ids: list[int], end: int) -> None:
        """K/V for the tokens up to ``end`` (exclusive) is now in ``block_id``."""
        self.written[block_id] = tuple(token_ids[:end])
        if self.caching and end % self.block_size == 0:
            self.cache[tuple(token_ids[:end])] = block_id

    def prefill(self, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """The block table the sequence should get, and which of its blocks are cache hits."""
        hits = self.hits(token_ids)
        for b in hits:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1
        table = list(hits)
        for i in range(len(hits), -(-len(token_ids) // self.block_size)):
            table.append(self.take())
        return table, hits

    def forget_prompt(self, table: list[int], num_hits: int, token_ids: list[int]) -> None:
        """The prefill step failed: no prefix its fresh blocks would have held is cached, not even
        an older copy elsewhere (the failed step's pending block had replaced that entry)."""
        for i in range(num_hits, len(token_ids) // self.block_size):
            self.cache.pop(tuple(token_ids[:(i + 1) * self.block_size]), None)

    def compute_prompt(self, table: list[int], num_hits: int, token_ids: list[int]) -> None:
        """The prefill step has run: the K/V of every token past the cached prefix is written."""
        for i in range(num_hits, len(table)):
            self.write(table[i], token_ids, min((i + 1) * self.block_size, len(token_ids)))

    def append_slot(self, table: list[int], token_ids: list[int]) -> list[int]:
        """The table with a slot for the newest token: one block longer at a block boundary."""
        if (len(token_ids) - 1) // self.block_size == len(table):
            return table + [self.take()]
        return table

    def release(self, table: list[int]) -> None:
        for b in reversed(table):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)


tokens_st = st.lists(st.integers(0, 2), min_size=0, max_size=12)


class BlockManagerAgainstReference(RuleBasedStateMachine):
    """Random arrivals (with shared prefixes), decode steps, finishes, preemptions, re-admissions."""

    @initialize(num_blocks=st.integers(1, 10), block_size=st.sampled_from([1, 2, 3, 4]), caching=st.booleans(),
                prefixes=st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=16), min_size=1, max_size=3))
    def setup(self, num_blocks, block_size, caching, prefixes):
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.ref = ReferenceBooks(num_blocks, block_size, caching)
        self.block_size, self.max_len = block_size, num_blocks * block_size
        self.prefixes = prefixes
        self.live: list[Sequence] = []  # in order of admission
        self.preempted: list[Sequence] = []

    def _admit(self, seq: Sequence, completes: bool = True) -> bool:
        fits = self.ref.needs_from_pool(seq.token_ids) <= len(self.ref.free)
        assert self.bm.can_allocate(seq) == fits
        if not fits:
            return False
        cached_before = self.bm.num_hit_tokens(seq)
        self.bm.allocate(seq)
        table, hits = self.ref.prefill(seq.token_ids)
        assert seq.block_table == table, "wrong hits, or free blocks not reused least recently freed first"
        assert seq.num_cached_tokens == cached_before == len(hits) * self.block_size < seq.num_tokens
        self.live.append(seq)
        if completes:
            self.ref.compute_prompt(table, len(hits), seq.token_ids)
            computed(self.bm, seq)
        else:  # a step that fails may have written any part of its blocks; the engine aborts them
            self._finish(seq)
            self.ref.forget_prompt(table, len(hits), seq.token_ids)
        return True

    @rule(which=st.integers(0, 2), prefix_len=st.integers(0, 16), tail=tokens_st, sampled=st.integers(0, 2))
    def arrive(self, which, prefix_len, tail, sampled):
        prompt = (self.prefixes[which % len(self.prefixes)][:prefix_len] + tail)[:self.max_len]
        if prompt:
            seq = Sequence(prompt, SamplingParams(), self.block_size)
            if self._admit(seq):
                seq.append_token(sampled)

    @rule(which=st.integers(0, 2), prefix_len=st.integers(0, 16), tail=tokens_st)
    def arrive_and_fail(self, which, prefix_len, tail):
        """A prefill step that raises (or is interrupted) after allocating: its blocks must not
        become cache hits, since their K/V may be missing or half written."""
        prompt = (self.prefixes[which % len(self.prefixes)][:prefix_len] + tail)[:self.max_len]
        if prompt:
            self._admit(Sequence(prompt, SamplingParams(), self.block_size), completes=False)

    @rule(index=st.integers(0, 99), sampled=st.integers(0, 2))
    def decode_step(self, index, sampled):
        if not self.live:
            return
        seq = self.live[index % len(self.live)]
        if seq.num_tokens > self.max_len:  # its newest token could never get a slot: finish it
            self._finish(seq)
            return
        if not self.bm.can_append(seq):
            assert len(seq.block_table) < seq.num_blocks and not self.ref.free
            self._preempt(seq)
            return
        table = self.ref.append_slot(seq.block_table, seq.token_ids)
        self.bm.may_append(seq)
        assert seq.block_table == table
        self.every_cache_entry_matches_its_blocks_contents()  # nothing cached before K/V is written
        self.ref.write(table[-1], seq.token_ids, seq.num_tokens)
        computed(self.bm, seq)
        seq.append_token(sampled)

    @rule(index=st.integers(0, 99))
    def finish(self, index):
        if self.live:
            self._finish(self.live[index % len(self.live)])

    @rule(index=st.integers(0, 99))
    def preempt(self, index):
        if self.live:
            self._preempt(self.live[index % len(self.live)])

    @rule(index=st.integers(0, 99), sampled=st.integers(0, 2))
    def readmit(self, index, sampled):
        """A preempted sequence is prefilled again: its prompt plus everything it generated."""
        if self.preempted:
            seq = self.preempted[index % len(self.preempted)]
            if self._admit(seq):
                self.preempted.remove(seq)
                seq.append_token(sampled)

    def _finish(self, seq: Sequence) -> None:
        self.ref.release(seq.block_table)
        self.bm.deallocate(seq)
        assert seq.block_table == [] and seq.num_cached_tokens == 0
        self.live.remove(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._finish(seq)
        self.preempted.append(seq)

    @invariant()
    def books_balance(self):
        if not hasattr(self, "bm"):
            return
        bm, ref = self.bm, self.ref
        num_blocks = len(bm.blocks)
        assert bm.num_free_blocks + bm.num_used_blocks == num_blocks
        assert bm.num_free_blocks == len(ref.free)
        holders = [0] * num_blocks
        for seq in self.live:
            for b in seq.block_table:
                holders[b] += 1
        assert [block.ref_count for block in bm.blocks] == holders == ref.ref
        assert bm.num_used_blocks == sum(1 for h in holders if h)

    @invariant()
    def every_cache_entry_matches_its_blocks_contents(self):
        if not hasattr(self, "bm"):
            return
        bm, ref, bs = self.bm, self.ref, self.block_size
        assert len(bm.hash_to_block_id) == len(ref.cache)
        for prefix, block_id in ref.cache.items():
            h = chain_hashes(list(prefix), bs)[-1]
            assert bm.hash_to_block_id.get(h) == block_id, "cache entry missing, stale, or on the wrong block"
            block = bm.blocks[block_id]
            assert block.hash == h and block.token_ids == list(prefix[-bs:])
            assert ref.written[block_id] == prefix

    @invariant()
    def every_live_sequence_reads_its_own_kv(self):
        if not hasattr(self, "bm"):
            return
        bs = self.block_size
        for seq in self.live:
            computed = seq.num_tokens - 1  # the newest token's K/V comes with the next step
            assert len(seq.block_table) == -(-computed // bs)
            for i, b in enumerate(seq.block_table):
                assert self.ref.written[b] == tuple(seq.token_ids[:min((i + 1) * bs, computed)])

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in list(self.live):
            self._finish(seq)
        assert self.bm.num_free_blocks == len(self.bm.blocks) and self.bm.num_used_blocks == 0
        assert all(block.ref_count == 0 for block in self.bm.blocks)


TestBlockManagerAgainstReference = BlockManagerAgainstReference.TestCase
TestBlockManagerAgainstReference.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


# -- a sliding window: random runs, every key a step reads checked ---------------------------------------


@settings(max_examples=60, deadline=None)
@given(window=st.integers(1, 7), block_size=st.sampled_from([1, 2, 3]), num_blocks=st.integers(4, 12),
       caching=st.booleans(), prompts=st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=14), min_size=1),
       ops=st.lists(st.tuples(st.sampled_from(["arrive", "step", "fork", "finish", "preempt"]), st.integers(0, 99),
                              st.integers(1, 5)), max_size=40))
def test_a_sliding_windows_steps_read_only_blocks_holding_their_keys(window, block_size, num_blocks, caching,
                                                                     prompts, ops):
    """Prefills in chunks, decodes, forks, finishes and preemptions (a preempted sequence comes back whole)
    on a manager that releases what the window leaves. ``kv`` is what each slot holds, written as a model
    runner would (a slot holds its token's whole prefix); before each step, every key its queries read
    (the window's, from the cache) must be in a held block holding that very key, and after it the books
    must balance: ref counts are the tables' references, the released entries a prefix of each table."""
    bm, bs = BlockManager(num_blocks, block_size, caching, sliding_window=window), block_size
    kv: dict[int, dict[int, tuple]] = {}
    live: list[Sequence] = []
    waiting = [Sequence(p, SamplingParams(), bs) for p in prompts]

    def run_step(seq: Sequence, n: int) -> None:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        for p in range(max(0, start - window + 1), start):  # keys read back from the cache
            block_id = seq.block_table[p // bs]
            assert block_id != NULL_BLOCK_ID and bm.blocks[block_id].ref_count > 0
            assert kv[block_id][p % bs] == tuple(seq.token_ids[:p + 1])
        for p in range(start, end):  # the step's own K/V, through the slot mapping
            assert seq.block_table[p // bs] != NULL_BLOCK_ID
            kv.setdefault(seq.block_table[p // bs], {})[p % bs] = tuple(seq.token_ids[:p + 1])
        seq.num_computed_tokens = end

    for op, index, n in ops:
        if op == "arrive" and waiting:
            seq = waiting[index % len(waiting)]
            n = min(n, seq.num_tokens - bm.num_hit_tokens(seq))
            if not bm.can_allocate(seq, n):
                continue
            waiting.remove(seq)
            bm.allocate(seq, n)
            live.append(seq)
            run_step(seq, n)
        elif op in ("step", "fork") and live:
            seq = live[index % len(live)]
            n = min(n, seq.num_tokens - seq.num_computed_tokens)
            if not bm.can_append(seq, num_new_tokens=n):
                continue
            if (copy := bm.may_append(seq, num_new_tokens=n)) is not None:
                kv[copy[1]] = dict(kv.get(copy[0], {}))
            run_step(seq, n)
        else:
            if op in ("finish", "preempt") and live:
                seq = live.pop(index % len(live))
                bm.deallocate(seq)
                if op == "preempt":
                    waiting.append(seq)
            continue
        if seq.num_computed_tokens == seq.num_tokens:  # sampled: forked children first, then a token each
            samples = [seq] + ([bm.fork(seq, 1)] if op == "fork" and seq.num_completion_tokens == 0 else [])
            live += samples[1:]
            for sample in samples:
                sample.append_token(index % 2)
                sample.num_computed_tokens = sample.num_tokens - 1
                bm.cache_full_blocks(sample)
        else:
            bm.cache_full_blocks(seq)
        holders = [0] * num_blocks
        for other in live:
            skipped = max(0, other.num_computed_tokens - window + 1) // bs
            assert other.block_table[:skipped] == [NULL_BLOCK_ID] * skipped
            for block_id in other.block_table[skipped:]:
                holders[block_id] += 1
        assert [block.ref_count for block in bm.blocks] == holders and holders[NULL_BLOCK_ID] == 0
        assert bm.num_free_blocks == holders.count(0) - 1 and NULL_BLOCK_ID not in bm.free_block_ids
