"""Weight-only quantization: the formats' round trips, the quantized linear against a
dequantize-then-matmul reference, and the default model's perplexity with each format."""

import math

import pytest
import torch
import torch.nn.functional as F

from nanoengine import LLM, SamplingParams
from nanoengine.config import Config
from nanoengine.layers import Linear
from nanoengine.quantization import GROUP_SIZE, dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from nanoengine.sequence import Sequence

# From the README's opening: plain English prose the model should find predictable.
TEXT = ("A small LLM inference engine that reads like a tutorial on how vLLM works, and runs: offline "
        "batched generation with continuous batching, a paged KV cache with prefix caching, a scheduler "
        "that preempts under memory pressure, CUDA graphs and flash-attn on a GPU, a first-class CPU path, "
        "and an OpenAI-compatible server. One flat package of small modules; HF transformers is the "
        "correctness oracle (same weights, same greedy tokens).")


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
    error = (dequantize_int4(q, scales, mins) - w).abs()
    step = scales.repeat_interleave(GROUP_SIZE, dim=1)
    assert (error <= step / 2 * (1 + 1e-5) + 1e-7).all()


def dequantized(w: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "int8":
        return dequantize_int8(*quantize_int8(w))
    return dequantize_int4(*quantize_int4(w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,shape", [("int8", (37, 104)), ("int4", (80, 5 * GROUP_SIZE))])
@pytest.mark.parametrize("rows", [1, 300])
@pytest.mark.parametrize("strided", [False, True])
@torch.inference_mode()
def test_quantized_linear_matches_dequantize_then_matmul(dtype, fmt, shape, rows, strided):
    out_features, in_features = shape
    layer = Linear(in_features, out_features, bias=True)
    layer.weight.data = weight(out_features, in_features)
    layer.bias.data = torch.randn(out_features)
    reference_weight, bias = dequantized(layer.weight.data, fmt), layer.bias.data.clone()
    layer.to(dtype).quantize(fmt)
    gen = torch.Generator().manual_seed(1)
    if strided:  # every other column of a wider tensor, in a [2, rows, in] batch
        x = torch.randn(2, rows, 2 * in_features, generator=gen)[..., ::2]
    else:
        x = torch.randn(rows, in_features, generator=gen)
    out = layer(x.to(dtype))
    expected = F.linear(x.to(dtype).float(), reference_weight, bias)
    assert out.dtype == dtype and out.shape == expected.shape
    # bf16 rounds the scales and the output to 8 bits of mantissa; float32 only reorders sums.
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.float(), expected, atol=tol * expected.abs().max().item(), rtol=tol)


def test_quantized_state_dict_holds_the_quantized_weight():
    layer = Linear(GROUP_SIZE, 16, bias=False)
    layer.quantize("int4")
    assert set(layer.state_dict()) == {"qweight", "scales"} and layer.weight is None


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
    llm = LLM(max_model_len=512)
    token_ids = llm.tokenizer.encode(TEXT)
    return token_ids, perplexity(llm, token_ids), llm.model_runner.model.model.embed_tokens.weight.clone()


@pytest.mark.parametrize("fmt,bound", [("int8", 0.01), ("int4", 0.03)])
def test_default_model_perplexity_stays_close_to_unquantized(fmt, bound, unquantized_perplexity):
    token_ids, expected, embedding = unquantized_perplexity
    llm = LLM(max_model_len=512, quantization=fmt)
    model = llm.model_runner.model
    # The tied LM head has its own quantized copy; the embedding lookup still reads the original table.
    assert model.lm_head.quantized and model.lm_head.weight is None
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    assert abs(perplexity(llm, token_ids) / expected - 1) <= bound
