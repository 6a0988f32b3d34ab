"""nanoengine's CPU kernels as Python functions: each checks its inputs, then calls the C++.

On CUDA, attention is flash-attn's or the Triton kernels' (triton_attention.py). On CPU, pure
torch has no way to read the paged cache in place for decode (the gather it needs instead roughly
triples the step's memory traffic), torch's SDPA is slow at prefill's short prompts
(cpu_attention.cpp), the decoder's element-wise ops cost more to launch than to compute at decode
batch sizes (cpu_layers.cpp), torch's bf16 matmul reads a decode step's weights slower than
memory allows (cpu_linear.cpp), and nothing in torch reads quantized weights at the speed their
bytes allow (cpu_quantized_linear.cpp). cpu_library.py builds and loads them.

C++ trusts every pointer and size it is handed, so every argument is checked before the work,
where it is cheapest to check: metadata (device, dtype, shape, strides) here, as it is a few
attribute reads; index values (slots, positions, block-table entries, sequence lengths), a wrong
one of which would read or write outside a tensor, in a pre-pass of the kernel itself, as they
are data (from Python each tensor would cost a reduction and a sync, per layer per step; in C++
a few integer compares per sequence). A kernel that finds a bad index changes nothing and
returns an error code, which its wrapper turns into a ``ValueError`` naming the argument. Where
a torch fallback runs instead, the same ranges are checked here, off the hot path.

An 8-bit cache (kv_cache_dtype.py) has kernels of its own, named for the queries' dtype and the
cache's (``decode_bfloat16_fp8_e4m3``); the layer's ``k_descale`` is folded into the softmax scale
here, and ``v_descale`` is applied to each output by the kernel.
"""

import torch
import torch.nn.functional as F

from nanoengine import quantization
from nanoengine.cpu_library import load
from nanoengine.kv_cache_dtype import FP8_DTYPES, inverse_scale
from nanoengine.store_kvcache import store_kvcache_torch
from nanoengine.torch_attention import flash_attn_varlen_func_torch, flash_attn_with_kvcache_torch, window_left

DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}  # a kernel for each
_FLOATS = tuple(DTYPES)
_ATTENTION_FLOATS = (*DTYPES, torch.float16)  # float16 goes to the torch reference
_INDEX = (torch.int32, torch.int64)
_FP8_NAMES = {torch.float8_e4m3fn: "_fp8_e4m3", torch.float8_e5m2: "_fp8_e5m2"}


def _kernel_name(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> str:
    """The suffix of the kernel for queries of ``q_dtype`` over a cache of ``cache_dtype``."""
    return DTYPES[q_dtype] + _FP8_NAMES.get(cache_dtype, "")


def _check(name: str, t: torch.Tensor, dtypes: tuple, shape: tuple) -> None:
    """A ValueError naming ``name`` unless t is a CPU tensor of one of ``dtypes`` and of ``shape``
    (None in it matches any size). Written for speed: it runs a few hundred times a step."""
    if isinstance(t, torch.Tensor) and t.is_cpu and t.dtype in dtypes and t.dim() == len(shape):
        for expected, size in zip(shape, t.shape):
            if expected is not None and expected != size:
                break
        else:
            return
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise ValueError(f"{name} is on {t.device}: the CPU kernels take CPU tensors")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}, expected {' or '.join(map(str, dtypes))}")
    expected = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
    raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {expected}")


def _range_error(name: str, low: int, high: int, why: str) -> ValueError:
    return ValueError(f"{name} holds values outside [{low}, {high}): {why}")


def _check_range(name: str, t: torch.Tensor, low: int, high: int, why: str) -> None:
    """For the torch fallbacks: a ValueError unless every value of t lies in [low, high)."""
    if t.numel():
        lo, hi = torch.aminmax(t)
        if lo.item() < low or hi.item() >= high:
            raise _range_error(name, low, high, why)


def _block_table_error(code: int, block_table: torch.Tensor, k_cache: torch.Tensor, seqlens_name: str) -> ValueError:
    """An attention kernel's error ``code``, or the same check in Python: a block-table entry (2) or
    a sequence length (3) out of range."""
    num_blocks, block_size = k_cache.shape[:2]
    if code == 2:
        return _range_error("block_table", 0, num_blocks, f"the cache has {num_blocks} blocks")
    return _range_error(seqlens_name, 0, block_table.shape[1] * block_size + 1,
                        "beyond the tokens that the block table's rows cover")


def _check_block_table(block_table: torch.Tensor, seqlens: torch.Tensor, k_cache: torch.Tensor,
                       seqlens_name: str) -> None:
    """For the torch fallbacks, what the attention kernels check themselves."""
    num_blocks, block_size = k_cache.shape[:2]
    for code, t, high in ((2, block_table, num_blocks), (3, seqlens, block_table.shape[1] * block_size + 1)):
        if t.numel() and not (0 <= t.min().item() and t.max().item() < high):
            raise _block_table_error(code, block_table, k_cache, seqlens_name)


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, dtypes: tuple, head_dim: int | None) -> None:
    """Paged caches ``[num_blocks, block_size, num_kv_heads, head_dim]``, K and V alike; of one of
    ``dtypes``, or 8-bit."""
    dtypes = (*dtypes, *FP8_DTYPES)
    _check("k_cache", k_cache, dtypes, (None, None, None, head_dim))
    _check("v_cache", v_cache, (k_cache.dtype,), tuple(k_cache.shape))


def _check_heads(num_heads: int, num_kv_heads: int) -> None:
    if not num_kv_heads or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} kv heads: not a multiple")


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x ``[..., heads, head_dim]`` as the kernels read it: each token's heads side by side, tokens
    ``x.stride(0)`` apart. Views into the qkv projection's output already are; others are copied."""
    return x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous()


def store_kvcache_cpu(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    """``store_kvcache`` on CPU: one C++ call per layer, where torch needs five ops."""
    _check_caches(k_cache, v_cache, _ATTENTION_FLOATS, None)
    fp8 = k_cache.dtype in FP8_DTYPES
    _check("key", key, _ATTENTION_FLOATS if fp8 else (k_cache.dtype,), (None, *k_cache.shape[2:]))
    _check("value", value, (key.dtype,), tuple(key.shape))
    _check("slot_mapping", slot_mapping, _INDEX, (key.shape[0],))
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    library = load("cpu_attention.cpp", k_cache.shape[-1]) if not fp8 or key.dtype in DTYPES else None
    if library is None or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        # index_copy_ would raise on a slot past the cache, but drop one below -1 as padding
        _check_range("slot_mapping", slot_mapping, -1, num_slots, f"the cache has {num_slots} slots (-1 marks padding)")
        return store_kvcache_torch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    key, value = _heads_contiguous(key), _heads_contiguous(value)
    slots = slot_mapping.long().contiguous()  # slots must outlive the call
    if fp8:  # strides in values: each is encoded (cpu_fp8.h)
        code = getattr(library, "store_kvcache_" + _kernel_name(key.dtype, k_cache.dtype))(
            key.data_ptr(), value.data_ptr(), key.stride(0), value.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            slots.data_ptr(), key.shape[0], num_slots, key[0].numel(), inverse_scale(k_scale), inverse_scale(v_scale),
            torch.get_num_threads())
    else:  # bytes are bytes: strides in bytes
        size = key.element_size()
        code = library.store_kvcache(key.data_ptr(), value.data_ptr(), key.stride(0) * size, value.stride(0) * size,
                                     k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), key.shape[0], num_slots,
                                     key[0].numel() * size, torch.get_num_threads())
    if code:
        raise _range_error("slot_mapping", -1, num_slots, f"the cache has {num_slots} slots (-1 marks padding)")


def flash_attn_varlen_func_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale=None, causal=False, block_table=None, window_size=(-1, -1), softcap=0.0,
                               k_descale=1.0, v_descale=1.0):
    """``flash_attn_varlen_func`` on CPU (prefill), by the C++ kernel; same arguments and semantics.

    A float16 cache, or no compiler, goes to the pure-torch reference instead.
    """
    _check("q", q, _ATTENTION_FLOATS, (None, None, None))
    left = window_left(window_size, causal)
    num_tokens, num_heads, head_dim = q.shape
    if block_table is None:
        _check("k", k, (q.dtype,), (None, None, head_dim))
        _check("v", v, (q.dtype,), tuple(k.shape))
    else:
        _check_caches(k, v, (q.dtype,), head_dim)
    _check_heads(num_heads, k.shape[-2])
    _check("cu_seqlens_q", cu_seqlens_q, _INDEX, (None,))
    batch = len(cu_seqlens_q) - 1
    _check("cu_seqlens_k", cu_seqlens_k, _INDEX, (batch + 1,))
    if batch < 0:
        raise ValueError("cu_seqlens_q must hold at least one offset, 0")
    if block_table is not None:
        _check("block_table", block_table, _INDEX, (batch, None))
    library = load("cpu_attention.cpp", head_dim) if q.dtype in DTYPES else None
    if library is None:
        _check_prefill_ranges(num_tokens, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, block_table)
        return flash_attn_varlen_func_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            softmax_scale, causal, block_table, window_size, softcap, k_descale,
                                            v_descale)
    cu_k = cu_seqlens_k.int().contiguous()
    packed = block_table is None
    if packed:
        # Packed K/V read as a paged cache whose blocks hold one token each: sequence i's "blocks"
        # are its own rows, cu_seqlens_k[i], cu_seqlens_k[i] + 1, ... and then block 0, never read
        # (every entry must name a block: the kernel checks them all).
        t = torch.arange(max_seqlen_k, dtype=torch.int32)
        block_table = torch.where(t < cu_k.diff()[:, None], cu_k[:-1, None] + t, 0)
        k, v = k.unsqueeze(1), v.unsqueeze(1)
    q, k, v = _heads_contiguous(q), k.contiguous(), v.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    tables, cu_q = block_table.int().contiguous(), cu_seqlens_q.int().contiguous()
    code = getattr(library, "prefill_" + _kernel_name(q.dtype, k.dtype))(
        q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), tables.data_ptr(), cu_q.data_ptr(), cu_k.data_ptr(),
        out.data_ptr(), batch, num_tokens, tables.shape[1], k.shape[0], k.shape[1], num_heads, k.shape[2],
        (softmax_scale or head_dim ** -0.5) * k_descale, int(causal), left, softcap, v_descale, torch.get_num_threads())
    if code:
        raise _prefill_error(code, num_tokens, k, max_seqlen_k, block_table, packed)
    return out


def _prefill_error(code: int, num_tokens: int, k: torch.Tensor, max_seqlen_k: int, block_table: torch.Tensor,
                   packed: bool) -> ValueError:
    """The prefill kernel's error ``code``, or the same check in Python; ``packed``: k holds the keys
    themselves, one block per token, through a block table built here."""
    if code == 5:
        return ValueError(f"cu_seqlens_q must run from 0 to q's {num_tokens} tokens and cu_seqlens_k from 0")
    if code == 6:
        return ValueError("cu_seqlens_q and cu_seqlens_k must not decrease, nor a sequence have more queries "
                          "than keys")
    if packed and code == 2:
        return _range_error("cu_seqlens_k", 0, len(k) + 1, f"k has {len(k)} tokens")
    if packed:
        return _range_error("cu_seqlens_k's lengths", 0, max_seqlen_k + 1, "beyond max_seqlen_k")
    return _block_table_error(code, block_table, k, "cu_seqlens_k")


def _check_prefill_ranges(num_tokens, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, block_table) -> None:
    """For the torch fallback, what the prefill kernel checks itself."""
    seqlens_q, seqlens_k = cu_seqlens_q.diff(), cu_seqlens_k.diff()
    if cu_seqlens_q[0] != 0 or cu_seqlens_q[-1] != num_tokens or cu_seqlens_k[0] != 0:
        raise _prefill_error(5, num_tokens, k, max_seqlen_k, block_table, block_table is None)
    if len(seqlens_q) and (seqlens_q.min() < 0 or (seqlens_k - seqlens_q).min() < 0):
        raise _prefill_error(6, num_tokens, k, max_seqlen_k, block_table, block_table is None)
    if block_table is None:
        _check_range("cu_seqlens_k", cu_seqlens_k, 0, len(k) + 1, f"k has {len(k)} tokens")
        _check_range("cu_seqlens_k's lengths", seqlens_k, 0, max_seqlen_k + 1, "beyond max_seqlen_k")
    else:
        _check_block_table(block_table, seqlens_k, k, "cu_seqlens_k")


def flash_attn_with_kvcache_cpu(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None, causal=False,
                                window_size=(-1, -1), softcap=0.0, k_descale=1.0, v_descale=1.0):
    """``flash_attn_with_kvcache`` for decode on CPU (one query per sequence), by the C++ kernel.

    Cases the kernel does not cover (several queries per sequence, a float16 cache, no compiler)
    go to the pure-torch reference, which has the same semantics.
    """
    _check("q", q, _ATTENTION_FLOATS, (None, None, None, None))
    left = window_left(window_size, causal)
    batch, seqlen_q, num_heads, head_dim = q.shape
    _check_caches(k_cache, v_cache, (q.dtype,), head_dim)
    _check_heads(num_heads, k_cache.shape[2])
    _check("cache_seqlens", cache_seqlens, _INDEX, (batch,))
    _check("block_table", block_table, _INDEX, (batch, None))
    library = load("cpu_attention.cpp", head_dim) if seqlen_q == 1 and q.dtype in DTYPES else None
    if library is None:
        _check_block_table(block_table, cache_seqlens, k_cache, "cache_seqlens")
        return flash_attn_with_kvcache_torch(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal,
                                             window_size, softcap, k_descale, v_descale)
    q, k_cache, v_cache = _heads_contiguous(q), k_cache.contiguous(), v_cache.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    tables, seqlens = block_table.int().contiguous(), cache_seqlens.int().contiguous()
    code = getattr(library, "decode_" + _kernel_name(q.dtype, k_cache.dtype))(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), seqlens.data_ptr(),
        out.data_ptr(), batch, tables.shape[1], k_cache.shape[0], k_cache.shape[1], num_heads, k_cache.shape[2],
        (softmax_scale or head_dim ** -0.5) * k_descale, left, softcap, v_descale, torch.get_num_threads())
    if code:
        raise _block_table_error(code, block_table, k_cache, "cache_seqlens")
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """``RMSNorm.forward`` in one pass (cpu_layers.cpp). With a residual, the sum is written into it."""
    _check("x", x, _FLOATS, (None,) * max(x.dim(), 1))
    _check("weight", weight, (x.dtype,), (x.shape[-1],))
    if residual is not None:
        _check("residual", residual, (x.dtype,), tuple(x.shape))
        if not residual.is_contiguous():
            raise ValueError("residual must be contiguous: the kernel writes the sum into it")
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    getattr(load("cpu_layers.cpp"), "add_rms_norm_" + DTYPES[x.dtype])(
        x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(), out.data_ptr(),
        x.numel() // x.shape[-1], x.shape[-1], eps, torch.get_num_threads())
    return out if residual is None else (out, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``SiluAndMul.forward`` in one pass (cpu_layers.cpp)."""
    _check("x", x, _FLOATS, (None,) * max(x.dim(), 1))
    if x.shape[-1] % 2:
        raise ValueError(f"x's last dimension ({x.shape[-1]}) must be even: it is [gate | up]")
    x = x.contiguous()
    out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
    getattr(load("cpu_layers.cpp"), "silu_and_mul_" + DTYPES[x.dtype])(
        x.data_ptr(), out.data_ptr(), out.numel() // out.shape[-1], out.shape[-1], torch.get_num_threads())
    return out


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor):
    """``RotaryEmbedding.forward`` in one pass over q and k, rotating them in place (cpu_layers.cpp)."""
    _check("q", q, _FLOATS, (None, None, None))
    num_tokens, _, head_dim = q.shape
    _check("k", k, (q.dtype,), (num_tokens, None, head_dim))
    _check("positions", positions, _INDEX, (num_tokens,))
    _check("cos_sin_cache", cos_sin_cache, (torch.float32,), (None, 2 * head_dim))
    if head_dim % 2 or not cos_sin_cache.is_contiguous():
        raise ValueError(f"head_dim ({head_dim}) must be even and cos_sin_cache contiguous")
    q, k, positions = _heads_contiguous(q), _heads_contiguous(k), positions.long().contiguous()
    if getattr(load("cpu_layers.cpp"), "rotary_" + DTYPES[q.dtype])(
            q.data_ptr(), k.data_ptr(), q.stride(0), k.stride(0), q.shape[-2], k.shape[-2], head_dim,
            positions.data_ptr(), cos_sin_cache.data_ptr(), len(cos_sin_cache), num_tokens, torch.get_num_threads()):
        raise _range_error("positions", 0, len(cos_sin_cache), f"the rotary table has {len(cos_sin_cache)} rows")
    return q, k


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight ``[N, K]`` in cpu_linear.cpp's layout ``[ceil(N / 32), K / 2, 32, 2]``: strips of 32
    output columns, each k pair's 32 x 2 values side by side; zero rows pad N to whole strips."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"weight has {k} input features: cpu_linear.cpp reads them in pairs, so it needs an "
                         "even number")
    return F.pad(weight, (0, 0, 0, -n % 32)).view(-1, 32, k // 2, 2).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int):
    """``Linear.forward`` in bf16 by cpu_linear.cpp, over a weight from ``pack_linear_weight``."""
    _check("x", x, (torch.bfloat16,), (None,) * max(x.dim(), 1))
    in_features = x.shape[-1]
    _check("packed_weight", packed_weight, (torch.bfloat16,), (-(-out_features // 32), in_features // 2, 32, 2))
    if in_features % 2 or not packed_weight.is_contiguous():
        raise ValueError(f"x's {in_features} features must be even and packed_weight contiguous "
                         "(as pack_linear_weight makes it)")
    if bias is not None:
        _check("bias", bias, (torch.bfloat16,), (out_features,))
        bias = bias.contiguous()
    rows = x.reshape(-1, in_features)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    out = x.new_empty(rows.shape[0], out_features)
    load("cpu_linear.cpp").linear_bfloat16(
        rows.data_ptr(), rows.stride(0), packed_weight.data_ptr(), bias.data_ptr() if bias is not None else None,
        out.data_ptr(), rows.shape[0], out_features, in_features, torch.get_num_threads())
    return out.view(*x.shape[:-1], out_features)


def quantized_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None,
                     out_features: int) -> torch.Tensor:
    """``Linear.forward`` over a weight from ``quantization.quantize_weight`` (int4 if ``scales`` is
    None, else int8), by cpu_quantized_linear.cpp; where that cannot be built, by dequantizing."""
    _check("x", x, _FLOATS, (None,) * max(x.dim(), 1))
    in_features, groups = x.shape[-1], x.shape[-1] // quantization.GROUP_SIZE
    tiles = out_features // quantization.TILE
    if scales is None:
        _check("qweight", qweight, (torch.uint8,), (tiles, groups, quantization.INT4_GROUP_BYTES))
    else:
        _check("qweight", qweight, (torch.int8,), (tiles, groups, quantization.TILE, quantization.GROUP_SIZE))
        _check("scales", scales, (torch.float32,), (out_features,))
    if not quantization.can_quantize(out_features, in_features) or not qweight.is_contiguous():
        raise ValueError(f"a quantized [{out_features}, {in_features}] weight must be contiguous, in whole "
                         f"tiles of {quantization.TILE} rows and groups of {quantization.GROUP_SIZE} (as "
                         "quantization.quantize_weight makes it)")
    if bias is not None:
        _check("bias", bias, (x.dtype,), (out_features,))
    library = load("cpu_quantized_linear.cpp")
    if library is None:
        return F.linear(x, quantization.dequantize_packed(qweight, scales).to(x.dtype), bias)
    rows = x.reshape(-1, in_features)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    scales = scales.contiguous() if scales is not None else None  # kept here, they outlive the call
    bias = bias.contiguous() if bias is not None else None
    out = x.new_empty(rows.shape[0], out_features)
    getattr(library, f"quantized_linear_{DTYPES[x.dtype]}")(
        rows.data_ptr(), rows.stride(0), qweight.data_ptr(), scales.data_ptr() if scales is not None else None,
        bias.data_ptr() if bias is not None else None, out.data_ptr(), rows.shape[0], out_features, in_features,
        torch.get_num_threads())
    return out.view(*x.shape[:-1], out_features)
