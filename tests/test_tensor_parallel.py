"""Tensor parallelism on CPU (gloo): two ranks must compute what one does, and fail cleanly.

Size 1 is the oracle here (it is itself held to HF's numbers by test_model_vs_hf.py). Each engine
at size 2 starts a worker process, which takes seconds on a busy machine, so engines are shared
per architecture and the number of start-ups is kept small.
"""

import dataclasses
import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from nanoengine import LLM, SamplingParams
from nanoengine.context import Context
from nanoengine.model import check_tensor_parallel_size, kv_head_shard
from nanoengine.parallel import COLLECTIVE_TIMEOUT, Shard, TensorParallelGroup
from nanoengine.sequence import Sequence
from nanoengine.spec_decode import SpeculativeConfig
from tests.conftest import TINY_ARCHS, OracleProposer, make_tiny_model

REPO = Path(__file__).resolve().parent.parent
# A small cache (12 blocks of 16 tokens) so that the generate test preempts.
OPTIONS = dict(dtype="float32", device="cpu", kvcache_block_size=16, num_kvcache_blocks=12, max_model_len=128)
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
PROMPT_LENS = (5, 23, 40)
NUM_DECODE_STEPS = 20


def shared_prefix_prompts(vocab_size: int) -> list[list[int]]:
    """Six prompts, three of them sharing a 40-token prefix (two full blocks: prefix-cache hits);
    with 40 new tokens each they need far more than 12 blocks at once, so decode preempts."""
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, vocab_size, (40,), generator=gen).tolist()
    tails = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in (4, 7, 2)]
    others = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in (30, 12, 45)]
    return [prefix + tail for tail in tails] + others


@pytest.fixture(scope="module", params=TINY_ARCHS)
def engines(request, tiny_models):
    """(size 1, size 2) engines on the same tiny model."""
    path = tiny_models[request.param]
    tp = LLM(path, tensor_parallel_size=2, **OPTIONS)
    yield LLM(path, **OPTIONS), tp
    tp.workers.shutdown()


@torch.inference_mode()
def teacher_forced_logits(llm: LLM, full: list[list[int]]) -> list[torch.Tensor]:
    """Logits of a mixed-length prefill, then of step-by-step decode fed the given tokens."""
    runner = llm.model_runner
    seqs = [Sequence(ids[:n], SamplingParams(), 16) for ids, n in zip(full, PROMPT_LENS)]
    for seq in seqs:
        llm.block_manager.allocate(seq)
        seq.num_scheduled_tokens = seq.num_tokens  # the whole prompt in one step
    input_ids, positions, ctx = runner.prepare_prefill(seqs)
    logits = runner.compute_logits(input_ids, positions, ctx)
    steps = [logits]
    for step in range(NUM_DECODE_STEPS):
        for seq, ids, n in zip(seqs, full, PROMPT_LENS):
            seq.append_token(ids[n + step])
            llm.block_manager.may_append(seq)
        steps.append(runner.compute_logits(*runner.prepare_decode(seqs)))
    for seq in seqs:
        llm.block_manager.deallocate(seq)
    return steps


def test_teacher_forced_logits_match_size_one(engines):
    """Prefill and 20 decode steps through the paged cache: the two ranks' logits, gathered, are
    size 1's within 1e-4 (float32; only the order of the partial sums differs)."""
    single, tp = engines
    gen = torch.Generator().manual_seed(0)
    full = [torch.randint(0, single.vocab_size, (n + NUM_DECODE_STEPS,), generator=gen).tolist() for n in PROMPT_LENS]
    for expected, got in zip(teacher_forced_logits(single, full), teacher_forced_logits(tp, full)):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_greedy_tokens_match_size_one_with_preemption_and_prefix_hits(engines):
    single, tp = engines
    prompts = shared_prefix_prompts(single.vocab_size)
    expected = [out["token_ids"] for out in single.generate(prompts, GREEDY, use_tqdm=False)]
    before = tp.stats()
    got = [out["token_ids"] for out in tp.generate(prompts, GREEDY, use_tqdm=False)]
    after = tp.stats()
    assert got == expected
    assert after["num_preemptions"] > before["num_preemptions"]
    assert after["prefix_cache_hit_tokens"] > before["prefix_cache_hit_tokens"]
    assert after["kvcache_blocks_in_use"] == 0


def test_speculative_verification_steps_match_size_one(engines):
    """Drafts (the oracle's: right two times in three) verified by both ranks in one step, and rejected
    positions taken back: the same greedy tokens as size 1 without drafts."""
    single, tp = engines
    prompts = shared_prefix_prompts(single.vocab_size)
    expected = [out["token_ids"] for out in single.generate(prompts, GREEDY, use_tqdm=False)]
    tp.config.speculative_config = SpeculativeConfig("ngram", 3)
    tp.proposer = OracleProposer(prompts, expected)
    try:
        got = [out["token_ids"] for out in tp.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        tp.config.speculative_config = tp.proposer = None
    assert got == expected
    assert tp.stats()["spec_decode_num_accepted_tokens"] > 0 and tp.stats()["kvcache_blocks_in_use"] == 0


def test_chunked_prefill_steps_match_size_one(engines):
    """Steps that mix decodes with prompt chunks, and chunk-only steps that sample nothing (no logit
    row to gather), travel to the workers like any other."""
    single, tp = engines
    prompts = shared_prefix_prompts(single.vocab_size)
    expected = [out["token_ids"] for out in single.generate(prompts, GREEDY, use_tqdm=False)]
    tp.scheduler.enable_chunked_prefill, tp.scheduler.max_num_batched_tokens = True, 19
    try:
        got = [out["token_ids"] for out in tp.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        tp.scheduler.enable_chunked_prefill, tp.scheduler.max_num_batched_tokens = False, single.scheduler.max_num_batched_tokens
    assert got == expected


def test_forked_samples_and_prompt_logprobs_match_size_one(engines):
    """n samples share their prompt's partial last block until each copies it (every rank copies
    its own KV cache's block); prompt logprobs read logit rows of every prompt position."""
    single, tp = engines
    prompts = shared_prefix_prompts(single.vocab_size)[3:5]  # 30 and 12 tokens: partial last blocks
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=2, prompt_logprobs=2)
    expected, got = (llm.generate(prompts, params, use_tqdm=False) for llm in (single, tp))
    for e, g in zip(expected, got):
        assert [o["token_ids"] for o in g["outputs"]] == [o["token_ids"] for o in e["outputs"]]
        assert g["prompt_logprobs"][0] is None and len(g["prompt_logprobs"]) == len(e["prompt_logprobs"])
        for e_pos, g_pos in zip(e["prompt_logprobs"][1:], g["prompt_logprobs"][1:]):
            assert e_pos.keys() == g_pos.keys()
            assert all(abs(e_pos[t] - g_pos[t]) < 1e-3 for t in e_pos)


def test_penalized_samples_match_size_one(engines):
    """Logit bias, penalties and min-p apply on rank 0, to the logits gathered from every rank."""
    single, tp = engines
    prompts = shared_prefix_prompts(single.vocab_size)[:3]
    bias = {t: 10.0 for t in prompts[0][:4]}  # the tiny model picks among these, so the penalties decide
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias=bias, repetition_penalty=1.3,
                            presence_penalty=0.5, frequency_penalty=0.5, min_p=0.1)
    expected, got = ([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)] for llm in (single, tp))
    assert got == expected


def test_fewer_kv_heads_than_ranks_are_replicated(tokenizer, tmp_path):
    """One kv head, two ranks: each rank keeps it (its KV cache holds one head) and the tokens are
    size 1's. Deleting the engine ends its worker."""
    path = make_tiny_model(str(tmp_path / "mqa"), "llama", tokenizer, num_key_value_heads=1)
    prompts = shared_prefix_prompts(len(tokenizer))[:3]
    expected = [out["token_ids"] for out in LLM(path, **OPTIONS).generate(prompts, GREEDY, use_tqdm=False)]
    tp = LLM(path, tensor_parallel_size=2, **OPTIONS)
    assert tp.model_runner.kv_cache.shape[-2] == 1
    assert [out["token_ids"] for out in tp.generate(prompts, GREEDY, use_tqdm=False)] == expected
    workers = tp.workers.processes
    del tp
    gc.collect()
    assert all(p.poll() is not None for p in workers)


def test_kv_head_shard_gives_each_rank_the_kv_head_its_queries_read():
    config = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, head_dim=4, hidden_size=32)
    ranks = lambda size: [SimpleNamespace(rank=r, size=size) for r in range(size)]  # noqa: E731
    assert [kv_head_shard(config, tp) for tp in ranks(4)] == [Shard(8, 0, 4), Shard(8, 0, 4), Shard(8, 4, 4),
                                                              Shard(8, 4, 4)]
    assert [kv_head_shard(config, tp) for tp in ranks(2)] == [Shard(8, 0, 4), Shard(8, 4, 4)]
    assert kv_head_shard(config, None) == Shard(8, 0, 8)
    assert [Shard.split(10, tp) for tp in ranks(4)] == [Shard(10, 0, 3), Shard(10, 3, 3), Shard(10, 6, 3),
                                                        Shard(10, 9, 3)]  # the last one padded


@pytest.mark.parametrize("heads, kv_heads, intermediate, size, match", [
    (4, 2, 128, 3, "attention heads"), (12, 6, 128, 4, "kv heads"), (12, 8, 128, 3, "kv heads"),
    (16, 3, 128, 8, "kv heads"),
    (4, 4, 130, 4, "intermediate_size"),
])
def test_model_that_does_not_split_evenly_is_refused(heads, kv_heads, intermediate, size, match):
    config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate)
    with pytest.raises(ValueError, match=match):
        check_tensor_parallel_size(config, size)


@pytest.mark.parametrize("kwargs, match", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"), ({"tensor_parallel_size": 1.5}, "tensor_parallel_size"),
    ({"tensor_parallel_size": 3}, "attention heads"),
    ({"tensor_parallel_size": 2, "device": "cuda"}, "GPU per rank"),
])
def test_bad_tensor_parallel_size_raises_before_any_process_starts(tiny_models, monkeypatch, kwargs, match):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with one GPU, for the last case
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a worker process was started"))
    with pytest.raises(ValueError, match=match):
        LLM(tiny_models["llama"], **kwargs)


def test_step_inputs_travel_to_other_ranks_whatever_the_context_holds():
    """The broadcast is generic over Context's fields: tensors (1-D, 2-D, empty), ints, bools, None."""
    store = dist.HashStore()
    groups = [None, None]

    def make(rank):
        groups[rank] = TensorParallelGroup(rank, 2, store, torch.device("cpu"))
    threads = [threading.Thread(target=make, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ctx = Context(is_prefill=True, slot_mapping=torch.arange(5),
                  cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32),
                  cu_seqlens_k=torch.zeros(0, dtype=torch.int32), max_seqlen_q=3, max_seqlen_k=7,
                  block_tables=torch.arange(6, dtype=torch.int32).view(2, 3))
    sent = dict(input_ids=torch.tensor([9, 8, 7, 6, 5]), positions=torch.arange(5),
                **{f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)})
    received = []
    receiver = threading.Thread(target=lambda: received.extend([groups[1].receive_step(), groups[1].receive_step()]))
    receiver.start()
    groups[0].send_step(**sent)
    groups[0].in_step = False  # no forward (and so no gather) follows here
    groups[0].send_shutdown()
    receiver.join(timeout=60)
    step, shutdown = received
    assert shutdown is None and step.keys() == sent.keys()
    for name, value in sent.items():
        if isinstance(value, torch.Tensor):
            assert step[name].dtype == value.dtype and torch.equal(step[name], value), name
        else:
            assert step[name] == value and type(step[name]) is type(value), name


def test_killed_worker_fails_generate_within_seconds(tiny_models):
    llm = LLM(tiny_models["llama"], tensor_parallel_size=2, **OPTIONS)
    worker = llm.workers.processes[0]
    execute_model, calls, killed_at = llm.model_runner.execute_model, [], []

    def kill_worker_at_fifth_step(*args):
        calls.append(None)
        if len(calls) == 5:
            worker.kill()
            worker.wait()
            killed_at.append(time.monotonic())
        return execute_model(*args)
    llm.model_runner.execute_model = kill_worker_at_fifth_step
    prompts = shared_prefix_prompts(llm.vocab_size)
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) was killed by SIGKILL"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    # Detected from the closed connection, not by waiting out the collectives' timeout.
    assert time.monotonic() - killed_at[0] < COLLECTIVE_TIMEOUT.total_seconds() / 10
    with pytest.raises(RuntimeError, match="out of step"):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert llm.stats()["kvcache_blocks_in_use"] == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_python(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600)


TWO_ENGINES = """
import json, sys
from nanoengine import LLM, SamplingParams
options = dict(tensor_parallel_size=2, dtype="float32", device="cpu", max_model_len=128)
a, b = LLM(sys.argv[1], **options), LLM(sys.argv[1], **options)
params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
tokens = [llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0]["token_ids"] for llm in (a, b, a)]
print(json.dumps({"pids": [p.pid for llm in (a, b) for p in llm.workers.processes], "tokens": tokens}))
"""  # and exits with both engines alive


def test_two_engines_in_one_process_and_no_worker_left_at_exit(tiny_models):
    result = run_python("-c", TWO_ENGINES, tiny_models["qwen2"])
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = LLM(tiny_models["qwen2"], dtype="float32", device="cpu").generate([[5, 6, 7, 8]], params,
                                                                                 use_tqdm=False)[0]["token_ids"]
    assert report["tokens"] == [expected] * 3
    assert len(set(report["pids"])) == 2
    assert not [pid for pid in report["pids"] if os.path.exists(f"/proc/{pid}")]


TORCHRUN = """
import json, sys
from nanoengine import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32", device="cpu", max_model_len=128)
params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
tokens = [out["token_ids"] for out in llm.generate([[5, 6, 7, 8], [9] * 20], params, use_tqdm=False)]
with open(sys.argv[2], "a") as f:  # only rank 0 gets here: rank 1 left LLM() when rank 0 shut down
    f.write(json.dumps(tokens) + "\\n")
"""


def test_torchrun_launch_gives_size_one_tokens(tiny_models, tmp_path):
    script, out = tmp_path / "run.py", tmp_path / "tokens.jsonl"
    script.write_text(TORCHRUN)
    result = run_python("-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", "--master-addr",
                        "127.0.0.1", "--master-port", str(free_port()), str(script), tiny_models["qwen3"], str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o["token_ids"] for o in LLM(tiny_models["qwen3"], dtype="float32", device="cpu").generate(
        [[5, 6, 7, 8], [9] * 20], params, use_tqdm=False)]
    assert [json.loads(line) for line in out.read_text().splitlines()] == [expected]
