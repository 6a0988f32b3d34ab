"""bench.py runs end to end on a tiny model and reports in nano-vllm's format."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import make_copying_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(model: str, tmp_path, *options: str) -> tuple[str, dict]:
    """bench.py's output and its --json results; ``--device cpu``, since a subprocess escapes
    conftest's pin (and float32 is CPU-only)."""
    out_json = tmp_path / "bench.json"
    cmd = [sys.executable, "bench.py", "--model", model, "--device", "cpu", "--json", str(out_json), *options]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout, json.loads(out_json.read_text())


def test_bench_prints_nano_vllm_final_line_and_json(tiny_models, tmp_path):
    stdout, results = run_bench(tiny_models["llama"], tmp_path, "--num-seqs", "6", "--min-input-len", "8",
                                "--max-input-len", "24", "--min-output-len", "4", "--max-output-len", "12",
                                "--dtype", "float32", "--compare-hf", "--penalties", "--peak-bandwidth-gbs", "20",
                                "--peak-tflops", "0.5")
    last = stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"Total: (\d+)tok, Time: (\d+\.\d{2})s, Throughput: (\d+\.\d{2})tok/s", last)
    assert match, last
    assert int(match.group(1)) == results["total_tokens"] and results["dtype"] == "float32"
    assert results["hf_throughput_tok_per_s"] > 0 and results["hf_batch_size"] in (8, 32, 64)
    for label in ("Prefill:", "Decode:", "mean decode batch", "Preemptions:", "prefix-cache hit rate", "peak RSS",
                  "dtype:", "threads:"):
        assert label in stdout
    # The roofline against the given peaks (test_roofline.py checks its counts).
    assert results["peak_bandwidth_bytes_per_s"] == 20e9 and results["peak_flops_per_s"] == 0.5e12
    assert results["decode_bandwidth_fraction"] == results["decode_bytes_per_s"] / 20e9 > 0
    assert results["prefill_compute_fraction"] == results["prefill_flops_per_s"] / 0.5e12 > 0
    line = re.search(r"Roofline: decode ([\d.]+)GB/s, [\d.]+% of 20\.0GB/s \(given\), reading weights [\d.]+GB \+ "
                     r"K/V [\d.]+GB in [\d.]+s; prefill ([\d.]+)GFLOP/s, [\d.]+% of 500\.00GFLOP/s \(given\)", stdout)
    assert line and float(line.group(1)) == round(results["decode_bytes_per_s"] / 1e9, 2)


def test_bench_reports_a_single_requests_ttft_and_tpot(tiny_models, tmp_path):
    stdout, results = run_bench(tiny_models["llama"], tmp_path, "--num-seqs", "1", "--min-input-len", "20",
                                "--max-input-len", "20", "--min-output-len", "9", "--max-output-len", "9")
    assert results["ttft_ms"] > 0 and results["tpot_ms"] > 0
    # The warm-up's blocks are no request's prefix: a hit would skip part of the timed prefill.
    assert results["prefix_cache_hit_rate"] == 0
    line = re.search(r"Single request: TTFT: ([\d.]+)ms, TPOT: ([\d.]+)ms \(([\d.]+)tok/s\)", stdout)
    assert line and float(line.group(2)) == round(results["tpot_ms"], 2)


def test_bench_runs_one_token_outputs_which_never_decode(tiny_models, tmp_path):
    """A prefill-only run (output length 1) reports no decode rate and no TPOT, without dividing by zero."""
    stdout, results = run_bench(tiny_models["llama"], tmp_path, "--num-seqs", "1", "--min-input-len", "20",
                                "--max-input-len", "20", "--min-output-len", "1", "--max-output-len", "1")
    assert results["total_tokens"] == 1 and results["prefill_tok_per_s"] > 0
    assert results["decode_tok_per_s"] == 0 and results["tpot_ms"] is None
    assert "no TPOT (one output token)" in stdout


def test_bench_grounded_workload_with_speculation_reports_the_accepted_length(tokenizer, tmp_path):
    """--workload grounded (chat prompts asking to repeat passages) with n-gram drafts, on a model that
    repeats its last token: the lookup finds drafts on every CPU kind. The decode figures count
    sequences and kept tokens, not verified drafts: the mean decode batch is at most the 2 requests."""
    model = make_copying_model(str(tmp_path / "copying"), tokenizer)
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    stdout, results = run_bench(model, tmp_path, "--workload", "grounded", "--num-seqs", "2", "--min-output-len", "1",
                                "--max-output-len", "24", "--speculative-config", spec)
    assert results["total_tokens"] == 48 and results["spec_decode_num_accepted_tokens"] > 0
    assert results["mean_accepted_length"] == 1 + results["spec_decode_num_accepted_tokens"] / \
        results["spec_decode_num_drafts"]
    assert 1 <= results["mean_decode_batch"] <= 2
    assert re.search(r"Speculative decoding: \d+ of \d+ draft tokens accepted, mean accepted length [\d.]+", stdout)


def test_nano_vllm_preset_is_nano_vllms_bench_exactly():
    """nano-vllm's bench.py: ``seed(0)``, each prompt's length then its ids from ``randint(0, 10000)``,
    then every output length; max_model_len 4096, and its default budget of 16384 tokens a step."""
    import argparse
    import random
    sys.path.insert(0, ROOT)
    from bench import add_workload_options, make_requests, resolve_workload
    parser = argparse.ArgumentParser()
    add_workload_options(parser)
    args = parser.parse_args(["--preset", "nano-vllm"])
    resolve_workload(parser, args)
    assert (args.max_model_len, args.max_num_batched_tokens, args.num_seqs) == (4096, 16384, 256)
    random.seed(0)  # nano-vllm's own lines, with its module-level generator
    prompt_token_ids = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    max_tokens = [random.randint(100, 1024) for _ in range(256)]
    assert make_requests(args, vocab_size=151936) == (prompt_token_ids, max_tokens)


def test_bench_runs_dummy_weights_from_a_config_alone(tmp_path):
    """A real model's shapes (Qwen3-0.6B's config.json from tests/data, cut to 2 layers to stay fast),
    no weights and no tokenizer, as on an air-gapped GPU."""
    config = json.loads(open(os.path.join(ROOT, "tests", "data", "qwen3-0.6b", "config.json")).read())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    cmd = [sys.executable, "bench.py", "--model", str(tmp_path), "--load-format", "dummy", "--num-seqs", "3",
           "--min-input-len", "8", "--max-input-len", "16", "--min-output-len", "4", "--max-output-len", "8",
           "--dtype", "float32", "--device", "cpu", "--attention-backend", "torch"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"Throughput: \d+\.\d{2}tok/s$", result.stdout.strip())
    assert re.search(r"Roofline: decode .* \(copy loop\), .* \(float32 matmul\)", result.stdout)  # peaks measured


def test_bench_structured_output_reports_both_throughputs(tiny_models, tmp_path):
    options = ["--num-seqs", "3", "--min-output-len", "8", "--max-output-len", "24", "--structured-output", "json"]
    stdout, results = run_bench(tiny_models["llama"], tmp_path, *options, "--dtype", "float32")
    line = re.search(r"Structured output \(json\): ([\d.]+)tok/s, the same requests unconstrained: ([\d.]+)tok/s "
                     r"\(([\d.]+)x\); (\d+) of 3 closed their JSON, (\d+) of them parse", stdout)
    assert line and float(line.group(2)) == round(results["unconstrained_throughput_tok_per_s"], 2)
    assert results["num_json_parsed"] == results["num_json_closed"] == int(line.group(4))
    assert 3 <= results["total_tokens"] <= 3 * 24  # a request may close its JSON before its output length
    last = stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"Total: \d+tok, Time: \d+\.\d{2}s, Throughput: \d+\.\d{2}tok/s", last), last
    refused = subprocess.run([sys.executable, "bench.py", "--structured-output", "json", "--compare-hf"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "not with --compare-hf or --workload grounded" in refused.stderr


@pytest.mark.parametrize("command, message", [
    (["bench.py", "--num-seqs", "0"], "--num-seqs must be >= 1"),
    (["bench.py", "--num-seqs", "2", "--dtype", "float8"], "dtype must be"),  # the engine's ValueError
    (["bench_serving.py", "--workload", "grounded"], "only random's token-id prompts"),
    (["-m", "nanoengine.serve", "--port", "70000"], "invalid port value"),
    (["bench.py", "--json", "no/such/directory/out.json"], "its directory does not exist"),  # before the run
    (["bench.py", "--peak-tflops", "0"], "--peak-tflops must be > 0"),
    (["bench_serving.py", "--json", "no/such/directory/out.json"], "its directory does not exist"),
    (["example.py", "--fork"], "--fork is a --trace scene"),
    (["example.py", "--trace"], "takes no --model"),  # --model is added below
])
def test_a_bad_command_line_is_one_error_line_not_a_traceback(tiny_models, command, message):
    result = subprocess.run([sys.executable, *command, "--model", tiny_models["llama"]], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("command, message", [
    (["example.py", "--model", "no/such/model"], "model path 'no/such/model' does not exist"),
    (["bench_serving.py", "--base-url", "http://127.0.0.1:1", "--num-seqs", "2", "--model", "llama"],
     "could not benchmark"),
])
def test_a_failure_to_start_is_one_error_line_not_a_traceback(tiny_models, command, message):
    command = [tiny_models.get(arg, arg) for arg in command]
    result = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode in (1, 2) and message in result.stderr and "Traceback" not in result.stderr
