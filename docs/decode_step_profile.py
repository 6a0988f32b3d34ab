"""Where a decode step's time goes, kernel by kernel, in bf16 and int8 (docs/quantization.md).

Both engines run bench.py's default workload in one process, alternating, so that the machine's
slow and fast phases fall on both. A decode step replays a CPU graph, whose kernels cpu_graph.cpp
calls in one go; here each recorded kernel is replayed alone and timed (a microsecond or two of
Python around each, which the step's total includes). Kernels called eagerly (the LM head, and the
first step of each batch size) are timed too, under "eager". Prints the median over the rounds, in
milliseconds a decode step, and the range.

    python docs/decode_step_profile.py [rounds]
"""

import argparse
import collections
import ctypes
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import bench  # noqa: E402
from nanoengine import LLM, SamplingParams, cpu_graph, cpu_library  # noqa: E402
from nanoengine.model_runner import ModelRunner  # noqa: E402

times: dict[str, float] = collections.defaultdict(float)
decode_steps, in_decode = [0], [False]


def replay_one_by_one(run) -> None:
    size, base = ctypes.sizeof(cpu_graph._Step), ctypes.addressof(run.steps)
    for i, call in enumerate(run.calls):
        start = time.perf_counter()
        run.replay(ctypes.c_void_p(base + i * size), 1)
        times[call.function.__name__] += time.perf_counter() - start


def timed_kernel(call):
    def kernel(self, *args):
        start = time.perf_counter()
        result = call(self, *args)
        if in_decode[0]:
            times["eager " + self.function.__name__] += time.perf_counter() - start
        return result
    return kernel


def timed_step(run):
    def step(self, seqs, *args, **kwargs):
        in_decode[0] = all(seq.is_decode for seq in seqs)
        start = time.perf_counter()
        result = run(self, seqs, *args, **kwargs)
        if in_decode[0]:
            times["the step"] += time.perf_counter() - start
            decode_steps[0] += 1
        in_decode[0] = False
        return result
    return step


def main(rounds: int) -> None:
    cpu_graph._KernelRun.__call__ = replay_one_by_one
    cpu_library.Kernel.__call__ = timed_kernel(cpu_library.Kernel.__call__)
    ModelRunner.run = timed_step(ModelRunner.run)
    engines = {q or "bf16": LLM(None, quantization=q, skip_tokenizer_init=True) for q in (None, "int8")}
    workload = argparse.Namespace(num_seqs=64, min_input_len=32, max_input_len=256, min_output_len=32,
                                  max_output_len=128, seed=0, workload="random", preset=None)
    prompts, output_lens = bench.make_requests(workload, min(e.vocab_size for e in engines.values()))
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in output_lens]
    for engine in engines.values():  # the graphs' capture, out of the count
        engine.generate([prompts[0][:32]], SamplingParams(max_tokens=2), use_tqdm=False)
    per_round = {name: collections.defaultdict(list) for name in engines}
    for r in range(rounds):
        for name, engine in engines.items():
            times.clear()
            decode_steps[0] = 0
            # new prompts each round (no prefix-cache hits), within the vocabulary
            engine.generate([[(t + r + 1) % engine.vocab_size for t in p] for p in prompts], params, use_tqdm=False)
            for kernel, seconds in times.items():
                per_round[name][kernel].append(seconds / decode_steps[0] * 1e3)
    for name, kernels in per_round.items():
        print(f"{name}: ms a decode step, median of {rounds} rounds (range)")
        for kernel, ms in sorted(kernels.items(), key=lambda kv: -sorted(kv[1])[len(kv[1]) // 2]):
            ms = sorted(ms)
            print(f"  {kernel}: {ms[len(ms) // 2]:.2f} ({ms[0]:.2f}-{ms[-1]:.2f})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
