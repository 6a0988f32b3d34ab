"""Sliding-window blocks go back to the pool (BlockManager.remove_skipped_blocks).

First the block manager alone, with every count built by hand: which blocks a window releases, that
a released block keeps its hash for the prefix cache until the pool hands it out, and that forked
samples each drop their own reference. Then the engine on a tiny Mistral (every layer slides, a
window of 8 tokens = 2 blocks of 4): released blocks' K/V are poisoned with NaN the moment they
are released, and the logits and greedy tokens still match HF's, through chunked prefill, forks,
speculative drafts, the CPU graphs and the Triton kernels; a cache that cannot hold the sequences
whole runs them without a preemption, freeing exactly the blocks their windows left behind, and a
prompt longer than the whole cache runs in chunks. (Random runs of the block manager alone, every
key a step reads checked, are in test_block_manager.py.)
"""

import math
import os

import pytest
import torch

from nanoengine import LLM, SamplingParams
from nanoengine.block_manager import NULL_BLOCK_ID, BlockManager
from nanoengine.sequence import Sequence
from tests.conftest import OracleProposer, make_tiny_model
from tests.test_model_families import GREEDY, WINDOW, assert_generation_matches_hf, hf_model, random_prompts

BS = 2


def step_done(bm: BlockManager, seq: Sequence, num_computed_tokens: int) -> None:
    """A step has computed the sequence's first ``num_computed_tokens`` tokens (the scheduler's postprocess)."""
    seq.num_computed_tokens = num_computed_tokens
    bm.cache_full_blocks(seq)


def test_blocks_wholly_before_the_window_return_to_the_pool():
    """Window 3, blocks of 2: once tokens 0..5 are computed, token 6's query sees tokens 4..6, so
    blocks 0 and 1 (tokens 0..3) are released, block 2 (tokens 4, 5) is not."""
    bm = BlockManager(8, BS, sliding_window=3)
    assert NULL_BLOCK_ID not in bm.free_block_ids and bm.num_free_blocks == 7 and bm.num_used_blocks == 0
    seq = Sequence(list(range(7)), SamplingParams(), BS)
    bm.allocate(seq)
    held = list(seq.block_table)
    assert NULL_BLOCK_ID not in held and bm.num_used_blocks == 4
    step_done(bm, seq, 5)  # a chunk of 5: token 5's query sees 3..5, so only block 0 is behind it
    assert seq.block_table == [NULL_BLOCK_ID] + held[1:] and bm.num_window_freed_blocks == 1
    step_done(bm, seq, 6)
    assert seq.block_table == [NULL_BLOCK_ID] * 2 + held[2:] and bm.num_window_freed_blocks == 2
    assert bm.num_used_blocks == 2 and bm.num_free_blocks == 5
    bm.deallocate(seq)  # the released entries are not freed twice
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 7


def test_a_released_block_serves_prefix_hits_until_the_pool_reuses_it():
    bm = BlockManager(6, BS, sliding_window=2)
    first = Sequence([1, 2, 3, 4, 5], SamplingParams(), BS)
    bm.allocate(first)
    step_done(bm, first, 5)
    released = [b for b in bm.blocks if b.ref_count == 0 and b.hash != -1]
    assert first.block_table[:2] == [NULL_BLOCK_ID] * 2 and len(released) == 2
    again = Sequence([1, 2, 3, 4, 9], SamplingParams(), BS)
    assert bm.num_hit_tokens(again) == 4  # both released blocks revived from the pool
    # Hand out every free block: the released ones get new contents, so the chain from block 0 is
    # broken and nothing is served.
    filler = Sequence(list(range(100, 100 + bm.num_free_blocks * BS)), SamplingParams(), BS)
    bm.allocate(filler)
    assert {b.block_id for b in released} <= set(filler.block_table) and bm.num_hit_tokens(again) == 0


def test_a_prefix_hit_takes_back_only_the_blocks_the_first_steps_window_reads():
    """Eight cached tokens, window 3: the first step computes token 8, which sees 6..8, so of the four
    cached blocks only the last (tokens 6, 7) is taken back; a chunk's table ends with the chunk."""
    bm = BlockManager(12, BS, sliding_window=3)
    first = Sequence(list(range(9)), SamplingParams(), BS)
    bm.allocate(first)
    step_done(bm, first, 9)
    bm.deallocate(first)
    again = Sequence(list(range(9)) + [50, 51, 52, 53, 54], SamplingParams(), BS)
    assert bm.can_allocate(again, 2)
    bm.allocate(again, 2)  # tokens 8..9 of 14
    assert again.num_cached_tokens == 8 and len(again.block_table) == 5
    assert again.block_table[:3] == [NULL_BLOCK_ID] * 3 and NULL_BLOCK_ID not in again.block_table[3:]
    assert bm.num_used_blocks == 2
    step_done(bm, again, 10)  # token 10 sees 8..10: block 3 (tokens 6, 7) goes too
    assert bm.can_append(again, num_new_tokens=4) and bm.may_append(again, num_new_tokens=4) is None
    assert len(again.block_table) == 7 and again.block_table[3] == NULL_BLOCK_ID and bm.num_used_blocks == 3


def test_forked_samples_each_drop_their_own_reference():
    """n=2: the prompt's blocks are shared; one sample leaving them behind frees nothing, both do."""
    bm = BlockManager(8, BS, sliding_window=2)
    parent = Sequence([1, 2, 3], SamplingParams(n=2), BS)
    bm.allocate(parent)
    step_done(bm, parent, 2)  # a first chunk: token 2's query sees 1..2, block 0 stays
    child = bm.fork(parent, 1)
    for seq in (parent, child):
        seq.append_token(7)
    used = bm.num_used_blocks
    step_done(bm, parent, 3)  # token 3 sees 2..3: block 0 (tokens 0, 1) is behind it
    assert parent.block_table[0] == NULL_BLOCK_ID and child.block_table[0] != NULL_BLOCK_ID
    assert bm.num_used_blocks == used and bm.blocks[child.block_table[0]].ref_count == 1
    step_done(bm, child, 3)
    assert bm.num_used_blocks == used - 1 and bm.num_window_freed_blocks == 2


# -- the engine ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, tokenizer) -> str:
    return make_tiny_model(os.fspath(tmp_path_factory.mktemp("sliding") / "mistral"), "mistral", tokenizer)


def poison_released_blocks(llm: LLM) -> None:
    """From now on every block the window releases, and nobody else holds, has NaN for its K/V in every
    layer: a kernel that read one, or a slot mapping that wrote one, would show in the outputs."""
    bm, kv_cache = llm.block_manager, llm.model_runner.kv_cache
    release = bm.remove_skipped_blocks

    def release_and_poison(seq: Sequence) -> None:
        held = list(seq.block_table)
        release(seq)
        for before, after in zip(held, seq.block_table):
            if before != after and bm.blocks[before].ref_count == 0:
                kv_cache[:, :, before] = float("nan")

    bm.remove_skipped_blocks = release_and_poison


@pytest.mark.parametrize("kernels", [{}, {"learner_mode": True}], ids=["cpp", "learner_mode"])
@torch.inference_mode()
def test_teacher_forced_logits_match_hf_with_released_blocks_poisoned(mistral, kernels):
    llm = LLM(mistral, dtype="float32", device="cpu", kvcache_block_size=4, enable_prefix_caching=False, **kernels)
    poison_released_blocks(llm)
    runner, model, bm = llm.model_runner, llm.model_runner.model, llm.block_manager
    prompt_lens, steps = (5, 23), 12
    full = random_prompts(llm.vocab_size, tuple(n + steps for n in prompt_lens), seed=10)
    hf = hf_model(mistral)
    expected = [hf(torch.tensor([ids])).logits[0] for ids in full]
    seqs = [Sequence(ids[:n], SamplingParams(), 4) for ids, n in zip(full, prompt_lens)]
    for seq in seqs:
        bm.allocate(seq)
        seq.num_scheduled_tokens = seq.num_tokens
    model.compute_logits(model(*runner.prepare_prefill(seqs)))
    for step in range(steps):
        for seq, ids, n in zip(seqs, full, prompt_lens):
            step_done(bm, seq, seq.num_tokens)  # the window moves on: its oldest blocks are poisoned
            seq.append_token(ids[n + step])
            bm.may_append(seq)
        logits = model.compute_logits(model(*runner.prepare_decode(seqs)))
        for i, n in enumerate(prompt_lens):
            torch.testing.assert_close(logits[i], expected[i][n + step], atol=1e-4, rtol=0)
    for seq in seqs:  # by construction: the blocks before token num_computed - WINDOW + 1 are released
        released = (seq.num_computed_tokens - WINDOW + 1) // 4
        assert seq.block_table[:released] == [NULL_BLOCK_ID] * released
        assert NULL_BLOCK_ID not in seq.block_table[released:]
    assert not llm.model_runner.kv_cache[:, :, NULL_BLOCK_ID].any()  # the null block is never written


@torch.inference_mode()
def test_greedy_tokens_match_hf_with_released_blocks_poisoned(mistral):
    """Chunks of 6 across the window's edge, then decodes through the CPU graphs (which take the block
    table with its null entries); n=2 samples forked from each prompt, each releasing on its own."""
    llm = LLM(mistral, dtype="float32", device="cpu", kvcache_block_size=4, enable_prefix_caching=False,
              enable_chunked_prefill=True, max_num_batched_tokens=6, max_num_seqs=8)
    poison_released_blocks(llm)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, n=2)
    assert_generation_matches_hf(llm, mistral, random_prompts(llm.vocab_size, (3, 30), seed=11), params)
    assert llm.stats()["kvcache_blocks_freed_by_window"] > 0 and llm.stats()["kvcache_blocks_in_use"] == 0


@torch.inference_mode()
def test_triton_kernels_never_read_released_blocks(mistral):
    """The CUDA path's kernels (interpreted on CPU), chunked prefill and decode: they start at the window,
    so they read neither a released block nor the null block the released entries point at (poisoned too;
    the C++ kernels may read that one, masked, as they read a padded row's)."""
    triton = pytest.importorskip("triton")
    if not triton.knobs.runtime.interpret:
        pytest.skip("Triton compiles in this session (a GPU machine): the cuda tests run these kernels")
    llm = LLM(mistral, dtype="float32", attention_backend="triton", enforce_eager=True, kvcache_block_size=4,
              enable_prefix_caching=False, max_model_len=64, enable_chunked_prefill=True, max_num_batched_tokens=8)
    poison_released_blocks(llm)
    llm.model_runner.kv_cache[:, :, NULL_BLOCK_ID] = float("nan")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert_generation_matches_hf(llm, mistral, random_prompts(llm.vocab_size, (13,), seed=14), params)
    assert llm.stats()["kvcache_blocks_freed_by_window"] > 0


@torch.inference_mode()
def test_speculative_lookahead_with_released_blocks_matches_hf(mistral):
    """Drafts from an oracle (right but at every third position), verified in lookahead slots while
    the window releases the blocks behind; rejected drafts' slots are taken back."""
    llm = LLM(mistral, dtype="float32", device="cpu", kvcache_block_size=4, enable_prefix_caching=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompts = random_prompts(llm.vocab_size, (19,), seed=12)
    llm.proposer = None  # first the plain run, whose tokens the oracle drafts from
    reference = llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.proposer = OracleProposer(prompts, [out["token_ids"] for out in reference])
    poison_released_blocks(llm)
    freed = llm.stats()["kvcache_blocks_freed_by_window"]
    assert_generation_matches_hf(llm, mistral, prompts)
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["kvcache_blocks_freed_by_window"] > freed


@torch.inference_mode()
def test_a_cache_too_small_for_the_sequences_whole_runs_them_without_preemption(mistral):
    """Nine usable blocks of 4 (36 tokens) and three sequences of 25, 28 and 30 tokens at once: without
    releases they would need 22 blocks (a hybrid model is preempted here); with them each holds about
    a window's blocks, and by construction each releases (its length - WINDOW) // 4 blocks, the ones
    before its last query's window."""
    llm = LLM(mistral, dtype="float32", device="cpu", kvcache_block_size=4, num_kvcache_blocks=10, max_model_len=40)
    prompts = random_prompts(llm.vocab_size, (9, 12, 14), seed=3)
    assert_generation_matches_hf(llm, mistral, prompts)
    stats = llm.stats()
    lengths = [len(prompt) + GREEDY.max_tokens for prompt in prompts]
    assert sum(math.ceil(n / 4) for n in lengths) > 9 and stats["num_preemptions"] == 0
    assert stats["kvcache_blocks_freed_by_window"] == sum((n - WINDOW) // 4 for n in lengths)


@torch.inference_mode()
def test_a_prompt_longer_than_the_whole_cache_runs_in_chunks_holding_a_window(mistral):
    """36 usable tokens of cache, a prompt of 120 in chunks of 8: a step holds only the blocks of its
    chunk and of the 7 keys before it (for the chunk at 8k, blocks 2k - 2 .. 2k + 1: four), the
    blocks behind go back as it goes, and the tokens match HF's."""
    llm = LLM(mistral, dtype="float32", device="cpu", kvcache_block_size=4, num_kvcache_blocks=10, max_model_len=160,
              enable_chunked_prefill=True, max_num_batched_tokens=8)
    bm, run, held = llm.block_manager, llm.model_runner.run, []

    def run_and_count(seqs, *args):
        held.append(bm.num_used_blocks)
        return run(seqs, *args)

    llm.model_runner.run = run_and_count
    prompt = random_prompts(llm.vocab_size, (120,), seed=13)[0]
    assert_generation_matches_hf(llm, mistral, [prompt])
    assert max(held) == 4 and len(held) == 120 // 8 + GREEDY.max_tokens - 1
    assert llm.stats()["kvcache_blocks_freed_by_window"] == (120 + GREEDY.max_tokens - WINDOW) // 4


def test_a_cache_that_cannot_hold_a_window_and_a_step_is_a_value_error(mistral):
    with pytest.raises(ValueError, match="max_num_batched_tokens=8: a step of it and the sliding window of 8"):
        LLM(mistral, dtype="float32", device="cpu", kvcache_block_size=4, num_kvcache_blocks=4, max_model_len=160,
            enable_chunked_prefill=True, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="max_model_len=160 is larger than the whole KV cache"):  # whole prompts
        LLM(mistral, dtype="float32", device="cpu", kvcache_block_size=4, num_kvcache_blocks=10, max_model_len=160)
    with pytest.raises(ValueError, match="hf_overrides must be a dict of HF config fields"):
        LLM(mistral, hf_overrides=["sliding_window"])
