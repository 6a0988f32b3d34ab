"""The Triton attention backend: its kernels against the float64 oracle, and the engine on them.

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, which conftest.py sets on a
machine without a GPU, before triton is imported), on the cases
of test_attention.py and more: GQA ratios 1, 3 and 8, blocks of 16 and 256, a cached prefix, one
query per sequence (a mixed chunked step's decodes), padded decode rows, a context long enough
to split, float32 and bfloat16. On a GPU (marked ``cuda``) they run compiled, and decode through
CUDA graphs.
"""

import os
import subprocess
import sys

import pytest
import torch

from nanoengine import LLM, SamplingParams
from nanoengine.triton_attention import (decode_num_splits, flash_attn_varlen_func_triton,
                                         flash_attn_with_kvcache_triton)
from tests.test_attention import (DECODE_LENGTHS, MIXED, ONE_QUERY_EACH, WINDOWS_AND_CAPS, WITH_PREFIX, decode_case,
                                  varlen_case)

GQA_RATIOS = [(4, 4), (6, 2), (8, 1)]  # (query heads, kv heads): groups of 1, 3 and 8
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


@pytest.fixture
def interpreted(monkeypatch):
    """Triton's interpreter, where the session runs it (a machine with a GPU runs the kernels compiled,
    in the tests marked ``cuda``). Its ``tl.dot`` multiplies bfloat16 values as the raw uint16 it
    stores them in (Triton 3.x), so bf16 operands are widened to float32 first, exactly; compiled,
    the same kernel multiplies bf16 on the tensor cores."""
    triton = pytest.importorskip("triton")
    if not triton.knobs.runtime.interpret:
        pytest.skip("Triton compiles in this session (a GPU machine): the cuda tests run these kernels")
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter
    create_dot = interpreter.InterpreterBuilder.create_dot

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        return interpreter.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot",
                        lambda self, a, b, *rest: create_dot(self, widen(a), widen(b), *rest))


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("heads", GQA_RATIOS)
@pytest.mark.parametrize("lengths, block_size", [(MIXED, None), (WITH_PREFIX, 16), (WITH_PREFIX, 256),
                                                 (ONE_QUERY_EACH, 16)])
def test_triton_prefill_matches_dense_causal_attention(interpreted, lengths, block_size, heads, dtype, tol):
    args, kwargs, expected = varlen_case(lengths, heads, block_size, dtype=dtype)
    out = flash_attn_varlen_func_triton(*args, **kwargs)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("heads", GQA_RATIOS)
@pytest.mark.parametrize("block_size", [16, 256])
def test_triton_decode_matches_dense_and_zeroes_padded_rows(interpreted, block_size, heads, dtype, tol):
    args, kwargs, expected = decode_case(DECODE_LENGTHS, heads, block_size, dtype=dtype, extra_columns=2)
    out = flash_attn_with_kvcache_triton(*args, **kwargs)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    assert torch.equal(out[3], torch.zeros_like(out[3]))  # context length 0: a padded graph row


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("heads", [(6, 2), (8, 1)])  # with 4 kv heads, 2 sequences fill the interpreter's 4 "cores"
def test_triton_decode_splits_a_long_context_and_merges_it_exactly(interpreted, heads, dtype, tol):
    """A sequence of 1,000 tokens is cut into stretches, a program each, merged by log-sum-exp; the
    second row (3 tokens) leaves every stretch but the first empty."""
    args, kwargs, expected = decode_case([1000, 3], heads, 16, dtype=dtype)
    assert decode_num_splits(2, heads[1], kwargs["block_table"].shape[1] * 16, torch.device("cpu")) > 1
    out = flash_attn_with_kvcache_triton(*args, **kwargs)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256, 24])
def test_triton_kernels_at_model_head_sizes(interpreted, head_dim, dtype, tol):
    """SmolLM2's 9 query heads over 3, at the head sizes of real models (and one not a power of two)."""
    prefill = [(0, 40), (0, 1), (100, 20), (16, 3)]
    args, kwargs, expected = varlen_case(prefill, (9, 3), 16, dtype=dtype, head_dim=head_dim)
    torch.testing.assert_close(flash_attn_varlen_func_triton(*args, **kwargs).double(), expected, atol=tol, rtol=tol)
    args, kwargs, expected = decode_case([1, 16, 0, 300, 77], (9, 3), 16, dtype=dtype, head_dim=head_dim)
    torch.testing.assert_close(flash_attn_with_kvcache_triton(*args, **kwargs).double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("window, softcap", WINDOWS_AND_CAPS)
def test_triton_kernels_with_sliding_window_and_softcap_match_dense(interpreted, window, softcap, dtype, tol):
    """Mistral's window and Gemma 2's soft cap: packed and paged prefill, decode, and a decode long
    enough to split (its stretches left of the window are empty, and merge as such)."""
    options = dict(dtype=dtype, window=window, softcap=softcap)
    for lengths, block_size in ((MIXED, None), (WITH_PREFIX, 16)):
        args, kwargs, expected = varlen_case(lengths, (6, 2), block_size, **options)
        torch.testing.assert_close(flash_attn_varlen_func_triton(*args, **kwargs).double(), expected, atol=tol,
                                   rtol=tol)
    for lengths in (DECODE_LENGTHS, [1000, 3]):
        args, kwargs, expected = decode_case(lengths, (6, 2), 16, **options)
        torch.testing.assert_close(flash_attn_with_kvcache_triton(*args, **kwargs).double(), expected, atol=tol,
                                   rtol=tol)


def test_decode_splits_follow_shapes_only():
    """A captured graph fixes the grid: the split count depends on the batch, the kv heads and the
    block table's width, never on the lengths. Longer tables split more, up to two programs a core."""
    cpu = torch.device("cpu")
    assert decode_num_splits(1, 1, 64, cpu) == 1  # too short to split
    assert decode_num_splits(1, 1, 4096, cpu) == 8  # 2 programs for each of the interpreter's 4 "cores"
    assert decode_num_splits(64, 8, 4096, cpu) == 1  # the batch fills the machine already


PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 3 + "Then", "Hello, my name is", "1 2 3 4 5 6 7 8 9 10"]


@pytest.mark.parametrize("options", [{}, dict(enable_chunked_prefill=True, max_num_batched_tokens=16)],
                         ids=["prefill_first", "chunked"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_on_triton_attention_gives_the_default_paths_greedy_tokens(interpreted, tiny_models, arch, options):
    """The whole engine on the interpreted Triton backend: prompts sharing a prefix (the second
    request of the same prompt reads its blocks from the prefix cache), and with chunked prefill,
    steps that mix decodes with prompt chunks."""
    prompts = PROMPTS + PROMPTS[:1]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    common = dict(dtype="float32", enforce_eager=True, max_model_len=128, **options)
    expected = LLM(tiny_models[arch], **common).generate(prompts, params, use_tqdm=False)
    triton = LLM(tiny_models[arch], attention_backend="triton", **common)
    assert triton.model_runner.block_size == 16
    got = triton.generate(prompts, params, use_tqdm=False)
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in expected]
    assert triton.stats()["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("options, message", [
    (dict(attention_backend="triton"), "only under Triton's interpreter"),
    (dict(attention_backend="flash-attn"), "needs a CUDA device"),
    (dict(attention_backend="xformers"), "attention_backend must be one of"),
    (dict(attention_backend="triton", learner_mode=True), "learner_mode=True runs the pure-torch attention"),
])
def test_a_backend_that_cannot_run_here_is_a_value_error(tiny_models, monkeypatch, options, message):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=message):
        LLM(tiny_models["llama"], device="cpu", **options)


def test_torch_backend_on_cpu_gives_the_default_paths_greedy_tokens(tiny_models):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = LLM(tiny_models["llama"], dtype="float32").generate(PROMPTS, params, use_tqdm=False)
    got = LLM(tiny_models["llama"], dtype="float32", attention_backend="torch").generate(PROMPTS, params, use_tqdm=False)
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in expected]


def test_triton_kernels_compile_for_a100_and_h100_within_their_shared_memory():
    """Triton lowers to PTX and assembles it on the CPU: the compiled form of every kernel and tile
    configuration the wrappers launch, checked without a GPU (tests/compile_triton_kernels.py)."""
    pytest.importorskip("triton")
    from triton.backends import backends
    if "nvidia" not in backends:
        pytest.skip("this Triton has no CUDA backend")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    result = subprocess.run([sys.executable, "tests/compile_triton_kernels.py"], cwd=root, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("sm_90 bf16 attention") == 10 and "sm_80 fp32 store_kvcache fp8=2: ok" in result.stdout


# -- compiled, on a GPU ------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("heads", GQA_RATIOS)
def test_cuda_triton_kernels_match_the_oracle_at_4k_tokens(heads):
    args, kwargs, expected = varlen_case([(0, 300), (4000, 96), (4095, 1)], heads, 16, device="cuda",
                                         dtype=torch.bfloat16, head_dim=128)
    torch.testing.assert_close(flash_attn_varlen_func_triton(*args, **kwargs).double(), expected, atol=2e-2, rtol=2e-2)
    args, kwargs, expected = decode_case([4096, 0, 17], heads, 16, device="cuda", dtype=torch.bfloat16, head_dim=128)
    torch.testing.assert_close(flash_attn_with_kvcache_triton(*args, **kwargs).double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_triton_decode_through_graphs_matches_eager(tiny_models, arch):
    """Greedy tokens through CUDA graphs are eager's, up to a bf16 near-tie.

    Not bit for bit: a graph's batch is padded to its bucket and its block table is the widest, and
    the decode kernel splits the keys by both (``decode_num_splits``), so the softmax sums in another
    order. On an H100 the chosen tokens' logprobs differed by up to 0.05; a random tiny model's
    near-flat logits then tie now and then (one run chose another 24th token). So each sequence must
    match eager's token for token until it ends or parts at a step where eager ranked both tokens
    within ``NEAR_TIE``, and the logprobs before that must agree as closely.
    """
    NEAR_TIE = 0.15  # nats
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    common = dict(dtype="bfloat16", device="cuda", attention_backend="triton", num_kvcache_blocks=64)
    graphs = LLM(tiny_models[arch], **common)
    assert graphs.model_runner.graph_runner.graphs, "decode should replay CUDA graphs"
    got = graphs.generate(PROMPTS, params, use_tqdm=False)
    expected = LLM(tiny_models[arch], enforce_eager=True, **common).generate(PROMPTS, params, use_tqdm=False)
    for g, e in zip(got, expected):
        steps = zip(g["token_ids"], e["token_ids"], g["outputs"][0]["logprobs"], e["outputs"][0]["logprobs"])
        for step, (g_token, e_token, g_logprobs, e_logprobs) in enumerate(steps):
            if g_token != e_token:  # a near-tie in eager's own ranking; after it the sequences differ
                assert e_logprobs[e_token] - e_logprobs.get(g_token, -float("inf")) <= NEAR_TIE, step
                break
            assert abs(g_logprobs[g_token] - e_logprobs[e_token]) <= NEAR_TIE, step
