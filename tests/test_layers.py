"""The decoder's layers on CPU: the C++ kernels (cpu_layers.cpp, cpu_linear.cpp) against the
torch code they replace.

The torch code is HF's arithmetic (float32 normalisation, each op rounded to the activation
dtype), so the kernels must agree with it to the last bit or one rounding step (reductions sum
in another order), and the residual sums they write must be identical.
"""

import pytest
import torch

from nanoengine import cpu_kernels, cpu_library
from nanoengine.activation import SiluAndMul
from nanoengine.layernorm import RMSNorm
from nanoengine.rotary_embedding import RotaryEmbedding
from nanoengine.linear import Linear

ULP = {torch.bfloat16: 2 ** -7, torch.float32: 1e-5}  # bf16: one rounding step, relative


@pytest.fixture(autouse=True)
def layer_kernels_build():
    assert cpu_library.load("cpu_layers.cpp") is not None, "the CPU kernels did not build (is g++ installed?)"


def norm_pair(dtype, hidden_size, eps=1e-6):
    torch.manual_seed(0)
    reference = RMSNorm(hidden_size, eps).to(dtype)
    with torch.no_grad():
        reference.weight.copy_(1 + 0.2 * torch.randn(hidden_size))
    fused = RMSNorm(hidden_size, eps).to(dtype)
    fused.load_state_dict(reference.state_dict())
    fused.kernel = cpu_kernels.add_rms_norm
    return reference, fused


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576 rows run on several threads
def test_add_rms_norm_matches_torch_with_and_without_a_residual(dtype, rows):
    reference, fused = norm_pair(dtype, 576)
    x, residual = torch.randn(rows, 576).to(dtype), (3 * torch.randn(rows, 576)).to(dtype)
    torch.testing.assert_close(fused(x), reference(x), atol=0, rtol=ULP[dtype])
    expected_out, expected_sum = reference(x, residual.clone())
    kernel_residual = residual.clone()
    out, new_residual = fused(x, kernel_residual)
    assert torch.equal(new_residual, expected_sum)
    assert new_residual.data_ptr() == kernel_residual.data_ptr()  # written in place, as vLLM's op does
    torch.testing.assert_close(out, expected_out, atol=0, rtol=ULP[dtype])


def test_add_rms_norm_on_heads_of_a_strided_view():
    """Qwen3 normalises each query head: a [tokens, heads, head_dim] view into the fused qkv output."""
    reference, fused = norm_pair(torch.bfloat16, 32)
    qkv = torch.randn(5, 4 * 32 + 64).bfloat16()
    q = qkv[:, :4 * 32].view(5, 4, 32)
    torch.testing.assert_close(fused(q), reference(q), atol=0, rtol=ULP[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_silu_and_mul_matches_torch(dtype, rows):
    x = (4 * torch.randn(rows, 2 * 1536)).to(dtype)
    fused = SiluAndMul()
    fused.kernel = cpu_kernels.silu_and_mul
    # The kernel's exp is not torch's: SiLU may round one step apart, which the product can carry
    # up to two steps. 300 rows run on several threads.
    torch.testing.assert_close(fused(x), SiluAndMul()(x), atol=1e-6, rtol=2 * ULP[dtype])


def test_the_model_runner_binds_the_kernels_on_cpu(tiny_models):
    from nanoengine import LLM
    llm = LLM(tiny_models["qwen3"], dtype="bfloat16", num_kvcache_blocks=8)
    modules = list(llm.model_runner.model.modules())
    norms = [m for m in modules if isinstance(m, RMSNorm)]
    assert norms and all(m.kernel is cpu_kernels.add_rms_norm for m in norms)
    assert all(m.kernel is cpu_kernels.silu_and_mul for m in modules if isinstance(m, SiluAndMul))
    assert [m.kernel for m in modules if isinstance(m, RotaryEmbedding)] == [cpu_kernels.rotary]  # one, shared
    linears = [m for m in modules if isinstance(m, Linear)]
    if HAS_AVX512_BF16:
        assert linears and all(m.kernel is cpu_kernels.linear and m.weight is None for m in linears)


HAS_AVX512_BF16 = "avx512_bf16" in cpu_library.cpu_features().split()


@pytest.mark.skipif(not HAS_AVX512_BF16, reason="cpu_linear.cpp needs a CPU with AVX512-BF16")
@pytest.mark.parametrize("rows", [0, 1, 13, 15, 41, 64, 500, 2200])  # row blocks of 14, chunks of 224; 2200 x 960: streamed
@pytest.mark.parametrize("out_features,in_features,bias", [(960, 576, False), (100, 64, True), (3, 1538, True)])
def test_linear_kernel_matches_a_float32_product_rounded_once(rows, out_features, in_features, bias):
    """Output widths not a multiple of the 32-column strips, a bias, and x a strided view.

    The kernel sums exact products of the bf16 inputs in float32 and rounds once, as oneDNN does;
    only the order of the sums differs from a float32 product, so the results round alike
    or one step apart.
    """
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features).bfloat16()
    b = torch.randn(out_features).bfloat16() if bias else None
    x = torch.randn(rows, in_features + 8).bfloat16()[:, 5:5 + in_features]
    expected = torch.nn.functional.linear(x.float(), weight.float(), b.float() if bias else None).bfloat16()
    out = cpu_kernels.linear(x, cpu_kernels.pack_linear_weight(weight), b, out_features)
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=ULP[torch.bfloat16])


@pytest.mark.skipif(not HAS_AVX512_BF16, reason="cpu_linear.cpp needs a CPU with AVX512-BF16")
@pytest.mark.parametrize("in_features", [576, 1538])  # with AMX: its tiles (k in 32s), and vdpbf16ps
def test_linear_kernel_computes_a_row_the_same_way_at_every_batch_size(in_features):
    """What seeded bf16 samples rely on: a row alone, as the last of 41 (AMX: a block of 32 and 9
    rows copied apart), among 500 (15 blocks and 20 rows) and among 2,200 (an output of 4 MB and
    more, streamed past the cache), the same bits."""
    torch.manual_seed(0)
    packed = cpu_kernels.pack_linear_weight(torch.randn(960, in_features).bfloat16())
    x = torch.randn(2200, in_features).bfloat16()
    alone = cpu_kernels.linear(x[40:41], packed, None, 960)
    assert torch.equal(cpu_kernels.linear(x[:41], packed, None, 960)[40:], alone)
    assert torch.equal(cpu_kernels.linear(x[:500], packed, None, 960)[40:41], alone)
    assert torch.equal(cpu_kernels.linear(x, packed, None, 960)[40:41], alone)
    assert torch.equal(cpu_kernels.linear(x[24:41], packed, None, 960)[16:], alone)  # 17 rows: a lower half too


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_kernel_matches_torch_on_views_into_the_qkv_output(dtype):
    """The kernel rotates q and k in place inside the fused qkv tensor and leaves v alone."""
    torch.manual_seed(0)
    reference, fused = RotaryEmbedding(64, 512, 10000.0), RotaryEmbedding(64, 512, 10000.0)
    fused.kernel = cpu_kernels.rotary
    tokens, heads, kv_heads = 300, 9, 3
    positions = torch.randint(0, 512, (tokens,))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * 64).to(dtype)
    v_before = qkv[:, (heads + kv_heads) * 64:].clone()

    def views(t):
        q, k, _ = t.split([heads * 64, kv_heads * 64, kv_heads * 64], dim=-1)
        return q.view(tokens, heads, 64), k.view(tokens, kv_heads, 64)

    expected_q, expected_k = reference(positions, *views(qkv.clone()))
    q, k = fused(positions, *views(qkv))
    # bf16: the same roundings in the same order, so the same bits; float32: FMA contraction may differ by an ulp
    tol = dict(atol=0, rtol=0) if dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(q, expected_q, **tol)
    torch.testing.assert_close(k, expected_k, **tol)
    assert torch.equal(qkv[:, (heads + kv_heads) * 64:], v_before)


def test_a_linear_layer_on_its_cpu_kernel_keeps_the_packed_weight_in_its_state_dict():
    """What the layer computes with is what ``state_dict`` saves, and ``load_state_dict`` takes back."""
    torch.manual_seed(0)
    layer = Linear(64, 40, bias=True).bfloat16()
    packed = cpu_kernels.pack_linear_weight(layer.weight.detach())
    layer.use_cpu_kernel()
    state = layer.state_dict()
    assert set(state) == {"packed_weight", "bias"} and torch.equal(state["packed_weight"], packed)
    assert layer.weight is None and layer.kernel is cpu_kernels.linear
    other = Linear(64, 40, bias=True).bfloat16()
    other.use_cpu_kernel()
    other.load_state_dict(state)
    assert torch.equal(other.packed_weight, packed) and torch.equal(other.bias, layer.bias)
