"""The 8-bit KV cache (``kv_cache_dtype="fp8"``, ``"fp8_e5m2"``): what every store kernel writes,
what every attention kernel reads, and the engine on it.

Built by construction: the attention cases cache keys and values that are fp8 values times a
power-of-two scale, so that dequantizing them is exact, and the oracle is dense attention over
those values (test_attention.py's). The store cases hold values chosen to exercise the rounding:
subnormals, exact midpoints between two fp8 values (ties go to the even code), values past the
largest finite one (clamped). The Triton kernels run under Triton's interpreter, as in
test_triton_attention.py.
"""

import pytest
import torch

from nanoengine import LLM, SamplingParams, cpu_kernels, cpu_library
from nanoengine.kv_cache_dtype import dequantize, quantize
from nanoengine.store_kvcache import store_kvcache_torch
from nanoengine.triton_store_kvcache import store_kvcache_triton
from nanoengine.torch_attention import (flash_attn_varlen_func_torch, flash_attn_with_kvcache_plain,
                                        flash_attn_with_kvcache_torch)
from nanoengine.triton_attention import flash_attn_varlen_func_triton, flash_attn_with_kvcache_triton
from tests.test_attention import cu_seqlens, dense_causal_attention, paged_cache
from tests.test_triton_attention import interpreted  # noqa: F401 (a fixture)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
K_SCALE, V_SCALE = 0.5, 4.0  # powers of two: dequantizing is exact, whichever side a kernel scales on
HEADS, D = (4, 2), 16


def mantissa_bits(dtype: torch.dtype) -> int:
    return {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[dtype]


def fp8_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of the format, ascending (each zero once)."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    return values[torch.isfinite(values)].unique()


def test_quantize_rounds_to_the_nearest_fp8_value_ties_to_even_and_clamps():
    for dtype in FP8:
        values = fp8_values(dtype)
        low, high = values[:-1], values[1:]
        low_is_even = quantize(low, 1.0, dtype).view(torch.uint8) % 2 == 0
        assert torch.equal(quantize(values, 1.0, dtype).float(), values)  # every value is its own code
        assert torch.equal(quantize((low + high) / 2, 1.0, dtype).float(), torch.where(low_is_even, low, high))
        largest = torch.finfo(dtype).max
        assert quantize(torch.tensor([3 * largest, -3 * largest]), 1.0, dtype).float().tolist() == [largest, -largest]
        assert dequantize(quantize(torch.tensor([2.0]), K_SCALE, dtype), K_SCALE, torch.float32).item() == 2.0


def store_case(dtype: torch.dtype, source: torch.dtype, num_kv_heads: int = 2, head_dim: int = 16):
    """Keys and values that exercise the rounding (random values over 12 binades, midpoints between
    fp8 values, values past the largest), times the scales; a slot mapping with padding rows."""
    gen = torch.Generator().manual_seed(0)
    values = fp8_values(dtype)
    midpoints = (values[:-1] + values[1:]) / 2
    spread = torch.randn(512, generator=gen) * 2.0 ** torch.randint(-10, 2, (512,), generator=gen)
    pool = torch.cat([midpoints, spread, torch.tensor([1e6, -1e6])])
    row = num_kv_heads * head_dim
    pool = torch.cat([pool, pool[:-len(pool) % row or None][:(-len(pool)) % row]]).view(-1, num_kv_heads, head_dim)
    key, value = (pool * K_SCALE).to(source), (pool.flip(0) * V_SCALE).to(source)
    num_tokens = len(pool)
    slots = torch.randperm(num_tokens + 8, generator=gen)[:num_tokens]
    slots[::7] = -1
    cache = torch.zeros(num_tokens + 8, 1, num_kv_heads, head_dim, dtype=dtype)
    return key, value, cache, cache.clone(), slots


@pytest.fixture(params=["torch", "cpu_kernel", "triton"])
def store(request):
    if request.param == "torch":
        return store_kvcache_torch
    if request.param == "triton":
        request.getfixturevalue("interpreted")
        return store_kvcache_triton
    assert cpu_library.load("cpu_attention.cpp", 16) is not None, "the CPU kernels did not build"
    return cpu_kernels.store_kvcache_cpu


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", FP8)
def test_every_store_kernel_writes_the_bytes_quantize_gives(store, dtype, source):
    key, value, k_cache, v_cache, slots = store_case(dtype, source)
    store(key, value, k_cache, v_cache, slots, K_SCALE, V_SCALE)
    written = slots >= 0
    for cache, x, scale in ((k_cache, key, K_SCALE), (v_cache, value, V_SCALE)):
        rows = cache.view(-1, *cache.shape[2:]).view(torch.uint8)
        assert torch.equal(rows[slots[written]], quantize(x[written], scale, dtype).view(torch.uint8))
        untouched = torch.ones(len(rows), dtype=torch.bool)
        untouched[slots[written]] = False
        assert not rows[untouched].any()  # padding rows wrote nothing


def fp8_sequences(dtype: torch.dtype, lengths: list[int], gen: torch.Generator, scale: float) -> list[torch.Tensor]:
    """Keys (or values) of each sequence: fp8 values times ``scale``, so exactly what a cache holds."""
    return [dequantize(quantize(torch.randn(n, HEADS[1], D, generator=gen), 1.0, dtype), scale, torch.float32)
            for n in lengths]


def fp8_cache(keys, values, dtype, gen, block_size=4):
    k_cache, v_cache, table = paged_cache(keys, values, block_size, gen)
    return quantize(k_cache, K_SCALE, dtype), quantize(v_cache, V_SCALE, dtype), table


def decode_case(dtype: torch.dtype, q_dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1)
    lengths = [3, 16, 9, 0]
    keys, values = fp8_sequences(dtype, lengths, gen, K_SCALE), fp8_sequences(dtype, lengths, gen, V_SCALE)
    q = torch.randn(len(lengths), 1, HEADS[0], D, generator=gen).to(q_dtype)
    k_cache, v_cache, table = fp8_cache(keys, values, dtype, gen)
    args = (q, k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32), table)
    kwargs = dict(softmax_scale=D ** -0.5, causal=True, k_descale=K_SCALE, v_descale=V_SCALE)
    expected = torch.stack([dense_causal_attention(q[b].float(), k, v) if len(k) else torch.zeros(1, HEADS[0], D,
                            dtype=torch.float64) for b, (k, v) in enumerate(zip(keys, values))])
    return args, kwargs, expected


def prefill_case(dtype: torch.dtype, q_dtype: torch.dtype):
    """Sequences with a cached prefix and new queries, all read back from the 8-bit cache."""
    gen = torch.Generator().manual_seed(2)
    lengths = [(0, 5), (8, 3), (13, 1), (4, 9)]
    totals = [c + n for c, n in lengths]
    keys, values = fp8_sequences(dtype, totals, gen, K_SCALE), fp8_sequences(dtype, totals, gen, V_SCALE)
    queries = [torch.randn(n, HEADS[0], D, generator=gen).to(q_dtype) for _, n in lengths]
    k_cache, v_cache, table = fp8_cache(keys, values, dtype, gen)
    args = (torch.cat(queries), k_cache, v_cache, cu_seqlens([n for _, n in lengths], "cpu"), cu_seqlens(totals, "cpu"),
            max(n for _, n in lengths), max(totals))
    kwargs = dict(softmax_scale=D ** -0.5, causal=True, block_table=table, k_descale=K_SCALE, v_descale=V_SCALE)
    expected = torch.cat([dense_causal_attention(q.float(), k, v) for q, k, v in zip(queries, keys, values)])
    return args, kwargs, expected


@pytest.mark.parametrize("reference, case", [(flash_attn_with_kvcache_torch, decode_case),
                                             (flash_attn_with_kvcache_plain, decode_case),
                                             (flash_attn_varlen_func_torch, prefill_case)])
@pytest.mark.parametrize("dtype", FP8)
def test_reference_attention_over_an_8bit_cache_is_dense_attention_over_its_values(reference, case, dtype):
    args, kwargs, expected = case(dtype, torch.float32)
    torch.testing.assert_close(reference(*args, **kwargs).double(), expected, atol=1e-5, rtol=1e-5)


KERNELS = {  # name -> (kernel, its reference, case)
    "cpu_decode": (cpu_kernels.flash_attn_with_kvcache_cpu, flash_attn_with_kvcache_torch, decode_case),
    "cpu_prefill": (cpu_kernels.flash_attn_varlen_func_cpu, flash_attn_varlen_func_torch, prefill_case),
    "triton_decode": (flash_attn_with_kvcache_triton, flash_attn_with_kvcache_torch, decode_case),
    "triton_prefill": (flash_attn_varlen_func_triton, flash_attn_varlen_func_torch, prefill_case),
}


@pytest.mark.parametrize("q_dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("name", KERNELS)
def test_every_attention_kernel_over_an_8bit_cache_matches_the_reference(request, name, dtype, q_dtype, tol):
    kernel, reference, case = KERNELS[name]
    if name.startswith("triton"):
        request.getfixturevalue("interpreted")
    else:
        assert cpu_library.load("cpu_attention.cpp", D) is not None, "the CPU kernels did not build"
    args, kwargs, _ = case(dtype, q_dtype)
    out = kernel(*args, **kwargs)
    assert out.dtype == q_dtype
    torch.testing.assert_close(out.float(), reference(*args, **kwargs).float(), atol=tol, rtol=tol)


# -- the engine -----------------------------------------------------------------------------------

PROMPTS = ["The quick brown fox jumps over the lazy dog, and then", "In a paged cache, each block holds"]


@pytest.fixture(scope="module")
def engines(tiny_models):
    """The tiny Llama with each cache dtype, under a CPU budget small enough to bind (2 MiB: the cache
    is then sized by bytes per token, not by max_num_seqs full-length sequences); chunked prefill with
    a small budget, so that prompts are read back from the cache in chunks."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("nanoengine.model_runner.CPU_KVCACHE_BYTES", 1 << 21)
        return {name: LLM(tiny_models["llama"], dtype="float32", kv_cache_dtype=name, enable_chunked_prefill=True,
                          max_num_batched_tokens=32)
                for name in ("auto", "fp8", "fp8_e5m2")}


def test_an_8bit_cache_holds_a_token_in_a_byte_a_value(engines):
    """A float32 model's cache holds 4x the tokens in fp8 (a bfloat16 model's, 2x)."""
    auto, fp8 = engines["auto"].stats(), engines["fp8"].stats()
    assert fp8["kvcache_tokens"] == torch.float32.itemsize * auto["kvcache_tokens"] > 0
    assert fp8["num_kvcache_blocks"] == torch.float32.itemsize * auto["num_kvcache_blocks"]


def teacher_forced_logprobs(llm: LLM, token_ids: list[list[int]]) -> torch.Tensor:
    """Each prompt token's logprob given the tokens before it (prompt_logprobs), all prompts."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": t} for t in token_ids], params, use_tqdm=False)
    return torch.tensor([lp[t] for out, ids in zip(outs, token_ids)
                         for lp, t in zip(out["prompt_logprobs"][1:], ids[1:])])


@pytest.fixture(scope="module")
def greedy_texts(engines) -> list[list[int]]:
    """Each prompt and auto's greedy continuation: the tokens every engine is teacher-forced on."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return [out["prompt_token_ids"] + out["outputs"][0]["token_ids"]
            for out in engines["auto"].generate(PROMPTS, greedy, use_tqdm=False)]


def test_greedy_logprobs_with_an_8bit_cache_stay_within_its_precision_of_auto(engines, greedy_texts):
    """Teacher-forced on auto's own greedy text, so that all read the same tokens. Each cached value
    is off by at most u = 2^-(mantissa bits + 1) of itself (e4m3 1/16, e5m2 1/8); to first order each
    layer's attention moves by about u of its size and the logprobs by the layers' sum, num_layers * u
    of their size (on average: a near-even softmax moves more). So e4m3, with a bit more, moves less
    than e5m2, and neither past that bound. Greedy tokens are not promised equal (docs/performance.md)."""
    auto = teacher_forced_logprobs(engines["auto"], greedy_texts)
    num_layers = 2  # make_tiny_model's
    moved = {}
    for name, dtype in (("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        moved[name] = (teacher_forced_logprobs(engines[name], greedy_texts) - auto).abs().mean()
        bound = num_layers * 2.0 ** -(mantissa_bits(dtype) + 1) * auto.abs().mean()
        assert 0 < moved[name] <= bound, name  # moved (8 bits were read), and not far
    assert moved["fp8"] < moved["fp8_e5m2"]


def test_the_engine_on_an_8bit_cache_matches_the_reference_backend_on_one(engines, tiny_models, greedy_texts):
    """The C++ kernels with prefix caching (the texts start with the prompts cached above), chunked
    prefill, CPU graphs and copy on write (n=2), against learner mode's pure torch on the same 8-bit
    cache: the same logprobs, to float32 summation's tolerance."""
    reference = LLM(tiny_models["llama"], dtype="float32", kv_cache_dtype="fp8", learner_mode=True)
    torch.testing.assert_close(teacher_forced_logprobs(engines["fp8"], greedy_texts),
                               teacher_forced_logprobs(reference, greedy_texts), atol=1e-3, rtol=0)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)
    ours = engines["fp8"].generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True,
                                                           n=2), use_tqdm=False)
    for a, b in zip(ours, reference.generate(PROMPTS, params, use_tqdm=False)):
        first, second = a["outputs"]
        assert first["token_ids"] == second["token_ids"]  # the copied block reads as the original
        for la, lb, ta, tb in zip(first["logprobs"], b["outputs"][0]["logprobs"], first["token_ids"],
                                  b["outputs"][0]["token_ids"]):
            if ta != tb:  # a near tie, broken differently: the rest follows other tokens
                break
            assert la[ta] == pytest.approx(lb[tb], abs=1e-3)


def test_kv_cache_dtype_round_trips_through_the_server_command_line():
    pytest.importorskip("fastapi")  # the server's options come with its extra
    from nanoengine.serve_cli_args import engine_options, make_parser
    assert engine_options(make_parser().parse_args(["--kv-cache-dtype", "fp8_e5m2"]))["kv_cache_dtype"] == "fp8_e5m2"
    assert "kv_cache_dtype" not in engine_options(make_parser().parse_args([]))
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--kv-cache-dtype", "int8"])
