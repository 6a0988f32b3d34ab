"""cpu_int8_gemm.py against a dequantize-then-matmul reference, and cpu_int8_gemm.py's rule choosing
between it and the C++ kernel."""

import pytest
import torch
import torch.nn.functional as F

from nanoengine import LLM, SamplingParams, cpu_int8_gemm, quantization
from nanoengine.cpu_library import cpu_features
from nanoengine.graph_runner import CPU_GRAPH_MAX_BATCH, decode_buckets
from nanoengine.cpu_int8_gemm import int8_linear
from nanoengine.linear import Linear

# Where the rule never picks the GEMM (no VNNI), its products may saturate: nothing to test there.
needs_gemm = pytest.mark.skipif(not cpu_int8_gemm.available() or cpu_int8_gemm.cpu_kind(cpu_features()) == "no_vnni",
                                reason="needs a C++ compiler and a CPU with VNNI")
needs_amx = pytest.mark.skipif(not cpu_int8_gemm.uses_amx(), reason="needs a CPU with AMX")
# The two GEMMs, by the weight's layout: torch._int_mm's [out, in], and cpu_int8_gemm.cpp's AMX tiles.
LAYOUTS = [pytest.param(lambda q: q, id="onednn"), pytest.param(cpu_int8_gemm.pack_weight, id="amx", marks=needs_amx)]


def int8_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """int8_linear's arithmetic in float64 torch: each row of x rotated by the Hadamard matrices,
    rounded to int8 at its own scale (its largest magnitude at 127), times the int8 weight."""
    x = cpu_int8_gemm.rotate(x.reshape(-1, x.shape[-1]))
    step = x.abs().amax(1, keepdim=True) / 127
    rounded = torch.round(x / torch.where(step > 0, step, 1)) * step
    w = q.double() * scales.double()[:, None]
    return F.linear(rounded, w, None if bias is None else bias.double())


def test_the_rotation_is_a_hadamard_matrix_per_block():
    """rotate multiplies each block of B values by H (H @ H.T = B * I): twice is B times the
    identity, a unit vector becomes a row of +-1, and a block never mixes with the next."""
    blocks = [cpu_int8_gemm.hadamard_block(k) for k in (7, 8, 48, 96, 576, 1536, 3072, 4096)]
    assert blocks == [1, 1, 16, 32, 64, 512, 512, 512]
    x = torch.randn(3, 1536, dtype=torch.float64)
    assert torch.allclose(cpu_int8_gemm.rotate(cpu_int8_gemm.rotate(x)), 512 * x)
    e = torch.zeros(576, dtype=torch.float64)
    e[70] = 1  # in the second block of 64
    rotated = cpu_int8_gemm.rotate(e)
    assert (rotated[64:128].abs() == 1).all() and (rotated[:64] == 0).all() and (rotated[128:] == 0).all()
    assert torch.equal(cpu_int8_gemm.rotate(x[:, :8]), x[:, :8])  # below 16 values a block, no rotation


@needs_gemm
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(13, 48), (40, 96), (24, 576), (16, 1536), (8, 7)])  # [out, in]: odd sizes too
@pytest.mark.parametrize("rows", [1, 5, 300])  # 300: three chunks of products (CHUNK_ROWS)
@pytest.mark.parametrize("with_bias", [False, True])
@torch.inference_mode()
def test_int8_linear_matches_its_arithmetic_in_torch(layout, dtype, shape, rows, with_bias):
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=gen) * torch.logspace(-2, 0, out_features)[:, None]
    q, scales = cpu_int8_gemm.quantize_weight(w)
    bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(2, rows, 2 * in_features, generator=gen)[..., ::2]  # strided, batched
    x[..., 3] *= 50  # an outlier feature
    x[0, 0] = 0  # a row of zeros
    x = x.to(dtype)
    out = int8_linear(x, layout(q), scales, bias)
    expected = int8_reference(x, q, scales, bias).view(2, rows, out_features)
    assert out.dtype == dtype and out.shape == expected.shape
    # float32 rounds the sums and the rotation, bf16 the output to 8 bits of mantissa; and now and
    # then an x value all but exactly between two steps rounds the other way in float32 (a step
    # times at most max |w|)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    error = (out.double() - expected).abs()
    assert (error <= tol * expected.abs().max()).double().mean() >= 0.99
    step = cpu_int8_gemm.rotate(x.double()).abs().amax() / 127
    assert error.max() <= tol * expected.abs().max() + 2 * step * q.double().abs().max() * scales.max()


@pytest.mark.parametrize("in_features", [576, 1536])
@torch.inference_mode()
def test_the_rotation_is_what_makes_int8_rows_precise(in_features):
    """With a channel 50 times the rest, x rounded to int8 as it is loses the small channels (here
    5-7% off the float product); rotated first, rounding x costs about what rounding the weight does
    (1.0-1.1% against 0.75%). In float64 (int8_reference), against the same x and weight unrotated."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, in_features, generator=gen) / in_features ** 0.5
    x = torch.randn(64, in_features, generator=gen, dtype=torch.float64)
    x[:, 3] *= 50
    exact = F.linear(x, w.double())
    q, scales = cpu_int8_gemm.quantize_weight(w)
    rotated = int8_reference(x, q, scales, None)
    q_plain, scales_plain = quantization.quantize_int8(w)
    step = x.abs().amax(1, keepdim=True) / 127
    plain = F.linear(torch.round(x / step) * step, q_plain.double() * scales_plain.double()[:, None])
    weight_only = F.linear(x, q_plain.double() * scales_plain.double()[:, None])
    errors = [(y - exact).norm() / exact.norm() for y in (rotated, plain, weight_only)]
    rotated_error, plain_error, weight_error = errors
    assert rotated_error < plain_error / 3
    assert rotated_error < 2 * weight_error


@needs_gemm
@pytest.mark.parametrize("layout", LAYOUTS)
@torch.inference_mode()
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(layout):
    """Every product is an exact integer and the scales are the row's own: bit for bit the same row
    alone, among 7 others, or among 299 (three GEMM chunks, or 19 blocks of AMX tiles)."""
    gen = torch.Generator().manual_seed(0)
    q, scales = quantization.quantize_int8(torch.randn(3072, 576, generator=gen))
    q = layout(q)
    x = torch.randn(300, 576, generator=gen).to(torch.bfloat16)
    x[:, 7] *= 100
    alone = int8_linear(x[150:151], q, scales, None)
    assert torch.equal(int8_linear(x[147:155], q, scales, None)[3:4], alone)
    assert torch.equal(int8_linear(x, q, scales, None)[150:151], alone)


@needs_gemm
def test_the_gemm_is_exact_at_the_extremes():
    """What the rule relies on where it picks the GEMM: int8 products summed without saturating."""
    a = torch.full((4, 64), 127, dtype=torch.int8)
    a[1] = -127
    b = a[:2].t().contiguous()
    assert torch.equal(torch._int_mm(a, b), a.int() @ b.int())


@needs_gemm
@needs_amx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3072, 576), (40, 1536), (8, 7)])
@pytest.mark.parametrize("rows", [37, 700])  # 700 x 3072: an output of 4 MB and more, streamed past the cache
@torch.inference_mode()
def test_amx_gives_onednns_bits(dtype, shape, rows):
    """The same exact integer sums, rescaled by the same C++: AMX's tiles and torch._int_mm agree to
    the bit, at the extremes too (rows of x at full scale, weight rows of +-127: sums of 127 x 127)."""
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(0)
    q, scales = quantization.quantize_int8(torch.randn(out_features, in_features, generator=gen))
    q[0], q[-1] = 127, -127
    bias = torch.randn(out_features, generator=gen).to(dtype)
    x = torch.randn(rows, in_features, generator=gen)
    x[3], x[4] = 5.0, -5.0  # constant rows: rotated, each block's first value is its sum, the rest 0: +-127 and 0
    x = x.to(dtype)
    assert torch.equal(int8_linear(x, cpu_int8_gemm.pack_weight(q), scales, bias), int8_linear(x, q, scales, bias))


def test_int8_linear_refuses_what_it_cannot_compute():
    q, scales = quantization.quantize_int8(torch.randn(8, 64))
    with pytest.raises(ValueError, match="x"):
        int8_linear(torch.randn(2, 32), q, scales, None)
    with pytest.raises(ValueError, match="x"):
        int8_linear(torch.randn(2, 64).half(), q, scales, None)
    with pytest.raises(ValueError, match="weight"):
        int8_linear(torch.randn(2, 64), q.float(), scales, None)
    with pytest.raises(ValueError, match="bias"):
        int8_linear(torch.randn(2, 64), q, scales, torch.zeros(7))


AMX = "fpu avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_int8 amx_tile"


def test_the_rule_reads_the_cpu_kind():
    assert cpu_int8_gemm.cpu_kind(AMX) == "amx"
    assert cpu_int8_gemm.cpu_kind("fpu avx2 avx512f avx512_vnni avx512_bf16") == "avx512_vnni"
    assert cpu_int8_gemm.cpu_kind("fpu avx2 avx_vnni") == "avx_vnni"
    assert cpu_int8_gemm.cpu_kind("fpu avx2 fma") == "no_vnni"
    assert cpu_int8_gemm.gemm_min_rows("int8", "fpu avx2 fma") is None  # its products would saturate
    assert cpu_int8_gemm.gemm_min_rows("int8", AMX) == cpu_int8_gemm.GEMM_MIN_ROWS["amx"]["int8"]
    assert cpu_int8_gemm.gemm_min_rows("int4", "fpu avx2 fma") is None  # the C++ kernel at every batch
    for kind in cpu_int8_gemm.GEMM_MIN_ROWS.values():
        assert set(kind) == {"int8", "int4"}
        assert all(rows is None or rows > 1 for rows in kind.values())  # batch 1 is always the kernel's


def test_the_rules_rows_never_split_a_graph_bucket():
    """A CPU graph's step is padded to its bucket: it must take the path its real rows take, decode
    steps and verify steps (q tokens a sequence) alike, or a replay's tokens would differ from eager's."""
    buckets = decode_buckets(max_num_seqs=256)
    for kind in cpu_int8_gemm.GEMM_MIN_ROWS.values():
        for rows in filter(None, kind.values()):
            for n in range(1, CPU_GRAPH_MAX_BATCH + 1):
                padded = next(b for b in buckets if b >= n)
                for q in range(1, 17):
                    assert (n * q >= rows) == (padded * q >= rows), (rows, n, q)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@torch.inference_mode()
def test_a_quantized_layer_switches_to_the_gemm_from_the_rules_rows(fmt, monkeypatch):
    monkeypatch.setattr(cpu_int8_gemm, "gemm_min_rows", lambda fmt: 4)
    layer = Linear(64, 16, bias=True)
    layer.quantize(fmt)
    calls = []
    monkeypatch.setattr(cpu_int8_gemm, "int8_linear", lambda *args: calls.append(args[0].shape) or args[0][..., :16])
    layer(torch.randn(3, 64))
    layer(torch.randn(2, 2, 64))
    assert calls == [(2, 2, 64)]
    # the GEMM's copy is the kernel's values (int4's or int8's) rotated by H / B and rounded again
    # to int8: rotated back, each value within B = 64 half-steps of the kernel's (a sum of B roundings)
    values = quantization.dequantize_packed(layer.qweight, layer.scales)
    gemm_q, gemm_scales = cpu_int8_gemm.quantize_weight(values)
    assert torch.equal(layer.gemm_weight, cpu_int8_gemm.pack_weight(gemm_q)) and torch.equal(layer.gemm_scales, gemm_scales)
    rotated_back = cpu_int8_gemm.rotate(quantization.dequantize_int8(gemm_q, gemm_scales))
    assert ((rotated_back - values.double()).abs() <= 64 * gemm_scales[:, None] / 2 + 1e-6).all()


@needs_gemm
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_graph_replay_through_the_gemm_gives_the_eager_tokens(fmt, tiny_models, monkeypatch):
    """Decode steps from one row on through cpu_int8_gemm.py, replayed by CPU graphs: the same greedy
    tokens as run eagerly, so the GEMM and both passes around it replay on the step's new inputs.
    Three prompts: their steps are padded to a graph of 4 rows."""
    monkeypatch.setattr(cpu_int8_gemm, "gemm_min_rows", lambda fmt: 1)
    prompts = [[1, 5, 9, 2], [3, 3, 7], [4, 8, 15, 16, 23, 42]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for eager in (True, False):
        llm = LLM(tiny_models["llama"], max_model_len=128, quantization=fmt, enforce_eager=eager)
        assert (llm.model_runner.graph_runner is None) == eager
        tokens[eager] = [out["token_ids"] for out in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens[True] == tokens[False]
