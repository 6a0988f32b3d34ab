"""The decoder's small layers in Triton (triton_layers.py) against the torch code they replace.

The kernels run on CPU tensors under Triton's interpreter (everywhere) and compiled on a GPU
(marked ``cuda``): conftest's ``triton_device``. The torch code is HF's arithmetic, each op rounded
to the activation dtype, so on a GPU the kernels must agree with it to the last bit (rotary), or
within a rounding step or two where a float32 sum is taken in another order or ``rsqrt`` and
``exp`` are other implementations, and the residual sums they write must be identical. Triton's
interpreter truncates a cast to bf16 where a GPU (and torch) rounds to nearest, so there each bf16
rounding may land one step lower: in bf16 the CPU runs allow that, and float32 (no cast) is held as
tightly as on the GPU. Sizes are small: the interpreter is slow.
"""

import pytest
import torch

from nanoengine.activation import SiluAndMul
from nanoengine.layernorm import RMSNorm
from nanoengine.rotary_embedding import RotaryEmbedding

ULP = {torch.bfloat16: 2 ** -7, torch.float32: 1e-5}  # bf16: one rounding step, relative


def steps(device: str, dtype: torch.dtype, on_gpu: int, roundings: int) -> int:
    """Rounding steps the kernel may sit from torch: ``on_gpu`` on a GPU, plus one for each of its
    ``roundings`` bf16 casts under the interpreter, which truncates."""
    return on_gpu + (roundings if device == "cpu" and dtype == torch.bfloat16 else 0)


@pytest.fixture
def device(triton_device) -> str:
    return triton_device


@pytest.fixture
def triton_layers():
    from nanoengine import triton_layers
    return triton_layers


def norm_pair(dtype, hidden_size, device, kernel):
    torch.manual_seed(0)
    reference = RMSNorm(hidden_size, 1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        reference.weight.copy_(1 + 0.2 * torch.randn(hidden_size))
    fused = RMSNorm(hidden_size, 1e-6).to(device=device, dtype=dtype)
    fused.load_state_dict(reference.state_dict())
    fused.kernel = kernel
    return reference, fused


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 576)])  # 576: a row masked up to 1024
def test_add_rms_norm_matches_torch_with_and_without_a_residual(device, triton_layers, dtype, rows, hidden):
    reference, fused = norm_pair(dtype, hidden, device, triton_layers.add_rms_norm)
    x = torch.randn(rows, hidden).to(device=device, dtype=dtype)
    residual = (3 * torch.randn(rows, hidden)).to(device=device, dtype=dtype)
    # The normalised row may round one step apart (the sum's order and rsqrt are the GPU's), which the
    # weight's product can carry to two; under the interpreter, two casts more.
    rtol = steps(device, dtype, 2, 2) * ULP[dtype]
    torch.testing.assert_close(fused(x), reference(x), atol=0, rtol=rtol)
    expected_out, expected_sum = reference(x, residual.clone())
    kernel_residual = residual.clone()
    out, new_residual = fused(x, kernel_residual)
    torch.testing.assert_close(new_residual, expected_sum, atol=0, rtol=steps(device, dtype, 0, 1) * ULP[dtype])
    assert new_residual.data_ptr() == kernel_residual.data_ptr()  # written in place, as vLLM's op does
    torch.testing.assert_close(out, expected_out, atol=0, rtol=steps(device, dtype, 2, 3) * ULP[dtype])


def test_add_rms_norm_on_heads_of_a_strided_view(device, triton_layers):
    """Qwen3 normalises each query head: a [tokens, heads, head_dim] view into the fused qkv output."""
    reference, fused = norm_pair(torch.bfloat16, 32, device, triton_layers.add_rms_norm)
    qkv = torch.randn(5, 4 * 32 + 64).to(device=device, dtype=torch.bfloat16)
    q = qkv[:, :4 * 32].view(5, 4, 32)
    out = fused(q)
    assert out.shape == q.shape and out.is_contiguous()
    rtol = steps(device, torch.bfloat16, 2, 2) * ULP[torch.bfloat16]
    torch.testing.assert_close(out, reference(q), atol=0, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,width", [(3, 1536), (2, 100)])  # 1536: two column blocks, the second masked
def test_silu_and_mul_matches_torch(device, triton_layers, dtype, rows, width):
    x = (4 * torch.randn(rows, 2 * width)).to(device=device, dtype=dtype)
    fused = SiluAndMul()
    fused.kernel = triton_layers.silu_and_mul
    # The kernel's exp is not torch's: SiLU may round one step apart, which the product can carry up to two.
    torch.testing.assert_close(fused(x), SiluAndMul()(x), atol=1e-6, rtol=steps(device, dtype, 2, 2) * ULP[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 80])  # 80: a head masked up to 128, its halves meeting at 40
def test_rotary_matches_torch_on_views_into_the_qkv_output(device, triton_layers, dtype, head_dim):
    """The kernel reads q and k inside the fused qkv tensor, writes new tensors, and leaves qkv alone."""
    torch.manual_seed(0)
    with torch.device(device):
        reference, fused = RotaryEmbedding(head_dim, 512, 10000.0), RotaryEmbedding(head_dim, 512, 10000.0)
        fused.kernel = triton_layers.rotary
        tokens, heads, kv_heads = 6, 9, 3  # 9: heads masked up to 16
        positions = torch.randint(0, 512, (tokens,))
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    qkv_before = qkv.clone()

    def views(t):
        q, k, _ = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)

    expected_q, expected_k = reference(positions, *views(qkv.clone()))
    q, k = fused(positions, *views(qkv))
    # The same roundings in the same order, with no FMA (the kernel is launched without FP fusion), so
    # the same bits; but interpreted in bf16 the two products and their sum are each truncated, a step
    # of the larger term at most each.
    exact = device == "cuda" or dtype == torch.float32
    tol = dict(atol=0, rtol=0) if exact else dict(atol=3 * ULP[dtype] * qkv.abs().max().item(), rtol=0)
    torch.testing.assert_close(q, expected_q, **tol)
    torch.testing.assert_close(k, expected_k, **tol)
    assert torch.equal(qkv, qkv_before)


def test_empty_inputs_launch_nothing(device, triton_layers):
    """A step can bring no rows to a layer (an empty slice): each kernel returns an empty result."""
    x = torch.empty(0, 64, device=device)
    assert triton_layers.add_rms_norm(x, None, torch.ones(64, device=device), 1e-6).shape == (0, 64)
    assert triton_layers.silu_and_mul(torch.empty(0, 128, device=device)).shape == (0, 64)
    q = torch.empty(0, 4, 64, device=device)
    assert triton_layers.rotary(torch.empty(0, dtype=torch.long, device=device), q, q,
                                torch.zeros(8, 128, device=device))[0].shape == (0, 4, 64)


@pytest.mark.cuda
def test_cuda_model_runner_binds_the_triton_layers(tiny_models):
    from nanoengine import LLM, triton_layers
    llm = LLM(tiny_models["qwen3"], device="cuda", attention_backend="triton", num_kvcache_blocks=8, enforce_eager=True)
    modules = list(llm.model_runner.model.modules())
    norms = [m for m in modules if isinstance(m, RMSNorm)]
    assert norms and all(m.kernel is triton_layers.add_rms_norm for m in norms)
    assert all(m.kernel is triton_layers.silu_and_mul for m in modules if isinstance(m, SiluAndMul))
    assert [m.kernel for m in modules if isinstance(m, RotaryEmbedding)] == [triton_layers.rotary]
