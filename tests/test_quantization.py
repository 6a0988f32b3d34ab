"""Weight-only quantization: the formats' round trips, the quantized linear against a
dequantize-then-matmul reference, and the default model's perplexity with each format."""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nanoengine import LLM, SamplingParams
from nanoengine.config import Config
from nanoengine.linear import Linear
from nanoengine import cpu_int8_gemm, cpu_kernels, quantization
from tests.test_int8_gemm import needs_gemm
from nanoengine.quantization import (FORMATS, GROUP_SIZE, can_quantize, dequantize_int4, dequantize_int8,
                                     dequantize_packed, pack_int4, pack_int8, packed_row_blocks, quantize_int4,
                                     quantize_int8, quantize_weight)
from nanoengine.sequence import Sequence

# The README's opening as it was when the bounds were set (1,000 tokens of the default model's
# tokenizer), kept fixed: plain prose and some code. A short paragraph was tried first; over its 90
# tokens the perplexity moved by +-1% with which layers' inputs were rounded to int8, noise the
# longer text averages out (measured there: int8 +0.8%, int4 +0.7%).
TEXT = (Path(__file__).parent / "data" / "perplexity_text.md").read_text()


def weight(out_features: int, in_features: int) -> torch.Tensor:
    """Rows of very different magnitudes and an outlier, so a shared scale would show."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=gen) * torch.logspace(-3, 0, out_features)[:, None]
    w[0, 3] = 5.0
    return w


def test_int8_round_trip_is_within_half_a_step_per_row():
    w = weight(37, 100)
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    error = (dequantize_int8(q, scales) - w).abs()
    assert (error <= scales[:, None] / 2 * (1 + 1e-5)).all()


def test_int4_round_trip_is_within_half_a_step_per_group():
    w = weight(48, 5 * GROUP_SIZE)
    q, scales, mins = quantize_int4(w)
    assert q.min() == 0 and q.max() == 15
    assert torch.equal(scales.half().float(), scales) and torch.equal(mins.half().float(), mins)
    error = (dequantize_int4(q, scales, mins) - w).abs()
    step = scales.repeat_interleave(GROUP_SIZE, dim=1)
    assert (error <= step / 2 * (1 + 1e-5) + 1e-7).all()


def quantized_x(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel reads it: each block of GROUP_SIZE values in int8, its largest magnitude at 127."""
    blocks = x.float().reshape(*x.shape[:-1], -1, GROUP_SIZE)
    largest = blocks.abs().amax(-1, keepdim=True)
    q = torch.round(blocks * torch.where(largest > 0, 127 / largest, 0))
    return (q * (largest / 127)).reshape(x.shape)


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, fmt: str) -> torch.Tensor:
    """The kernel's arithmetic in float32 torch: the quantized weight times the int8 x, but for int4's
    constant part per group, which meets the exact sum of each x block."""
    x = x.float()
    if fmt == "int8":
        return F.linear(quantized_x(x), dequantize_int8(*quantize_int8(w)), bias)
    # int4 centres its steps on zero, (q - 7.5) * scale, and adds (min + 7.5 * scale) * sum(x)
    q, scales, mins = quantize_int4(w)
    centred = dequantize_int4(q, scales, -7.5 * scales)
    return F.linear(quantized_x(x), centred, bias) + F.linear(x, dequantize_int4(torch.zeros_like(q), scales,
                                                                                  mins + 7.5 * scales))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,shape", [("int8", (40, 96)), ("int4", (40, 96)), ("int8", (8, 5 * GROUP_SIZE)),
                                       ("int4", (80, 5 * GROUP_SIZE))])
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 9, 300])  # the kernel takes rows 8 (or 4), 4, 3, 2, 1 at a time
@pytest.mark.parametrize("strided", [False, True])
@torch.inference_mode()
def test_quantized_linear_matches_its_arithmetic_in_torch(dtype, fmt, shape, rows, strided):
    out_features, in_features = shape
    layer = Linear(in_features, out_features, bias=True)
    gen = torch.Generator().manual_seed(1)
    layer.weight.data = weight(out_features, in_features)
    layer.bias.data = torch.randn(out_features, generator=gen)
    w, bias = layer.weight.data.clone(), layer.bias.data.clone()
    layer.to(dtype).quantize(fmt)
    layer.gemm_min_rows = None  # the C++ kernel at every batch size (cpu_int8_gemm.py: tests/test_int8_gemm.py)
    if strided:  # every other column of a wider tensor, in a [2, rows, in] batch
        x = torch.randn(2, rows, 2 * in_features, generator=gen)[..., ::2]
    else:
        x = torch.randn(rows, in_features, generator=gen)
    x = x.to(dtype)
    out = layer(x)
    expected = reference(x, w.to(dtype).float(), bias.to(dtype).float(), fmt)
    assert out.dtype == dtype and out.shape == expected.shape
    # float32 only reorders sums, bf16 rounds the output to 8 bits of mantissa; and now and then an x
    # value exactly between two int8 steps rounds the other way (a step of x times at most max |w|)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    error = (out.float() - expected).abs()
    assert (error <= tol * expected.abs().max() + tol * expected.abs()).float().mean() >= 0.99
    assert error.max() <= tol * expected.abs().max() + x.float().abs().max() / 127 * w.abs().max()
    # and int8 x stays within its rounding of the float product (what the perplexity test checks end
    # to end): each value of x off by at most half its block of 32's step, times the weight it meets
    # (int4's centred on zero, as in reference)
    w_values = dequantized(w.to(dtype).float(), fmt)
    exact = F.linear(x.float(), w_values, bias.to(dtype).float())
    if fmt == "int4":
        q, scales, _ = quantize_int4(w.to(dtype).float())
        w_values = dequantize_int4(q, scales, -7.5 * scales)
    half_steps = (x.float().abs().unflatten(-1, (-1, GROUP_SIZE)).amax(-1, keepdim=True) / 254).expand(
        *x.shape[:-1], -1, GROUP_SIZE).flatten(-2)
    assert ((out.float() - exact).abs() <= F.linear(half_steps, w_values.abs()) + tol * exact.abs().max()).all()


def dequantized(w: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "int8":
        return dequantize_int8(*quantize_int8(w))
    return dequantize_int4(*quantize_int4(w))


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_weight_reads_back_as_the_quantized_values(fmt):
    w = weight(24, 3 * GROUP_SIZE)
    assert torch.equal(dequantize_packed(*quantize_weight(w, fmt)), dequantized(w, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantizing_a_block_of_rows_at_a_time_gives_the_whole_weights_bits(fmt, monkeypatch):
    """quantize_weight quantizes about QUANTIZE_BLOCK weights at a time, so that its float32
    temporaries are a block's and not the weight's; every row is quantized alone, so the blocks (a
    short last one too) give the bits of the weight quantized whole. So does cpu_int8_gemm.py's copy,
    which Linear.quantize makes from the quantized weight a block at a time."""
    monkeypatch.setattr(quantization, "QUANTIZE_BLOCK", 16 * 3 * GROUP_SIZE)  # blocks of 16 rows
    w = weight(40, 3 * GROUP_SIZE)
    qweight, scales = quantize_weight(w, fmt)
    if fmt == "int8":
        q, whole_scales = quantize_int8(w)
        assert torch.equal(qweight, pack_int8(q)) and torch.equal(scales, whole_scales)
    else:
        assert scales is None and torch.equal(qweight, pack_int4(*quantize_int4(w)))
    blocks = [cpu_int8_gemm.quantize_weight(dequantize_packed(q, s)) for q, s in packed_row_blocks(qweight, scales)]
    assert [len(q) for q, _ in blocks] == [16, 16, 8]
    gemm_q, gemm_scales = cpu_int8_gemm.quantize_weight(dequantize_packed(qweight, scales))
    assert torch.equal(torch.cat([q for q, _ in blocks]), gemm_q)
    assert torch.equal(torch.cat([s for _, s in blocks]), gemm_scales)


@pytest.mark.parametrize("fmt", FORMATS)
@torch.inference_mode()
def test_without_a_compiler_the_layer_dequantizes(fmt, monkeypatch):
    layer = Linear(2 * GROUP_SIZE, 8, bias=False)
    layer.weight.data = weight(8, 2 * GROUP_SIZE)
    w = layer.weight.data.clone()
    monkeypatch.setattr(cpu_kernels, "load", lambda *args: None)
    monkeypatch.setattr(cpu_int8_gemm, "load", lambda *args: None)  # so no int8 GEMM either
    layer.quantize(fmt)
    assert layer.gemm_min_rows is None
    x = torch.randn(3, 2 * GROUP_SIZE)
    torch.testing.assert_close(layer(x), F.linear(x, dequantized(w, fmt)))


def test_quantized_linear_refuses_a_weight_not_in_its_layout():
    qweight, _ = quantize_weight(weight(16, GROUP_SIZE), "int4")
    with pytest.raises(ValueError, match="qweight"):
        cpu_kernels.quantized_linear(torch.randn(1, GROUP_SIZE), qweight[:1], None, None, 16)
    with pytest.raises(ValueError, match="x has dtype"):
        cpu_kernels.quantized_linear(torch.randn(1, GROUP_SIZE).half(), qweight, None, None, 16)
    assert not can_quantize(6, GROUP_SIZE) and not can_quantize(8, GROUP_SIZE + 2)


@pytest.mark.parametrize("gemm_min_rows", [None, 16])
def test_quantized_state_dict_holds_the_quantized_weight(gemm_min_rows, monkeypatch):
    monkeypatch.setattr(cpu_int8_gemm, "gemm_min_rows", lambda fmt: gemm_min_rows)
    gemm = {"gemm_weight", "gemm_scales"} if gemm_min_rows else set()  # cpu_int8_gemm.py's copy, where it computes
    layer = Linear(GROUP_SIZE, 16, bias=False)
    layer.quantize("int8")
    assert set(layer.state_dict()) == {"qweight", "scales"} | gemm and layer.weight is None
    layer = Linear(GROUP_SIZE, 16, bias=False)
    layer.quantize("int4")  # its scales are inside qweight
    assert set(layer.state_dict()) == {"qweight"} | gemm and layer.weight is None


def test_unknown_quantization_is_a_value_error_naming_the_field():
    with pytest.raises(ValueError, match="quantization"):
        Config(quantization="int3")


@torch.inference_mode()
def perplexity(llm: LLM, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of each token given those before it, teacher-forced in one prefill."""
    runner = llm.model_runner
    seq = Sequence(token_ids, SamplingParams(), llm.config.kvcache_block_size or runner.block_size)
    llm.block_manager.allocate(seq)
    seq.num_scheduled_tokens = seq.num_tokens
    input_ids, positions, ctx = runner.prepare_prefill([seq])
    logits = runner.model.compute_logits(runner.model(input_ids, positions, ctx)).float()
    llm.block_manager.deallocate(seq)
    nll = F.cross_entropy(logits[:-1], torch.tensor(token_ids[1:]))
    return math.exp(nll.item())


@pytest.fixture(scope="module")
def unquantized_perplexity():
    llm = LLM(max_model_len=1024)
    token_ids = llm.tokenizer.encode(TEXT)
    return token_ids, perplexity(llm, token_ids), llm.model_runner.model.model.embed_tokens.weight.clone()


@pytest.mark.parametrize("fmt,bound", [("int8", 0.01), ("int4", 0.03)])
@pytest.mark.parametrize("gemm_min_rows", [None, pytest.param(1, marks=needs_gemm)], ids=["cpp-kernel", "int8-gemm"])
def test_default_model_perplexity_stays_close_to_unquantized(fmt, bound, gemm_min_rows, unquantized_perplexity,
                                                             monkeypatch):
    """Through either path, whichever cpu_int8_gemm.py would pick for the 1,000-row prefill here."""
    token_ids, expected, embedding = unquantized_perplexity
    monkeypatch.setattr(cpu_int8_gemm, "gemm_min_rows", lambda fmt: gemm_min_rows)
    llm = LLM(max_model_len=1024, quantization=fmt)
    model = llm.model_runner.model
    # The tied LM head has its own quantized copy; the embedding lookup still reads the original table.
    assert model.lm_head.quantized and model.lm_head.weight is None
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    assert abs(perplexity(llm, token_ids) / expected - 1) <= bound
