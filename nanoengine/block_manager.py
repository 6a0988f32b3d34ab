"""The paged KV cache's bookkeeping: physical blocks, block tables and prefix caching.

The KV cache is ``num_blocks`` physical blocks of ``block_size`` token slots. Each sequence owns
a block table mapping its logical blocks to physical ones; token ``t`` of a sequence lives in
slot ``block_table[t // block_size] * block_size + t % block_size``.

Prefix caching: a *full* block is identified by a hash chained over every token up to and
including it (``hash(previous block's hash, this block's tokens)``), so equal hashes mean equal
prefixes and sequences that start alike share physical blocks. Blocks are reference counted.
A block whose count drops to zero returns to the free pool with its hash and contents intact: a
later prompt with the same prefix revives it, until the pool hands it out for new content
(least recently freed first), which is when its hash entry is dropped.

A block's states, one word each (the walkthrough's glossary): *free* (in the free pool, no
sequence holds it), *in use* (held: ``ref_count`` > 0), and, independently, *cached* (its hash is in
``hash_to_block_id``, so a prompt with its prefix can be served it; a free block stays cached until
it is reused). The one rule that keeps the cache honest when a step fails: a block is cached only
once a step that completes has written its K/V (``cache_full_blocks``, after every step), with one
exception. The full blocks of an admitted prompt's first step are cached at allocation, so that a
later sequence of the *same* step can already share them (within each layer every token's K/V is
stored before anyone attends); until the step completes they are *pending*. A pending block that
is freed first, because its step raised or was interrupted and the engine aborted the step's
sequences, loses its hash. So no later prompt can read K/V that were never
written, or written for some layers and not others.

Forked sequences (the ``n`` samples of one prompt) share every block of the prompt by reference
count, the partial last one included. Whoever appends a token to a block that someone else still
holds first gets a copy of it (copy on write: ``may_append`` returns the copy for the model
runner to make before the step). Copying one block costs a memory copy; recomputing the prompt's
partial tail instead would cost each child a prefill of up to ``block_size - 1`` tokens, and the
prompt would no longer be computed once.

Sliding windows (vLLM V1's sliding-window manager): when every layer slides, a query at position
p reads only the keys ``p - sliding_window + 1 .. p``, so once a step has computed a sequence's first
``num_computed_tokens`` tokens, the blocks wholly before ``num_computed_tokens - sliding_window + 1``
are never read again. After each completed step they go back (``remove_skipped_blocks``): the
sequence drops its reference, a block nobody else holds is free with its hash kept (a prefix hit
walks the chain from block 0, so a chain with a reused block ends there), and the entry points at
the *null block*, block 0, reserved: never handed out, never written, so ``t // block_size`` still
indexes the table and a kernel that looks at a hidden entry reads zeros it masks out. A prompt chunk
takes its blocks as it runs, and a prefix hit takes back only what the first step's window reads,
so a sequence holds about a window's blocks. A hybrid model (Gemma 2 and 3) keeps every block: its
full layers read every key through the one table (docs/walkthrough.md, section 12, has vLLM's
answer, a block table per group of layers).
"""

from array import array
from collections import OrderedDict

import xxhash

from nanoengine.sequence import Sequence

NULL_BLOCK_ID = 0  # with a sliding window: what a released block table entry points at


def compute_block_hash(token_ids: list[int], prefix_hash: int) -> int:
    """xxh64 over the previous block's hash and this block's token ids."""
    h = xxhash.xxh64()
    if prefix_hash != -1:
        h.update(prefix_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1  # -1: not cached
        self.token_ids: list[int] = []  # kept to confirm a hash hit against a collision


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # The window every layer slides with (None: some layer reads every key), and then the null
        # block's id, reserved; -1, which no table holds, otherwise.
        self.sliding_window = sliding_window
        self.null_block_id = NULL_BLOCK_ID if sliding_window is not None else -1
        self.num_window_freed_blocks = 0  # references dropped by remove_skipped_blocks, all told
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        # Free blocks in the order they were freed: the front is reused first, so the blocks
        # freed longest ago lose their cached contents first (LRU eviction).
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(
            i for i in range(num_blocks) if i != self.null_block_id)
        # Cached by ``allocate`` in this step, K/V not yet written: pending.
        self.pending_block_ids: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_block_ids) - (self.null_block_id != -1)

    # -- prefill ------------------------------------------------------------------------------

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Physical blocks holding the longest cached prefix of ``seq``.

        Only full blocks before the sequence's last token are eligible: the last token is always
        computed, because the model needs its hidden state to produce the next token's logits.
        """
        # Prompt logprobs need the logits of every prompt position: nothing is read back.
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return []
        hits, prefix_hash = [], -1
        for i in range((seq.num_tokens - 1) // self.block_size):
            token_ids = seq.block(i)
            prefix_hash = compute_block_hash(token_ids, prefix_hash)
            block_id = self.hash_to_block_id.get(prefix_hash)
            if block_id is None or self.blocks[block_id].token_ids != token_ids:
                break
            hits.append(block_id)
        return hits

    def num_hit_tokens(self, seq: Sequence) -> int:
        """How many of ``seq``'s tokens the prefix cache would serve if it were admitted now (once it is,
        ``seq.num_cached_tokens`` holds the hit it got)."""
        return len(self._cached_prefix(seq)) * self.block_size

    def can_allocate(self, seq: Sequence, num_new_tokens: int | None = None) -> bool:
        hits = self._cached_prefix(seq)
        skipped = self._num_skipped_blocks(len(hits) * self.block_size)
        revived = sum(1 for b in hits[skipped:] if self.blocks[b].ref_count == 0)  # free now, taken back
        num_blocks = self._num_allocated_blocks(seq, len(hits) * self.block_size, num_new_tokens)
        return num_blocks - len(hits) + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int | None = None) -> None:
        """Give a waiting sequence its block table for all its tokens: cached blocks first, fresh
        ones after. Its first step computes ``num_new_tokens`` past the cached ones (all of them
        if None; fewer when chunked prefill splits the prompt); the full blocks that step writes
        are cached right away, pending (see the module docstring). With a sliding window
        the cached blocks wholly before the first step's window are not taken back (their entries
        are the null block's), and the table ends with the first step's tokens.
        """
        assert not seq.block_table
        hits = self._cached_prefix(seq)
        skipped = self._num_skipped_blocks(len(hits) * self.block_size)
        for block_id in hits[skipped:]:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        seq.block_table = [self.null_block_id] * skipped + hits[skipped:]
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        first_step_end = seq.num_tokens if num_new_tokens is None else seq.num_cached_tokens + num_new_tokens
        prefix_hash = self.blocks[hits[-1]].hash if hits else -1
        for i in range(len(hits), self._num_allocated_blocks(seq, seq.num_cached_tokens, num_new_tokens)):
            block = self._take_free_block()
            seq.block_table.append(block.block_id)
            if self.enable_prefix_caching and (i + 1) * self.block_size <= first_step_end:
                prefix_hash = self._cache(block, seq.block(i), prefix_hash)
                self.pending_block_ids.add(block.block_id)

    def deallocate(self, seq: Sequence) -> None:
        # Tail blocks first, so a prompt's later blocks are evicted before its shared start.
        for block_id in reversed(seq.block_table):
            if block_id != self.null_block_id:  # else released already, by the window
                self._release(block_id)
        seq.block_table = []
        seq.num_cached_tokens = seq.num_computed_tokens = 0

    def fork(self, parent: Sequence, sample_index: int) -> Sequence:
        """A child of ``parent`` for sample ``sample_index``, sharing every block of its table."""
        child = parent.fork(sample_index)
        for block_id in child.block_table:
            if block_id != self.null_block_id:
                self.blocks[block_id].ref_count += 1
        return child

    # -- decode (and speculative lookahead) ---------------------------------------------------

    def _num_new_blocks(self, seq: Sequence, num_lookahead_slots: int, num_new_tokens: int | None) -> int:
        """Blocks the next step needs: for the slots of its tokens (through the newest, or
        ``num_new_tokens`` past the computed ones: a prompt chunk) and ``num_lookahead_slots`` after
        them (speculative drafts), plus a copy of the last block if the newest token lands in a
        block a forked sibling still holds."""
        end = seq.num_tokens if num_new_tokens is None else seq.num_computed_tokens + num_new_tokens
        needed = max(0, -(-(end + num_lookahead_slots) // self.block_size) - len(seq.block_table))
        writes_shared = len(seq.block_table) == seq.num_blocks and self.blocks[seq.block_table[-1]].ref_count > 1
        return needed + writes_shared

    def can_append(self, seq: Sequence, num_lookahead_slots: int = 0, num_new_tokens: int | None = None) -> bool:
        """Whether the slots for the sequence's next tokens (and the lookahead) can be found or made."""
        return self._num_new_blocks(seq, num_lookahead_slots, num_new_tokens) <= self.num_free_blocks

    def may_append(self, seq: Sequence, num_lookahead_slots: int = 0,
                   num_new_tokens: int | None = None) -> tuple[int, int] | None:
        """Before a step, give its tokens (the newest, or the ``num_new_tokens`` of a prompt chunk
        whose blocks a sliding window takes as it goes) and ``num_lookahead_slots`` drafts after
        them slots of their own: new blocks past a boundary; a copy of a shared last block, returned
        as ``(source, destination)`` to copy."""
        copy = None
        if len(seq.block_table) == seq.num_blocks and self.blocks[seq.block_table[-1]].ref_count > 1:
            shared, block = self.blocks[seq.block_table[-1]], self._take_free_block()
            shared.ref_count -= 1
            seq.block_table[-1] = block.block_id
            copy = shared.block_id, block.block_id
        end = seq.num_tokens if num_new_tokens is None else seq.num_computed_tokens + num_new_tokens
        while len(seq.block_table) * self.block_size < end + num_lookahead_slots:
            seq.block_table.append(self._take_free_block().block_id)
        return copy

    def free_lookahead_blocks(self, seq: Sequence) -> None:
        """After a speculative step: the blocks past the sequence's tokens held only rejected drafts.
        They were never cached, so nothing in them is worth keeping: they go to the front of
        the free pool, the first handed out again."""
        while len(seq.block_table) > seq.num_blocks:
            block = self.blocks[seq.block_table.pop()]
            assert block.ref_count == 1 and block.hash == -1
            block.ref_count = 0
            self.free_block_ids[block.block_id] = None
            self.free_block_ids.move_to_end(block.block_id, last=False)

    # -- after a step --------------------------------------------------------------------------

    def cache_full_blocks(self, seq: Sequence) -> None:
        """After a completed step: the K/V of the first ``seq.num_computed_tokens`` tokens are in
        the cache. Pending blocks are kept, and every full block the step wrote that is not
        cached yet (a decode's block, a later chunk's) is cached now; then, with a sliding
        window, the blocks it has left are released (cached first, so their hashes stay)."""
        if self.enable_prefix_caching:
            self._cache_computed_blocks(seq)
        if self.sliding_window is not None:
            self.remove_skipped_blocks(seq)

    def _cache_computed_blocks(self, seq: Sequence) -> None:
        if self.pending_block_ids:  # only after an admission step
            self.pending_block_ids.difference_update(seq.block_table)
        # Blocks are cached in order, so the uncached full ones are the last few (and every
        # released one was cached before it was released).
        first = last = seq.num_computed_tokens // self.block_size
        while first > 0 and seq.block_table[first - 1] != self.null_block_id \
                and self.blocks[seq.block_table[first - 1]].hash == -1:
            first -= 1
        for i in range(first, last):
            prev = self.blocks[seq.block_table[i - 1]].hash if i > 0 else -1
            self._cache(self.blocks[seq.block_table[i]], seq.block(i), prev)

    def remove_skipped_blocks(self, seq: Sequence) -> None:
        """Release the blocks no query of ``seq`` reads any more (vLLM's name): the next token to
        compute, at ``num_computed_tokens``, sees ``sliding_window - 1`` keys before it and later
        tokens none older, so every block wholly before the first of those keys is dropped and its
        entry points at the null block. Newest first, as ``deallocate`` frees."""
        for i in reversed(range(self._num_skipped_blocks(seq.num_computed_tokens))):
            if seq.block_table[i] == self.null_block_id:
                break  # released by an earlier step, and so is every entry before it
            self._release(seq.block_table[i])
            seq.block_table[i] = self.null_block_id
            self.num_window_freed_blocks += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``, for benchmarks that must start
        cold). Only while no block is in use: a running sequence's full blocks are cached too,
        and a later prompt may be sharing them. Returns whether it was done."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            self._uncache(block)
        return True

    # -- internals ----------------------------------------------------------------------------

    def _num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Blocks wholly before the window of the token at ``num_computed_tokens`` (none without one)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def _num_allocated_blocks(self, seq: Sequence, num_cached_tokens: int, num_new_tokens: int | None) -> int:
        """How long a table ``allocate`` makes: every token's blocks, or with a sliding window only
        the first step's (a prompt chunk takes its blocks as it runs, as the window gives back the
        old ones: all at once, a long prompt would need the cache of its whole length)."""
        if self.sliding_window is None or num_new_tokens is None:
            return seq.num_blocks
        return -(-(num_cached_tokens + num_new_tokens) // self.block_size)

    def _release(self, block_id: int) -> None:
        """Drop one reference to a block; at none it is free, its hash kept unless it is still pending."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block_id in self.pending_block_ids:  # its step never wrote it
                self.pending_block_ids.remove(block_id)
                self._uncache(block)
            self.free_block_ids[block_id] = None

    def _take_free_block(self) -> Block:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        self._uncache(block)  # its old contents are about to be overwritten
        block.ref_count = 1
        return block

    def _cache(self, block: Block, token_ids: list[int], prefix_hash: int) -> int:
        block.hash = compute_block_hash(token_ids, prefix_hash)
        block.token_ids = list(token_ids)
        self.hash_to_block_id[block.hash] = block.block_id
        return block.hash

    def _uncache(self, block: Block) -> None:
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]
        block.hash, block.token_ids = -1, []
