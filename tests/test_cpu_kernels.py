"""The CPU kernels' boundary: a bad input is a ValueError naming the argument, never a crash or a
silent overwrite, and loading the kernels changes nothing else in the process.

Every case starts from valid inputs (checked to run) and breaks one thing. The checks run before
the C++ is loaded, so the linear kernel's are tested on CPUs that cannot build it too.
"""

import ctypes
import subprocess
import sys
import textwrap

import pytest
import torch

from nanoengine import cpu_kernels, cpu_library

BF16 = torch.bfloat16
NUM_BLOCKS, BLOCK_SIZE, HEADS, KV_HEADS, D = 4, 4, 4, 2, 16


def cache():
    return torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, D, dtype=BF16)


def store(key=None, slots=None, k_cache=None, value=None):
    key = torch.randn(3, KV_HEADS, D, dtype=BF16) if key is None else key
    value = key.clone() if value is None else value
    slots = torch.tensor([0, -1, 5]) if slots is None else slots
    return cpu_kernels.store_kvcache_cpu(key, value, cache() if k_cache is None else k_cache, cache(), slots)


def decode(q=None, seqlens=None, table=None, k_cache=None):
    q = torch.randn(2, 1, HEADS, D, dtype=BF16) if q is None else q
    seqlens = torch.tensor([3, 8], dtype=torch.int32) if seqlens is None else seqlens
    table = torch.tensor([[1, 0], [2, 3]], dtype=torch.int32) if table is None else table
    return cpu_kernels.flash_attn_with_kvcache_cpu(q, cache() if k_cache is None else k_cache, cache(), seqlens,
                                                   table, causal=True)


def prefill(cu_q=(0, 2, 5), cu_k=(0, 2, 5), max_k=3, table=None, heads=HEADS):
    k = cache() if table is not None else torch.randn(cu_k[-1], KV_HEADS, D, dtype=BF16)
    q = torch.randn(5, heads, D, dtype=BF16)
    cu_q, cu_k = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    return cpu_kernels.flash_attn_varlen_func_cpu(q, k, k.clone(), cu_q, cu_k, 3, max_k, causal=True,
                                                  block_table=table)


def norm(x=None, residual=None, weight=None):
    x = torch.randn(3, 32, dtype=BF16) if x is None else x
    return cpu_kernels.add_rms_norm(x, residual, torch.ones(32, dtype=BF16) if weight is None else weight, 1e-6)


def rotary(positions=None, k=None, cos_sin_cache=None):
    positions = torch.tensor([0, 9]) if positions is None else positions
    table = torch.randn(10, 2 * D) if cos_sin_cache is None else cos_sin_cache
    k = torch.randn(2, KV_HEADS, D, dtype=BF16) if k is None else k
    return cpu_kernels.rotary(positions, torch.randn(2, HEADS, D, dtype=BF16), k, table)


def linear(x=None, packed=None, bias=None):
    x = torch.randn(3, 64, dtype=BF16) if x is None else x
    packed = cpu_kernels.pack_linear_weight(torch.randn(40, 64, dtype=BF16)) if packed is None else packed
    return cpu_kernels.linear(x, packed, bias, 40)


def test_the_valid_inputs_run():
    store(), decode(), prefill(), prefill(table=torch.tensor([[0, 1], [2, 3]])), norm(), rotary()
    cpu_kernels.silu_and_mul(torch.randn(3, 8))


BAD_INPUTS = {
    "store: a float32 key into a bf16 cache": (lambda: store(key=torch.randn(3, KV_HEADS, D)), "key has dtype"),
    "store: a slot past the cache": (lambda: store(slots=torch.tensor([0, 1, 64])), "slot_mapping holds values"),
    "store: a slot below -1": (lambda: store(slots=torch.tensor([0, -2, 1])), "slot_mapping holds values"),
    "store: float slots": (lambda: store(slots=torch.zeros(3)), "slot_mapping has dtype"),
    "store: a slot per token": (lambda: store(slots=torch.tensor([0, 1])), "slot_mapping has shape"),
    "store: value unlike key": (lambda: store(value=torch.randn(3, KV_HEADS, 8, dtype=BF16)), "value has shape"),
    "store: a key not on the CPU": (lambda: store(key=torch.empty(3, KV_HEADS, D, dtype=BF16, device="meta")),
                                    "key is on meta"),
    "decode: a length past the block table": (lambda: decode(seqlens=torch.tensor([3, 9])),
                                              "cache_seqlens holds values"),
    "decode: a negative length": (lambda: decode(seqlens=torch.tensor([-1, 3])), "cache_seqlens holds values"),
    "decode: a block past the cache": (lambda: decode(table=torch.tensor([[1, 0], [2, 4]])),
                                       "block_table holds values"),
    "decode: a negative block": (lambda: decode(table=torch.tensor([[-1, 0], [2, 3]])), "block_table holds values"),
    "decode: a row per sequence": (lambda: decode(table=torch.tensor([[1, 0]])), "block_table has shape"),
    "decode: a cache of another dtype": (lambda: decode(k_cache=cache().float()), "k_cache has dtype"),
    "decode: q not on the CPU": (lambda: decode(q=torch.empty(2, 1, HEADS, D, dtype=BF16, device="meta")),
                                 "q is on meta"),
    "decode: one length per sequence": (lambda: decode(seqlens=torch.tensor([3])), "cache_seqlens has shape"),
    "prefill: decreasing cu_seqlens": (lambda: prefill(cu_q=(0, 3, 2, 5), cu_k=(0, 3, 3, 5)), "must not decrease"),
    "prefill: more queries than keys": (lambda: prefill(cu_k=(0, 1, 5)), "more queries than keys"),
    "prefill: cu_seqlens_q not ending at q's tokens": (lambda: prefill(cu_q=(0, 2, 4)), "cu_seqlens_q must run"),
    "prefill: a length past max_seqlen_k": (lambda: prefill(max_k=2), "cu_seqlens_k.s lengths holds values"),
    "prefill: a length past the block table": (
        lambda: prefill(cu_k=(0, 2, 12), table=torch.tensor([[0, 1], [2, 3]])), "cu_seqlens_k holds values"),
    "prefill: a block past the cache": (lambda: prefill(table=torch.tensor([[0, 1], [2, 7]])),
                                        "block_table holds values"),
    "prefill: heads that do not share kv heads": (lambda: prefill(heads=3), "kv heads"),
    "add_rms_norm: a residual of another shape": (lambda: norm(residual=torch.zeros(2, 32, dtype=BF16)),
                                                  "residual has shape"),
    "add_rms_norm: a non-contiguous residual": (lambda: norm(residual=torch.zeros(32, 3, dtype=BF16).T),
                                                "residual must be contiguous"),
    "add_rms_norm: a weight of another size": (lambda: norm(weight=torch.ones(16, dtype=BF16)), "weight has shape"),
    "add_rms_norm: a float16 x": (lambda: norm(x=torch.randn(3, 32, dtype=torch.float16)), "x has dtype"),
    "silu_and_mul: an odd width": (lambda: cpu_kernels.silu_and_mul(torch.randn(3, 7)), "must be even"),
    "silu_and_mul: integers": (lambda: cpu_kernels.silu_and_mul(torch.ones(3, 8, dtype=torch.int64)), "x has dtype"),
    "rotary: a position past the table": (lambda: rotary(positions=torch.tensor([0, 10])), "positions holds values"),
    "rotary: a negative position": (lambda: rotary(positions=torch.tensor([-1, 0])), "positions holds values"),
    "rotary: k with other tokens": (lambda: rotary(k=torch.randn(3, KV_HEADS, D, dtype=BF16)), "k has shape"),
    "rotary: a bf16 table": (lambda: rotary(cos_sin_cache=torch.randn(10, 2 * D, dtype=BF16)),
                             "cos_sin_cache has dtype"),
    "linear: a float32 x": (lambda: linear(x=torch.randn(3, 64)), "x has dtype"),
    "linear: a weight packed for other sizes": (
        lambda: linear(packed=cpu_kernels.pack_linear_weight(torch.randn(40, 32, dtype=BF16))),
        "packed_weight has shape"),
    "linear: a bias of another size": (lambda: linear(bias=torch.zeros(39, dtype=BF16)), "bias has shape"),
    "pack_linear_weight: an odd number of inputs": (
        lambda: cpu_kernels.pack_linear_weight(torch.randn(40, 63, dtype=BF16)), "even number"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_a_bad_input_is_a_value_error_naming_the_argument(case):
    call, message = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=message):
        call()


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600)


def test_the_inputs_that_used_to_crash_the_interpreter_now_raise():
    """Before the checks, the first read far outside the cache (a segfault), the second overwrote the
    neighbouring slot, the third read past the rotary table."""
    result = run_python("""
        import torch
        from nanoengine import cpu_kernels
        cache = torch.zeros(4, 4, 2, 16, dtype=torch.bfloat16)
        calls = [
            lambda: cpu_kernels.flash_attn_with_kvcache_cpu(torch.randn(1, 1, 4, 16, dtype=torch.bfloat16), cache,
                                                            cache, torch.tensor([10**8], dtype=torch.int32),
                                                            torch.tensor([[0]], dtype=torch.int32)),
            lambda: cpu_kernels.store_kvcache_cpu(torch.randn(1, 2, 16), torch.randn(1, 2, 16), cache, cache,
                                                  torch.tensor([0])),
            lambda: cpu_kernels.rotary(torch.tensor([10**9]), torch.randn(1, 4, 16), torch.randn(1, 2, 16),
                                       torch.randn(8, 32)),
        ]
        for call in calls:
            try:
                call()
            except ValueError as e:
                print("ValueError:", e)
        print("survived")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("ValueError:") == 3 and result.stdout.endswith("survived\n"), result.stdout


def test_loading_the_kernels_keeps_denormals_in_python_and_numpy(tiny_models):
    """A library linked with -ffast-math would turn on flush-to-zero for the whole process."""
    result = run_python(f"""
        import sys, warnings
        import numpy as np
        from nanoengine import LLM, cpu_library
        warnings.simplefilter("ignore")  # a CPU without AVX512-BF16 cannot build cpu_linear.cpp
        LLM({tiny_models["llama"]!r}, dtype="bfloat16", num_kvcache_blocks=8)
        loaded = [cpu_library.load(source, 64 if source == "cpu_attention.cpp" else None)
                  for source in cpu_library.SIGNATURES]
        assert loaded[0] is not None and loaded[1] is not None, loaded
        assert 5e-324 * 1.0 != 0 and sys.float_info.min / 2 > 0
        assert np.float64(5e-324) * 1.0 != 0 and np.finfo(np.float32).tiny / np.float32(2) > 0
        print("denormals survive")
    """)
    assert result.returncode == 0 and "denormals survive" in result.stdout, result.stderr


def test_every_entry_point_has_its_argument_types_declared():
    library = cpu_library.load("cpu_layers.cpp")
    assert library.silu_and_mul_float32.function.argtypes is not None
    with pytest.raises(ctypes.ArgumentError):  # ctypes itself refuses a tensor where it wants a pointer
        library.silu_and_mul_float32(torch.zeros(2), None, 1, 1, 1)
