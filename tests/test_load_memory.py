"""A quantized load never holds the full-precision model: each module's float weights get memory only
as they are read, and are quantized and dropped before the next module's are (loader.py's
``ParameterMemory``, linear.py's ``quantize_linear``), so loading a quantized model peaks at its
quantized weights plus about one module's float ones, below a bf16 load.

Each load runs in a process of its own. Its peak RSS (``VmHWM``) once ``LLM()`` has returned, less
its peak after importing torch and nanoengine, is what the load added at its peak ("growth"); the
bytes the loaded model holds (its parameters and buffers) are what it must keep. The model is a
Llama of a few hundred MB in bf16 (random weights), so that the bounds below, which allow what a
load costs beside its weights plus a few times its largest module, are far from what holding the
whole float model would add (its 464 MiB of float projections).
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=16,
              num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=2048)
MB = 1 << 20
# The largest module's float weight (the LM head, vocab x hidden in bf16): a load holds one such
# module in float while it is quantized, and the allocator may keep up to another's worth in holes
# that the smaller quantized weights do not fill.
LARGEST_MODULE_BYTES = max(CONFIG["vocab_size"], 2 * CONFIG["intermediate_size"]) * CONFIG["hidden_size"] * 2
# What a load costs beside its weights (the kernels' libraries, the allocator's own: 40-70 MB in bf16
# here), quantizing's temporaries (a block of rows in float32, a few MB) and the allocator's rounding.
SLACK = 160 * MB

MEASURE = r"""
import json, sys
import torch, nanoengine
from nanoengine.linear import Linear
def peak_rss():  # VmHWM: this process's own peak (ru_maxrss would start from the parent's, kept across exec)
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
before = peak_rss()
path, load_format, quantization = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = nanoengine.LLM(path, load_format=load_format, quantization=quantization, dtype="bfloat16", device="cpu",
                     num_kvcache_blocks=16, max_model_len=256, enforce_eager=True, skip_tokenizer_init=True)
growth = peak_rss() - before
model = llm.model_runner.model
storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in [*model.parameters(), *model.buffers()]}
gemm_copy = any(isinstance(m, Linear) and m.quantized and m.gemm_min_rows is not None for m in model.modules())
print(json.dumps({"growth": growth, "held": sum(storages.values()), "gemm_copy": gemm_copy}))
"""


def measure_load(path: str, load_format: str, quantization: str | None) -> dict:
    """The load's peak growth and the bytes its model holds, from a fresh process."""
    result = subprocess.run([sys.executable, "-c", MEASURE, path, load_format, json.dumps(quantization)],
                            capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def dummy_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("dummy_llama")
    LlamaConfig(**CONFIG).save_pretrained(path)
    return os.fspath(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """The same shape saved by transformers with random bf16 weights (a 589 MiB .safetensors file)."""
    path = tmp_path_factory.mktemp("llama_checkpoint")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.bfloat16).save_pretrained(path)
    return os.fspath(path)


@pytest.fixture(scope="module")
def bf16_loads(dummy_model, checkpoint) -> dict:
    return {"dummy": measure_load(dummy_model, "dummy", None), "auto": measure_load(checkpoint, "auto", None)}


def check_holds_no_float_model(quantized: dict, bf16: dict) -> None:
    bound = quantized["held"] + 2 * LARGEST_MODULE_BYTES + SLACK
    assert quantized["growth"] <= bound, (
        f"a quantized load grew {quantized['growth'] / MB:.0f} MB for {quantized['held'] / MB:.0f} MB of weights "
        f"(bound {bound / MB:.0f} MB; the bf16 load grew {bf16['growth'] / MB:.0f} MB)")
    # Where cpu_int8_gemm.py's int8 copy sits beside the kernel's (CPUs with AMX or VNNI), an int8 model holds
    # about what a bf16 one does, so it can be no smaller there; elsewhere it must be.
    if not quantized["gemm_copy"]:
        assert quantized["growth"] < bf16["growth"]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_dummy_load_never_holds_the_float_model(fmt, dummy_model, bf16_loads):
    check_holds_no_float_model(measure_load(dummy_model, "dummy", fmt), bf16_loads["dummy"])


def test_quantized_checkpoint_load_never_holds_the_float_model(checkpoint, bf16_loads):
    check_holds_no_float_model(measure_load(checkpoint, "auto", "int4"), bf16_loads["auto"])
