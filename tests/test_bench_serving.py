"""bench_serving.py: vLLM's latency definitions, and runs end to end against a tiny model's server."""

import argparse
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("aiohttp")

from bench import make_requests  # noqa: E402
from bench_serving import RequestResult, nanoengine_server, summarize  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOAD = dict(num_seqs=6, min_input_len=8, max_input_len=24, min_output_len=4, max_output_len=12, seed=0)
SERVER_ARGS = ["--dtype", "float32", "--device", "cpu"]  # a subprocess escapes conftest's pin to the CPU


def test_summary_follows_vllm_benchmark_definitions():
    a = RequestResult(prompt_len=10, output_len=5, ttft=0.1, latency=0.5, itl=[0.1, 0.1, 0.1, 0.1])
    b = RequestResult(prompt_len=20, output_len=2, ttft=0.3, latency=0.5, itl=[0.2])
    failed = RequestResult(prompt_len=7, output_len=3, error="HTTP 500: ...")
    s = summarize([a, b, failed], duration=2.0)
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (2, 1, 30, 7)
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 3.5
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["p90_ttft_ms"] == pytest.approx(280)
    # TPOT = (end to end - TTFT) / (output tokens - 1): 0.4 / 4 = 100 ms and 0.2 / 1 = 200 ms.
    assert s["mean_tpot_ms"] == pytest.approx(150) and s["p99_tpot_ms"] == pytest.approx(199)
    # ITL pools every gap of every request: four of 100 ms, one of 200 ms.
    assert s["mean_itl_ms"] == pytest.approx(120) and s["median_itl_ms"] == pytest.approx(100)
    assert s["p90_itl_ms"] == pytest.approx(160) and s["max_itl_ms"] == pytest.approx(200)


def run_bench(tiny_models, tmp_path, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "serving.json"
    workload = [f"--{k.replace('_', '-')}={v}" for k, v in WORKLOAD.items()]
    cmd = [sys.executable, "bench_serving.py", "--model", tiny_models["llama"], *workload, "--json", str(out), *extra]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return json.loads(out.read_text()), result.stdout


def check_results(results: dict, stdout: str, tokenizer) -> None:
    _, output_lens = make_requests(argparse.Namespace(**WORKLOAD), len(tokenizer))  # the tiny models' vocabulary
    assert results["completed"] == WORKLOAD["num_seqs"] and results["failed"] == 0
    assert results["total_output_tokens"] == sum(output_lens)  # ignore_eos: every request ran to max_tokens
    assert results["output_throughput"] == pytest.approx(sum(output_lens) / results["duration"])
    for name in ("ttft", "tpot", "itl"):
        assert 0 < results[f"median_{name}_ms"] <= results[f"p90_{name}_ms"] <= results[f"p99_{name}_ms"]
    for label in ("Request throughput:", "Output throughput:", "TTFT ms:", "TPOT ms:", "ITL ms:"):
        assert label in stdout


def test_bench_serving_starts_the_server_and_sends_everything_at_once(tiny_models, tokenizer, tmp_path):
    results, stdout = run_bench(tiny_models, tmp_path, "--request-rate", "inf", *SERVER_ARGS)
    check_results(results, stdout, tokenizer)
    assert results["request_rate"] == "inf" and results["base_url"] is None


def test_bench_serving_measures_a_running_server_at_a_poisson_rate(tiny_models, tokenizer, tmp_path):
    with nanoengine_server(["--model", tiny_models["llama"], *SERVER_ARGS]) as url:
        results, stdout = run_bench(tiny_models, tmp_path, "--base-url", url, "--request-rate", "20")
    check_results(results, stdout, tokenizer)
    assert results["base_url"] == url
