"""A step that raises or is interrupted, at any point, leaves the engine as good as a fresh one.

Faults are injected at each stage of a step (scheduling, input preparation, the forward at a
layer, halfway through a decode graph's replay, sampling, postprocessing), and Ctrl-C arrives at
random moments of a long ``generate``.
Afterwards no block may be in use and the same prompts must give a fresh engine's tokens: in
particular, no block whose K/V the failed step never wrote may be served from the prefix cache.
"""

import _thread
import random
import signal
import time

import pytest

from nanoengine import LLM, SamplingParams
from nanoengine.cpu_graph import CPUGraph
from nanoengine.sequence import Sequence

# Prompts that share a 13-token prefix (three blocks of 4), so a poisoned cache would be read.
PREFIX = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]
PROMPTS = [PREFIX + [30 + i, 40 + i, 50 + i] for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class Fault(Exception):
    pass


def make_llm(model: str, **kwargs) -> LLM:
    return LLM(model, device="cpu", dtype="float32", kvcache_block_size=4, num_kvcache_blocks=64, **kwargs)


@pytest.fixture(scope="module")
def expected(tiny_models) -> list[list[int]]:
    return [out["token_ids"] for out in make_llm(tiny_models["llama"]).generate(PROMPTS, GREEDY, use_tqdm=False)]


def raise_on_call(n: int, fn=None, before=None):
    """A stand-in for ``fn`` that raises on its n-th call (1-based), after ``before`` if given, and
    otherwise calls through."""
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            if before is not None:
                before(*args, **kwargs)
            raise Fault(f"injected on call {n}")
        return fn(*args, **kwargs) if fn is not None else None
    return wrapper


def inject(llm: LLM, where: str, n: int, monkeypatch) -> None:
    runner, bm = llm.model_runner, llm.block_manager
    if where == "schedule":  # mid-admission: the first prompt is allocated, the second raises
        monkeypatch.setattr(bm, "allocate", raise_on_call(n, bm.allocate))
    elif where == "prepare_prefill":
        monkeypatch.setattr(runner, "prepare_prefill", raise_on_call(n, runner.prepare_prefill))
    elif where == "prepare_decode":
        monkeypatch.setattr(runner, "prepare_decode", raise_on_call(n, runner.prepare_decode))
    elif where == "forward":  # layer 0 has stored its K/V; layer 1 and later have not
        layer = runner.model.model.layers[1]
        monkeypatch.setattr(layer, "forward", raise_on_call(n, layer.forward))
    elif where == "replay":  # a decode graph replay stops halfway: layer 0's K/V stored, layer 1's not
        def half_replay(graph):
            for call in graph.calls[:len(graph.calls) // 2]:
                call()
        monkeypatch.setattr(CPUGraph, "replay", raise_on_call(n, CPUGraph.replay, before=half_replay))
    elif where == "sampling":
        monkeypatch.setattr(runner, "sampler", raise_on_call(n, runner.sampler))
    elif where == "postprocess":  # some sequences of the step are postprocessed, the rest are not
        monkeypatch.setattr(bm, "cache_full_blocks", raise_on_call(n, bm.cache_full_blocks))


CHUNKED = dict(enable_chunked_prefill=True, max_num_batched_tokens=7)


@pytest.mark.parametrize("where,n,options", [
    ("schedule", 2, {}), ("prepare_prefill", 1, {}), ("prepare_decode", 3, {}), ("forward", 1, {}),
    ("forward", 4, {"enforce_eager": True}), ("replay", 1, {}), ("replay", 3, {}), ("sampling", 1, {}),
    ("sampling", 5, {}), ("postprocess", 3, {}), ("postprocess", 9, {}),
    # Chunked prefill: a step may fail after earlier chunks of its prompts were computed and cached;
    # those stay valid, the failed chunk's blocks must not be served.
    ("prepare_prefill", 2, CHUNKED), ("forward", 2, CHUNKED), ("forward", 3, CHUNKED), ("postprocess", 4, CHUNKED),
])
def test_engine_after_a_failed_step_matches_a_fresh_one(tiny_models, expected, where, n, options, monkeypatch):
    llm = make_llm(tiny_models["llama"], **options)
    inject(llm, where, n, monkeypatch)
    with pytest.raises(Fault):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.stats()["kvcache_blocks_in_use"] == 0 and not llm.has_unfinished_requests()
    monkeypatch.undo()
    assert [out["token_ids"] for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    assert llm.stats()["kvcache_blocks_in_use"] == 0


def test_failed_step_ends_only_its_own_sequences(tiny_models, expected, monkeypatch):
    """A prompt whose prefill raises is aborted; a sequence already decoding runs on unharmed."""
    llm = make_llm(tiny_models["llama"])
    running = llm.add_request(PROMPTS[0], GREEDY)
    assert [seq.seq_id for seq in llm.step()] == [running]  # its prefill
    llm.step()  # and one decode step
    late = llm.add_request(PROMPTS[1], GREEDY)
    monkeypatch.setattr(llm.model_runner, "prepare_prefill", raise_on_call(1))
    with pytest.raises(Fault):
        llm.step()  # the late prompt's prefill
    monkeypatch.undo()
    assert late not in llm.requests and running in llm.requests
    seq = llm.requests[running]
    while not seq.is_finished:
        llm.step()
    assert seq.completion_token_ids == expected[0]
    assert llm.step() == [] and llm.stats()["kvcache_blocks_in_use"] == 0


def test_step_with_nothing_to_do_returns_an_empty_list(tiny_models):
    assert make_llm(tiny_models["llama"]).step() == []


def test_ctrl_c_at_random_moments_of_generate_leaves_no_trace(tiny_models, expected):
    """Ctrl-C, simulated by an interval timer whose SIGALRM handler interrupts the main thread (the
    kernel delivers it to the main thread itself: no helper thread has to win the GIL in time)."""
    llm = make_llm(tiny_models["llama"])
    long_prompts = [PREFIX * 2 + [60 + i] for i in range(8)] + PROMPTS
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    llm.generate(long_prompts, params, use_tqdm=False)  # warm-up
    bound = float("inf")
    rng = random.Random(0)
    interrupted = tries = 0
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: _thread.interrupt_main())
    # A process started in the background by a shell without job control ignores SIGINT, and then
    # interrupt_main does nothing: give the test Python's own Ctrl-C handler.
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        while interrupted < 8 and tries < 60:  # an alarm after generate returns does not count
            tries += 1
            start = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-4, min(bound, 10.0)))
            try:
                llm.generate(long_prompts, params, use_tqdm=False)
                signal.setitimer(signal.ITIMER_REAL, 0)
                for _ in range(1000):  # an interrupt already on its way lands here, not after the try
                    pass
                bound = min(bound, time.perf_counter() - start)  # delays stay within one generate
            except KeyboardInterrupt:
                interrupted += 1
            assert llm.stats()["kvcache_blocks_in_use"] == 0 and not llm.has_unfinished_requests()
            assert [out["token_ids"] for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        signal.signal(signal.SIGINT, previous_int)
    assert interrupted == 8


def test_sequence_of_an_aborted_step_is_finished_as_abort(tiny_models, monkeypatch):
    llm = make_llm(tiny_models["llama"])
    seq_id = llm.add_request(PROMPTS[0], GREEDY)
    seq: Sequence = llm.requests[seq_id]
    monkeypatch.setattr(llm.model_runner, "sampler", raise_on_call(1))
    with pytest.raises(Fault):
        llm.step()
    assert seq.is_finished and seq.finish_reason == "abort" and seq.block_table == []
