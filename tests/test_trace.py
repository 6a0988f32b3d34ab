"""The step trace (nanoengine/trace.py) prints what the engine really holds, and its scenes
(nanoengine/trace_scenes.py) show the cache, speculation, grammars and graphs at work."""

import ast
import json
import os
import re
import subprocess
import sys

import pytest

from nanoengine import LLM, SamplingParams
from nanoengine.trace import ranges
from nanoengine.trace_scenes import DEMO_OPTIONS, DEMO_REWRITE, DEMO_SCHEMA, SCENE_OPTIONS, demo
from tests.conftest import OracleProposer, make_copying_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW = re.compile(r"  #(\d+)\s+(\[[\d., ]*\])\s+(\[[\d, ]*\])\s+(\[[\d., ]*\])\s")
REFS = re.compile(r"in use \(id:refs\) ([\d: ]+?)\s{2,}")


def expand(text: str) -> list[int]:
    """The inverse of ``ranges``: ``[0..3, 7]`` -> ``[0, 1, 2, 3, 7]``."""
    values = []
    for part in filter(None, text.strip("[]").split(", ")):
        lo, _, hi = part.partition("..")
        values += range(int(lo), int(hi or lo) + 1)
    return values


def test_ranges_folds_runs_of_consecutive_slots():
    assert ranges([0, 1, 2, 3, 12, 13, 20]) == "[0..3, 12, 13, 20]"
    assert expand(ranges([5, 6, 7, 9, 40, 41, 42, 43])) == [5, 6, 7, 9, 40, 41, 42, 43]


def play(model: str, scene: str, max_tokens: int = 12):
    """Play ``scene``, recording at each step what the block manager holds as the step runs (block
    tables, slots by the one formula, ref counts, the copies to make); returns (llm, observer, printed
    steps, truth per step)."""
    llm = LLM(model, **SCENE_OPTIONS[scene])
    bm, run, truth = llm.block_manager, llm.model_runner.run, []

    def run_and_record(seqs, blocks_to_copy=()):
        bs = bm.block_size
        tables = {seq.seq_id: (seq.block_table[:], [seq.block_table[p // bs] * bs + p % bs for p in range(
            seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens)]) for seq in seqs}
        scheduled = {seq.seq_id: seq.num_scheduled_tokens for seq in seqs}
        truth.append((tables, {b.block_id: b.ref_count for b in bm.blocks if b.ref_count}, list(blocks_to_copy),
                      scheduled))
        return run(seqs, blocks_to_copy)

    llm.model_runner.run = run_and_record
    lines: list[str] = []
    observer = demo(llm, lines.append, max_tokens=max_tokens, scene=scene)
    return llm, observer, "\n".join(lines).split("\nstep "), truth


@pytest.mark.parametrize("scene", ["preemption", "chunked", "fork", "speculative", "structured", "graphs",
                                   "sliding"])
def test_trace_prints_the_block_tables_slots_and_ref_counts_the_block_manager_holds(tiny_models, scene):
    llm, observer, steps, truth = play(tiny_models["llama"], scene)
    assert len(steps) == len(truth) == len(observer.records)
    for text, (tables, refs, _, _) in zip(steps, truth):
        printed = {int(m[1]): (expand(m[3]), expand(m[4])) for m in ROW.finditer(text)}
        assert printed == tables
        (in_use,) = REFS.findall(text)
        assert dict(map(int, pair.split(":")) for pair in in_use.split()) == refs
    assert llm.stats()["kvcache_blocks_in_use"] == 0


def test_preemption_scene_preempts_the_newest_and_hits_the_prefix_cache(tiny_models):
    llm, observer, steps, _ = play(tiny_models["llama"], "preemption")
    text = "\nstep ".join(steps)
    first, second, third = re.findall(r"admitted  #(\d+)", text)[:3]  # ids count on across engines
    assert f"preempted #{third}" in text and "prefix hit, blocks [0, 1, 2]" in text
    stats = llm.stats()
    assert sum(r["preemptions"] for r in observer.records) == stats["num_preemptions"] >= 1
    assert sum(r["prefix_hit_tokens"] for r in observer.records) == stats["prefix_cache_hit_tokens"] > 0


BUDGET = re.compile(r"budget    (.*) = (\d+) of (\d+) tokens")


def test_chunked_scene_prints_each_steps_budget_as_the_scheduler_spent_it(tiny_models):
    """Every step's budget line adds up what each sequence computed; some step mixes decodes with a
    prompt chunk, and some prompt is computed over two steps."""
    _, _, steps, truth = play(tiny_models["llama"], "chunked")
    mixed = chunked = False
    for text, (_, _, _, scheduled) in zip(steps, truth):
        parts, used, budget = BUDGET.search(text).groups()
        spent = {int(m[1]): int(m[2] or 1) for m in re.finditer(r"#(\d+) (?:decodes 1|prompt \S+ \((\d+) of)", parts)}
        assert spent == scheduled and int(used) == sum(scheduled.values()) <= int(budget) == 24
        mixed |= "decodes 1" in parts and "prompt" in parts
        chunked |= bool(re.search(r"prompt (\d+)\.\.\d+ \(\d+ of its \d+\)", parts)) and "prompt 0.." not in parts
    assert mixed and chunked


def test_fork_scene_shows_shared_blocks_and_the_copy_on_write(tiny_models):
    """n=2: after the fork every prompt block has ref count 2; at the next step the first sample copies
    the shared, partly filled last block and the second keeps the original."""
    _, _, steps, truth = play(tiny_models["llama"], "fork")
    text = "\nstep ".join(steps)
    parent, child = map(int, re.search(r"forked    #(\d+) from #(\d+)", text).groups()[::-1])
    assert re.search(r"id:refs now (\d+:2 ?)+\)", text)
    (copies,) = [c for _, _, c, _ in truth if c]
    ((src, dst),) = copies
    assert f"copy      #{parent} writes into block {src}, which it shares: it gets a copy, block {dst}; " \
           f"#{child} keeps block {src} (ref count now 1)" in text
    tables = next(t for t, _, c, _ in truth if c)
    assert tables[parent][0][-1] == dst and tables[child][0][-1] == src


def test_speculative_scene_shows_the_drafts_accepted_and_the_rejected_ones_taken_back(tiny_models):
    """With drafts right two times in three: steps verify several positions, print what was accepted,
    which slots the rejected drafts used, and the blocks that held only them, freed by that step."""
    llm = LLM(tiny_models["llama"], **SCENE_OPTIONS["speculative"])
    prompt = llm.chat_prompt([{"role": "user", "content": DEMO_REWRITE}])
    reference = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    llm.proposer = OracleProposer([prompt], [reference["token_ids"]])
    lines: list[str] = []
    demo(llm, lines.append, max_tokens=40, scene="speculative")
    text = "\n".join(lines)
    assert re.search(r"step \d+\s+verify", text) and "drafts    #" in text
    assert re.search(r"verified  #\d+ proposed .* \(6 drafts\): accepted", text)
    freed = [int(b) for found in re.findall(r"blocks \[([\d, ]+)\], which held only them, are freed", text)
             for b in found.split(", ")]
    assert re.search(r"rejected  .*: their K/V in slots \[[\d., ]+\]", text) and freed
    assert llm.stats()["kvcache_blocks_in_use"] == 0


GOES_ON = re.compile(r"goes on   #(\d+) with (\d+) tokens: num_computed_tokens set back to (\d+) .*"
                     r"block table now (\[[\d, ]*\])")
FREED = re.compile(r"blocks (\[[\d, ]+\]), which held only them, are freed")


def test_speculative_scene_takes_rejected_drafts_back_from_a_sequence_that_goes_on(tokenizer, tmp_path):
    """A model that repeats its last token, and drafts wrong at every third position: every verify step
    refuses some drafts while the sequence goes on, and each time the lookahead crossed into a block
    that then held only refused drafts, ``free_lookahead_blocks`` freed it. The trace prints what the
    engine did: the blocks freed, ``num_computed_tokens`` set back, the table left, and later steps."""
    llm = LLM(make_copying_model(os.fspath(tmp_path / "copying"), tokenizer), **SCENE_OPTIONS["speculative"])
    prompt = llm.chat_prompt([{"role": "user", "content": DEMO_REWRITE}])
    llm.proposer = OracleProposer([prompt], [[prompt[-1]] * 40])
    takebacks, free_lookahead_blocks = [], llm.block_manager.free_lookahead_blocks

    def record(seq):
        before = list(seq.block_table)
        free_lookahead_blocks(seq)
        freed = [b for b in before if b not in seq.block_table]
        takebacks.append((seq.seq_id, seq.num_tokens, seq.num_computed_tokens, list(seq.block_table), freed,
                          list(llm.block_manager.free_block_ids)[:len(freed)]))

    llm.block_manager.free_lookahead_blocks = record
    lines: list[str] = []
    demo(llm, lines.append, max_tokens=40, scene="speculative")
    steps = "\n".join(lines).split("\nstep ")
    live = [i for i, text in enumerate(steps) if "goes on" in text and "rejected" in text]
    assert live and live[0] < len(steps) - 1  # refused drafts, then more steps of the same sequence
    shown = 0
    for text in steps:
        for seq_id, num_tokens, computed, table in GOES_ON.findall(text):
            (truth,) = [t for t in takebacks if t[:2] == (int(seq_id), int(num_tokens))]
            assert (truth[2], truth[3]) == (int(computed), json.loads(table)) and truth[2] == truth[1] - 1
            assert FREED.findall(text) == ([str(truth[4])] if truth[4] else [])
            assert truth[5] == truth[4]  # freed blocks go to the front of the free list, the first reused
            shown += bool(truth[4])
    assert shown == sum(bool(t[4]) for t in takebacks) > 0


GRAMMAR = re.compile(r"grammar   #\d+ allowed (\d+) of (\d+) tokens(?: \(forced\))?, "
                     r"took (.*) \((allowed|NOT allowed)\)")


def test_structured_scene_prints_the_grammars_allowed_tokens_and_the_token_taken(tiny_models, monkeypatch):
    """Each step's printed count is that of the mask the sampler applied, the token printed is the one
    sampled, inside the mask, and the finished output follows the schema."""
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    import nanoengine.sampling_metadata
    masks, sampled = [], []
    allowed_tokens = nanoengine.sampling_metadata.allowed_tokens

    def record_mask(matchers, vocab_size):
        by_grammar = allowed_tokens(matchers, vocab_size)
        masks.append(None if by_grammar is None else by_grammar[1].clone())
        return by_grammar

    monkeypatch.setattr(nanoengine.sampling_metadata, "allowed_tokens", record_mask)
    llm = LLM(tiny_models["llama"], **SCENE_OPTIONS["structured"])
    run = llm.model_runner.run

    def run_and_record(seqs, blocks_to_copy=()):
        output = run(seqs, blocks_to_copy)
        sampled.append(output.token_ids[0][0])
        return output

    llm.model_runner.run = run_and_record
    lines: list[str] = []
    demo(llm, lines.append, max_tokens=128, scene="structured")
    printed = [GRAMMAR.search(text) for text in "\n".join(lines).split("\nstep ")]
    assert len(printed) == len(masks) == len(sampled) and all(printed)
    for found, (mask,), token_id in zip(printed, masks, sampled):
        assert (int(found[1]), int(found[2])) == (int(mask.sum()), len(mask)) and mask[token_id]
        assert found[3] == repr(llm.tokenizer.decode([token_id])) and found[4] == "allowed"
    assert any(int(found[1]) == 1 for found in printed) and any(int(found[1]) > 1 for found in printed)
    (text,) = re.findall(r"finished  #\d+ \(stop\): (.*); its blocks", "\n".join(lines))
    jsonschema.validate(json.loads(ast.literal_eval(text)), DEMO_SCHEMA)


GRAPH = re.compile(r"graph     (?:batch (\d+) -> bucket (\d+).*: (recorded|replayed|ran eagerly)|none)"
                   r".*buckets (\[[\d, ]*\])")


def test_graphs_scene_records_each_buckets_graph_once_then_replays_it(tiny_models):
    """Against the runner's graphs before and after each step: a decode step's bucket is the smallest
    that holds its batch, it is recorded where the runner had no graph for it and replayed where it
    had; the batch goes 3, 2, 1, 2, 1, so buckets 4, 2 and 1 are each recorded once and replayed."""
    llm = LLM(tiny_models["llama"], **SCENE_OPTIONS["graphs"])
    runner, run, truth = llm.model_runner.graph_runner, llm.model_runner.run, []
    assert runner is not None and runner.records_cpu_graphs

    def run_and_record(seqs, blocks_to_copy=()):
        before = set(runner.graphs)
        output = run(seqs, blocks_to_copy)
        truth.append((len(seqs) if all(seq.is_decode for seq in seqs) else None, before, set(runner.graphs)))
        return output

    llm.model_runner.run = run_and_record
    lines: list[str] = []
    demo(llm, lines.append, max_tokens=24, scene="graphs")
    printed = [GRAPH.search(text).groups() for text in "\n".join(lines).split("\nstep ")]
    assert len(printed) == len(truth)
    for (batch, bucket, how, buckets), (n, before, after) in zip(printed, truth):
        assert json.loads(buckets) == sorted(b for b, q in after if q == 1)
        if n is None:
            assert batch is None and after == before  # prefill: eager, nothing recorded
            continue
        assert int(batch) == n and int(bucket) == min(b for b in runner.buckets if b >= n)
        assert how == ("replayed" if (int(bucket), 1) in before else "recorded")
        assert (how == "recorded") == (after != before)
    decodes = [(int(bucket), how) for _, bucket, how, _ in printed if bucket]
    assert [b for b, how in decodes if how == "recorded"] == [4, 2, 1]
    assert {b for b, how in decodes if how == "replayed"} == {4, 2, 1}
    assert [b for i, (b, _) in enumerate(decodes) if i == 0 or decodes[i - 1][0] != b] == [4, 2, 1, 2, 1]


def test_sliding_scene_shows_the_blocks_behind_the_window_released(tiny_models):
    """Every layer sees 16 tokens (the tiny Llama read as a Mistral): each block a step leaves wholly
    behind its window is printed as released, and its entry in the next step's table is the null block."""
    llm, _, steps, truth = play(tiny_models["llama"], "sliding")
    printed = [[int(b) for b in found.split(", ")] for text in steps
               for found in re.findall(r"released  #\d+: blocks \[([\d, ]+)\] hold only tokens before", text)]
    tables = [next(iter(t.values()))[0] for t, *_ in truth]  # the scene's one sequence, step by step
    went = [[a for a, b in zip(before, after) if a != b == 0] for before, after in zip(tables, tables[1:])]
    assert [blocks for blocks in went if blocks] == printed and sum(map(len, printed)) >= 2
    assert llm.stats()["kvcache_blocks_freed_by_window"] >= sum(map(len, printed))  # the last step's are not shown
    assert llm.stats()["kvcache_blocks_in_use"] == 0


def test_demo_readmits_a_preempted_sequence_with_its_own_blocks_from_the_prefix_cache(tiny_models):
    """Readmitted after a preemption, the third request finds its own full blocks in the prefix cache, not
    only the system prompt it shared when first admitted: recomputing costs little more than its last block."""
    llm = LLM(tiny_models["llama"], **DEMO_OPTIONS)
    lines: list[str] = []
    demo(llm, lines.append, max_tokens=12)
    third = re.findall(r"admitted  #(\d+)", "\n".join(lines))[2]
    admissions = [line for line in lines if f"admitted  #{third} " in line]
    first, *again = (int(re.search(r"(\d+) from the prefix cache", a)[1]) for a in admissions)
    assert again and max(again) > first


def test_bench_timeline_writes_a_png_of_the_run(tiny_models, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "timeline.png"
    cmd = [sys.executable, "bench.py", "--model", tiny_models["llama"], "--num-seqs", "6", "--min-input-len", "8",
           "--max-input-len", "24", "--min-output-len", "4", "--max-output-len", "12", "--dtype", "float32",
           "--device", "cpu", "--num-kvcache-blocks", "6", "--timeline", str(png)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
