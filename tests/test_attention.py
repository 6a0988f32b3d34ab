"""Attention kernels: the torch reference functions and the CPU kernels against dense causal
attention, and flash-attn against the torch reference.

The oracle is the textbook formula, one sequence at a time: softmax(Q K^T * scale + causal mask) V
with each KV head repeated for its group of query heads, in float64. The causal mask is aligned
to the bottom right, as flash-attn's is: with Lq queries over Lk keys, query i sits at position
Lk - Lq + i. The paged cases scatter each sequence over shuffled blocks, so a kernel that read
blocks in physical order, or past a sequence's length, would be caught.
"""

import pytest
import torch

from nanoengine import cpu_kernels, cpu_library
from nanoengine.torch_attention import flash_attn_varlen_func_torch, flash_attn_with_kvcache_torch
from nanoengine.cpu_kernels import flash_attn_varlen_func_cpu, flash_attn_with_kvcache_cpu
from nanoengine.config import kvcache_block_size

D = 16
SCALE = D ** -0.5
GQA = [(4, 4), (4, 2), (4, 1)]  # (query heads, kv heads)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
                           softcap: float = 0.0) -> torch.Tensor:
    """q [Lq, H, D], k and v [Lk, Hk, D] -> [Lq, H, D], computed naively in float64. With ``window``
    (HF's sliding_window), a query at position p sees only the keys after p - window; with
    ``softcap``, scores s become softcap * tanh(s / softcap)."""
    lq, num_heads = q.shape[:2]
    lk, num_kv_heads = k.shape[:2]
    group = num_heads // num_kv_heads
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    query_pos, key_pos = torch.arange(lq)[:, None] + (lk - lq), torch.arange(lk)[None, :]
    allowed = (key_pos <= query_pos) & (key_pos > query_pos - (window or lk + 1))
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def rand(gen: torch.Generator, *shape: int, device="cpu", dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(device, dtype)


def paged_cache(keys: list[torch.Tensor], values: list[torch.Tensor], block_size: int, gen: torch.Generator,
                extra_columns: int = 0):
    """Scatter each sequence's K/V over shuffled physical blocks; returns the caches
    ``[num_blocks, block_size, Hk, D]`` and an int32 block table padded with block 0, as the
    model runner pads it (``extra_columns`` widens it further, as the graph runner's buffer is)."""
    _, num_kv_heads, head_dim = keys[0].shape
    device, dtype = keys[0].device, keys[0].dtype
    needed = [-(-len(k) // block_size) for k in keys]
    num_blocks = sum(needed) + 2  # a few blocks no sequence owns
    order = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = rand(gen, num_blocks, block_size, num_kv_heads, head_dim, device=device, dtype=dtype)  # garbage elsewhere
    v_cache = rand(gen, num_blocks, block_size, num_kv_heads, head_dim, device=device, dtype=dtype)
    width = max(needed) + extra_columns
    table = torch.zeros(len(keys), width, dtype=torch.int32)
    for i, (k, v) in enumerate(zip(keys, values)):
        blocks = [order.pop() for _ in range(needed[i])]
        table[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for pos in range(len(k)):
            k_cache[blocks[pos // block_size], pos % block_size] = k[pos]
            v_cache[blocks[pos // block_size], pos % block_size] = v[pos]
    return k_cache, v_cache, table.to(device)


def cu_seqlens(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0] + lengths, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)


def attention_options(window: int | None, softcap: float) -> dict:
    """flash-attn's keyword arguments for HF's ``sliding_window`` and a soft cap; none when unused, so
    that the plain cases call each kernel exactly as the Llama path does."""
    return ({"window_size": (window - 1, 0)} if window else {}) | ({"softcap": softcap} if softcap else {})


def varlen_case(lengths: list[tuple[int, int]], heads: tuple[int, int], block_size: int | None,
                device="cpu", dtype=torch.float32, seed: int = 0, head_dim: int = D, window: int | None = None,
                softcap: float = 0.0):
    """A packed prefill: sequence i has ``cached`` tokens already in the cache and ``new`` queries.
    Without a block size (no cached prefix) K/V are packed like q; with one, they come paged."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    keys = [rand(gen, c + n, num_kv_heads, head_dim, device=device, dtype=dtype) for c, n in lengths]
    values = [rand(gen, c + n, num_kv_heads, head_dim, device=device, dtype=dtype) for c, n in lengths]
    queries = [rand(gen, n, num_heads, head_dim, device=device, dtype=dtype) for _, n in lengths]
    kwargs = dict(cu_seqlens_q=cu_seqlens([n for _, n in lengths], device),
                  cu_seqlens_k=cu_seqlens([c + n for c, n in lengths], device),
                  max_seqlen_q=max(n for _, n in lengths), max_seqlen_k=max(c + n for c, n in lengths),
                  softmax_scale=head_dim ** -0.5, causal=True, **attention_options(window, softcap))
    if block_size is None:
        k, v = torch.cat(keys), torch.cat(values)
    else:
        k, v, kwargs["block_table"] = paged_cache(keys, values, block_size, gen)
    expected = torch.cat([dense_causal_attention(*qkv, window, softcap) for qkv in zip(queries, keys, values)])
    return (torch.cat(queries), k, v), kwargs, expected


def decode_case(cache_seqlens: list[int], heads: tuple[int, int], block_size: int, device="cpu",
                dtype=torch.float32, extra_columns: int = 0, seed: int = 0, head_dim: int = D,
                window: int | None = None, softcap: float = 0.0):
    """One query per sequence over ``cache_seqlens[b]`` cached tokens (this step's included)."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    keys = [rand(gen, n, num_kv_heads, head_dim, device=device, dtype=dtype) for n in cache_seqlens]
    values = [rand(gen, n, num_kv_heads, head_dim, device=device, dtype=dtype) for n in cache_seqlens]
    q = rand(gen, len(cache_seqlens), 1, num_heads, head_dim, device=device, dtype=dtype)
    k_cache, v_cache, table = paged_cache(keys, values, block_size, gen, extra_columns)
    kwargs = dict(cache_seqlens=torch.tensor(cache_seqlens, dtype=torch.int32, device=device), block_table=table,
                  softmax_scale=head_dim ** -0.5, causal=True, **attention_options(window, softcap))
    # A row with nothing in its cache (a padded batch row) gives zeros, as in flash-attn.
    expected = torch.stack([dense_causal_attention(q[b], k, v, window, softcap) if len(k)
                            else torch.zeros_like(q[b], dtype=torch.float64)
                            for b, (k, v) in enumerate(zip(keys, values))])
    return (q, k_cache, v_cache), kwargs, expected


MIXED = [(0, 1), (0, 7), (0, 16), (0, 33)]
WITH_PREFIX = [(0, 5), (8, 3), (13, 1), (32, 20), (4, 4)]
ONE_QUERY_EACH = [(5, 1), (16, 1), (0, 1), (40, 1)]  # decodes read through the prefill path (a mixed step)
DECODE_LENGTHS = [1, 5, 17, 0, 40, 16]


def cpu_kernel(fn):
    """A C++ kernel, which must build here: a silent fallback would test the reference twice."""
    assert cpu_library.load("cpu_attention.cpp", D) is not None, "the CPU kernels did not build (is g++ installed?)"
    return fn


@pytest.fixture(params=["torch", "cpu_kernel"])
def prefill_attention(request):
    return flash_attn_varlen_func_torch if request.param == "torch" else cpu_kernel(flash_attn_varlen_func_cpu)


@pytest.fixture(params=["torch", "cpu_kernel"])
def decode_attention(request):
    return flash_attn_with_kvcache_torch if request.param == "torch" else cpu_kernel(flash_attn_with_kvcache_cpu)


# Packed K/V (no block table), then a cached prefix read back from paged caches of several block
# sizes. MIXED's 33-token prompt spans three of the kernel's 16-row tiles per kv head.
@pytest.mark.parametrize("lengths, block_size", [(MIXED, None)] + [(WITH_PREFIX, bs) for bs in (4, 16, 256)]
                         + [(ONE_QUERY_EACH, bs) for bs in (4, 16)])
@pytest.mark.parametrize("heads", GQA)
def test_varlen_matches_dense_causal_per_sequence(prefill_attention, lengths, block_size, heads):
    args, kwargs, expected = varlen_case(lengths, heads, block_size)
    out = prefill_attention(*args, **kwargs)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


# Mistral's sliding window (here of 5 and 16 keys, within and across blocks and the kernel's tiles)
# and Gemma 2's soft cap (scores of random q, k reach about 4: a cap of 2 squashes them hard).
WINDOWS_AND_CAPS = [(5, 0.0), (16, 0.0), (None, 2.0), (5, 2.0)]


@pytest.mark.parametrize("window, softcap", WINDOWS_AND_CAPS)
@pytest.mark.parametrize("lengths, block_size", [(MIXED, None), (WITH_PREFIX, 4), (ONE_QUERY_EACH, 16)])
def test_varlen_with_sliding_window_and_softcap_matches_dense(prefill_attention, lengths, block_size, window,
                                                              softcap):
    args, kwargs, expected = varlen_case(lengths, (4, 2), block_size, window=window, softcap=softcap)
    torch.testing.assert_close(prefill_attention(*args, **kwargs).double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window, softcap", WINDOWS_AND_CAPS)
@pytest.mark.parametrize("threads", [1, 8])  # 8: a stretch of blocks per task, some left of the window
def test_decode_with_sliding_window_and_softcap_matches_dense(decode_attention, window, softcap, threads):
    args, kwargs, expected = decode_case(DECODE_LENGTHS, (4, 2), 4, window=window, softcap=softcap)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = decode_attention(*args, **kwargs)
        single = decode_attention(args[0][4:5], *args[1:], **kwargs | {
            "cache_seqlens": kwargs["cache_seqlens"][4:5], "block_table": kwargs["block_table"][4:5]})
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(single.double(), expected[4:5], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_cpu_kernels_window_and_softcap_at_head_size_64(dtype, tol):
    """bf16 at head size 64: where the CPU has AVX512-BF16 decode and AMX prefill, the window and the
    cap must reach them too (AMX prefill hands such layers to the generic kernel)."""
    assert cpu_library.load("cpu_attention.cpp", 64) is not None
    args, kwargs, expected = varlen_case(WITH_PREFIX + [(0, 70)], (4, 2), 16, dtype=dtype, head_dim=64, window=9,
                                         softcap=3.0)
    torch.testing.assert_close(flash_attn_varlen_func_cpu(*args, **kwargs).double(), expected, atol=tol, rtol=tol)
    args, kwargs, expected = decode_case([1, 16, 0, 77], (4, 2), 16, dtype=dtype, head_dim=64, window=9, softcap=3.0)
    torch.testing.assert_close(flash_attn_with_kvcache_cpu(*args, **kwargs).double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("attention", [flash_attn_varlen_func_torch, flash_attn_varlen_func_cpu])
def test_a_right_window_is_a_value_error(attention):
    args, kwargs, _ = varlen_case(MIXED, (4, 2), None)
    with pytest.raises(ValueError, match="window_size"):
        attention(*args, **kwargs | {"causal": False, "window_size": (4, 4)})


@pytest.mark.parametrize("block_size", [4, 16, 256])
@pytest.mark.parametrize("heads", GQA)
def test_decode_with_kvcache_matches_dense_and_zeroes_empty_rows(decode_attention, block_size, heads):
    args, kwargs, expected = decode_case(DECODE_LENGTHS, heads, block_size)
    out = decode_attention(*args, **kwargs)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[3], torch.zeros_like(out[3]))


# Where the CPU has AMX, bf16 prefill at a head size that is a multiple of 64 runs on its tiles
# (prefill_head_amx), with rows of (query, head of the group) pairs, 16 to a tile, and keys 64 at a
# time: every group size, cached prefixes read from blocks of 4 and 16, and a prompt of 300.
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads", GQA + [(9, 3)])
def test_bf16_prefill_at_head_size_64_for_each_group_size(heads, block_size):
    assert cpu_library.load("cpu_attention.cpp", 64) is not None
    args, kwargs, expected = varlen_case(WITH_PREFIX + [(0, 300), (70, 50)], heads, block_size,
                                         dtype=torch.bfloat16, head_dim=64)
    torch.testing.assert_close(flash_attn_varlen_func_cpu(*args, **kwargs).double(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("lengths", [[17], [5, 0, 40], [3], [0], [300]])
@pytest.mark.parametrize("heads", GQA + [(9, 3)])
def test_decode_with_fewer_sequences_than_threads_splits_by_kv_head_and_blocks(heads, lengths, dtype, tol):
    """A single chat stream: the kernel gives each (sequence, kv head, stretch of blocks) its own
    task and merges the stretches by their softmax sums, same result. With 8 threads and blocks of
    4, [3] leaves every split but the first without keys, and [0] is a padded row."""
    args, kwargs, expected = decode_case(lengths, heads, block_size=4, dtype=dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(8)  # more threads than sequences on any machine
    try:
        out = cpu_kernel(flash_attn_with_kvcache_cpu)(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def test_decode_ignores_block_table_columns_past_each_length(decode_attention):
    """The graph runner's block table is as wide as the longest possible sequence."""
    args, kwargs, expected = decode_case(DECODE_LENGTHS, (4, 2), block_size=4, extra_columns=5)
    out = decode_attention(*args, **kwargs)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


# SmolLM2's shape (9 query heads over 3 kv heads, head_dim 64), a larger head, and one that is not a
# multiple of 16 (the prefill kernel's value vectors get narrower), in bf16 and float32.
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])  # bf16 rounds the output
@pytest.mark.parametrize("head_dim", [64, 128, 24])
def test_cpu_kernels_at_model_head_sizes(head_dim, dtype, tol):
    assert cpu_library.load("cpu_attention.cpp", head_dim) is not None
    prefill = [(0, 40), (0, 1), (100, 20), (16, 3)]
    args, kwargs, expected = varlen_case(prefill, (9, 3), None, dtype=dtype, head_dim=head_dim)
    out = flash_attn_varlen_func_cpu(*args, **kwargs)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    args, kwargs, expected = varlen_case(prefill, (9, 3), 16, dtype=dtype, head_dim=head_dim)
    torch.testing.assert_close(flash_attn_varlen_func_cpu(*args, **kwargs).double(), expected, atol=tol, rtol=tol)
    args, kwargs, expected = decode_case([1, 16, 0, 300, 77], (9, 3), 16, dtype=dtype, head_dim=head_dim)
    out = flash_attn_with_kvcache_cpu(*args, **kwargs)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def test_cpu_kernels_without_a_compiler_fall_back_to_torch_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built earlier to find
    cpu_library.load.cache_clear()
    try:
        args, kwargs, expected = decode_case(DECODE_LENGTHS, (4, 2), block_size=4)
        with pytest.warns(UserWarning, match="could not build the CPU kernels in cpu_attention.cpp"):
            out = flash_attn_with_kvcache_cpu(*args, **kwargs)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
        args, kwargs, expected = varlen_case(WITH_PREFIX, (4, 2), block_size=4)
        out = flash_attn_varlen_func_cpu(*args, **kwargs)  # warned once already; falls back silently
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    finally:
        cpu_library.load.cache_clear()


def test_flash_attn_block_size_must_be_a_multiple_of_256_and_others_default_to_16():
    assert kvcache_block_size(None, "flash-attn") == 256 and kvcache_block_size(512, "flash-attn") == 512
    for kernels in ("triton", "cpu", "torch"):
        assert kvcache_block_size(None, kernels) == 16 and kvcache_block_size(4, kernels) == 4
    with pytest.raises(ValueError, match="multiple of 256"):
        kvcache_block_size(16, "flash-attn")


# -- flash-attn itself, on a GPU --------------------------------------------------------------------

BF16_TOL = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture
def flash_attn():
    return pytest.importorskip("flash_attn")


@pytest.mark.cuda
@pytest.mark.parametrize("heads", GQA)
def test_flash_attn_varlen_matches_torch_reference(flash_attn, heads):
    args, kwargs, _ = varlen_case(MIXED, heads, None, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(flash_attn.flash_attn_varlen_func(*args, **kwargs),
                               flash_attn_varlen_func_torch(*args, **kwargs), **BF16_TOL)


@pytest.mark.cuda
@pytest.mark.parametrize("heads", GQA)
def test_flash_attn_varlen_with_paged_prefix_matches_torch_reference(flash_attn, heads):
    lengths = [(0, 5), (256, 3), (300, 1), (512, 200)]
    args, kwargs, _ = varlen_case(lengths, heads, 256, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(flash_attn.flash_attn_varlen_func(*args, **kwargs),
                               flash_attn_varlen_func_torch(*args, **kwargs), **BF16_TOL)


@pytest.mark.cuda
@pytest.mark.parametrize("heads", GQA)
def test_flash_attn_with_kvcache_matches_torch_reference(flash_attn, heads):
    args, kwargs, _ = decode_case([1, 255, 256, 0, 700], heads, 256, device="cuda", dtype=torch.bfloat16,
                                  extra_columns=2)
    torch.testing.assert_close(flash_attn.flash_attn_with_kvcache(*args, **kwargs),
                               flash_attn_with_kvcache_torch(*args, **kwargs), **BF16_TOL)


# -- Attention.forward end to end, on a GPU: Triton store + flash-attn or Triton attention against torch --

def attention_step(kernels: str, ctx_kwargs: dict, slots: list[int], num_tokens: int, heads: tuple[int, int],
                   seed: int = 0):
    """Run one ``Attention.forward`` with a CUDA backend and with the torch reference backend on
    copies of the same bf16 paged cache (blocks of 256, random contents standing in for earlier
    steps); returns (output, reference output, cache, reference cache)."""
    from nanoengine.attention import Attention, AttentionBackend, get_backend
    from nanoengine.context import Context
    from nanoengine.store_kvcache import store_kvcache_torch
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    q, k, v = (rand(gen, num_tokens, n, 64, device="cuda", dtype=torch.bfloat16)
               for n in (num_heads, num_kv_heads, num_kv_heads))
    cache = rand(gen, 2, 4, 256, num_kv_heads, 64, device="cuda", dtype=torch.bfloat16)
    ctx = Context(slot_mapping=torch.tensor(slots, dtype=torch.int64, device="cuda"),
                  **{name: torch.tensor(value, dtype=torch.int32, device="cuda") if isinstance(value, list) else value
                     for name, value in ctx_kwargs.items()})
    reference = AttentionBackend(store_kvcache_torch, flash_attn_varlen_func_torch, flash_attn_with_kvcache_torch)
    results = []
    for backend, kv in ((get_backend(kernels, torch.device("cuda")), cache), (reference, cache.clone())):
        layer = Attention(num_heads, num_kv_heads, 64)
        layer.backend, layer.k_cache, layer.v_cache = backend, kv[0], kv[1]
        results.append((layer(q, k, v, ctx), kv))
    (out, kv), (expected, expected_kv) = results
    return out, expected, kv, expected_kv


# Sequence 0 starts in block 0; sequence 1 owns blocks 1 and 2, and with a cached prefix its first
# 256 tokens are already in block 1.
PREFILL = dict(is_prefill=True, cu_seqlens_q=[0, 5, 8], cu_seqlens_k=[0, 5, 8], max_seqlen_q=5, max_seqlen_k=5)
PREFILL_WITH_PREFIX = dict(is_prefill=True, cu_seqlens_q=[0, 5, 8], cu_seqlens_k=[0, 5, 264], max_seqlen_q=5,
                           max_seqlen_k=259, block_tables=[[0, 0], [1, 2]])
DECODE = dict(is_prefill=False, context_lens=[6, 260, 0], block_tables=[[0, 0], [1, 2], [0, 0]])


@pytest.mark.cuda
@pytest.mark.parametrize("heads", GQA)
@pytest.mark.parametrize("ctx, slots", [
    (PREFILL, [0, 1, 2, 3, 4, 256, 257, 258]),
    (PREFILL_WITH_PREFIX, [0, 1, 2, 3, 4, 512, 513, 514]),
    (DECODE, [5, 515, -1]),  # the third row is a padded graph row: no slot, no context
], ids=["prefill", "prefill_with_cached_prefix", "decode"])
@pytest.mark.parametrize("kernels", ["flash-attn", "triton"])
def test_cuda_attention_forward_matches_torch_backend(kernels, ctx, slots, heads):
    if kernels == "flash-attn":
        pytest.importorskip("flash_attn")
    out, expected, kv, expected_kv = attention_step(kernels, ctx, slots, len(slots), heads)
    torch.testing.assert_close(out, expected, **BF16_TOL)
    assert torch.equal(kv, expected_kv)  # the Triton store wrote exactly the reference's bytes


def strided_view(q: torch.Tensor) -> torch.Tensor:
    """q's values, with its tokens further apart: a view into a wider tensor, as q is a view into the
    qkv projection's output. The gaps hold NaN, so a kernel that read them would show it."""
    tokens = q.shape[0]
    wide = torch.cat([q.reshape(tokens, -1), torch.full((tokens, 3 * D), float("nan"), dtype=q.dtype)], dim=1)
    return wide[:, :q[0].numel()].view(q.shape)


def test_cpu_kernels_read_q_through_its_token_stride():
    assert cpu_library.load("cpu_attention.cpp", D) is not None
    args, kwargs, expected = varlen_case(WITH_PREFIX, (4, 2), 4)
    q = strided_view(args[0])
    assert not q.is_contiguous()
    out = flash_attn_varlen_func_cpu(q, *args[1:], **kwargs)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    args, kwargs, expected = decode_case(DECODE_LENGTHS, (4, 2), 4)
    out = flash_attn_with_kvcache_cpu(strided_view(args[0]), *args[1:], **kwargs)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


# The bf16 decode kernel for CPUs with AVX512-BF16 (head sizes that are a multiple of 32) reads
# 16 tokens at a time, crossing blocks of 4, and sums values in pairs of tokens (odd lengths).
@pytest.mark.parametrize("block_size", [4, 16, 256])
@pytest.mark.parametrize("heads", GQA + [(9, 3)])
def test_bf16_decode_kernel_across_blocks_and_odd_lengths(block_size, heads):
    assert cpu_library.load("cpu_attention.cpp", 64) is not None
    args, kwargs, expected = decode_case([1, 2, 15, 16, 33, 0, 100, 47], heads, block_size, extra_columns=2,
                                         dtype=torch.bfloat16, head_dim=64)
    out = flash_attn_with_kvcache_cpu(strided_view(args[0]), *args[1:], **kwargs)
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)  # bf16 output and probabilities
