"""The step trace (nanoengine/trace.py) prints what the engine really holds, and its demo shows the cache at work."""

import os
import re
import subprocess
import sys

import pytest

from nanoengine import LLM
from nanoengine.trace import DEMO_OPTIONS, demo, ranges

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


def test_trace_prints_the_block_tables_slots_and_ref_counts_the_block_manager_holds(tiny_models):
    llm = LLM(tiny_models["llama"], **DEMO_OPTIONS)
    bm, run, truth = llm.block_manager, llm.model_runner.run, []

    def run_and_record(seqs, blocks_to_copy=()):
        """What the block manager holds as the step runs, and the slots by the one formula."""
        bs = bm.block_size
        tables = {seq.seq_id: (seq.block_table[:], [seq.block_table[p // bs] * bs + p % bs for p in range(
            seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens)]) for seq in seqs}
        truth.append((tables, {b.block_id: b.ref_count for b in bm.blocks if b.ref_count}))
        return run(seqs, blocks_to_copy)

    llm.model_runner.run = run_and_record
    lines: list[str] = []
    observer = demo(llm, lines.append, max_tokens=12)
    steps = "\n".join(lines).split("\nstep ")
    assert len(steps) == len(truth) == len(observer.records)
    for text, (tables, refs) in zip(steps, truth):
        printed = {int(m[1]): (expand(m[3]), expand(m[4])) for m in ROW.finditer(text)}
        assert printed == tables
        (in_use,) = REFS.findall(text)
        assert dict(map(int, pair.split(":")) for pair in in_use.split()) == refs
    text = "\n".join(lines)
    first, second, third = re.findall(r"admitted  #(\d+)", text)[:3]  # ids count on across engines
    assert f"preempted #{third}" in text and "prefix hit, blocks [0, 1, 2]" in text
    stats = llm.stats()
    assert sum(r["preemptions"] for r in observer.records) == stats["num_preemptions"] >= 1
    assert sum(r["prefix_hit_tokens"] for r in observer.records) == stats["prefix_cache_hit_tokens"] > 0
    assert stats["kvcache_blocks_in_use"] == 0


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
