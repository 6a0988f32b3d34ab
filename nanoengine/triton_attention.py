"""flash-attn's two attention functions written in Triton: the CUDA path when flash-attn is absent.

flash-attn publishes wheels for a few torch releases only, and building it takes an hour; Triton
comes with torch. These functions have the signatures and semantics of the two flash-attn
functions attention.py calls (the subset nanoengine uses), over the same paged KV cache
``[num_blocks, block_size, num_kv_heads, head_dim]``. Both run one kernel, ``_attention_kernel``:

- A program takes a tile of ``BLOCK_M`` rows of one sequence and one kv head. A row is a (query,
  query head) pair, and the query heads that share a kv head are neighbouring rows, so each key
  tile is read once for the whole group (GQA). The program streams the sequence's keys in tiles of
  ``BLOCK_N``, keeping each row's running max and sum of the softmax (flash attention's online
  softmax): no score matrix is ever stored.
- With a block table the keys are read through it: key ``p`` of sequence ``s`` is cache row
  ``block_table[s, p // block_size] * block_size + p % block_size``. Without one they are packed
  like the queries (a prefill with nothing cached).
- Causal, aligned to the bottom right as in flash-attn: with ``Lq`` queries over ``Lk`` keys,
  query ``i`` sits at position ``Lk - Lq + i`` and sees the keys up to it.
- A sliding window (``WINDOW`` = window_size's left, Mistral's and Gemma's layers) hides the keys
  more than ``WINDOW`` positions before a query, and skips the key tiles left of the tile's window;
  ``SOFTCAP`` (Gemma 2) caps each score, softcap * tanh(score / softcap). Both are compile-time
  constants, so a kernel without them is the same as before.
- Decode (``flash_attn_with_kvcache_triton``) is the same kernel with one query per sequence. One
  sequence alone would be a handful of programs on a GPU of a hundred cores, so each sequence's
  keys are cut into ``num_splits`` stretches, a program each (flash-decoding); the stretches'
  partial outputs are merged by their log-sum-exps in ``_merge_kernel``.
- An 8-bit cache (``FMT``, kv_cache_dtype.py) is read as bytes and decoded to q's dtype by
  ``FROM_FP8`` (triton_fp8.py), exactly; its scales are flash-attn 3's ``k_descale`` and
  ``v_descale``, folded into the score's scale and the output's.

Every launch grid follows from shapes the caller fixes (batch size, heads, the block table's
width), never from the lengths inside the tensors, and nothing is read back to the host: a decode
step can be captured in a CUDA graph and replayed with new lengths. Under Triton's interpreter
(``TRITON_INTERPRET=1``) the same kernels run on CPU tensors, which is how they are tested on a
machine without a GPU.
"""

from __future__ import annotations

import functools

import torch

from nanoengine.torch_attention import window_left
from nanoengine.triton_fp8 import fp8_format, from_fp8
from nanoengine.triton_jit import jit, tl, triton

LOG2E = 1.4426950408889634  # the kernels use exp2: exp(x) = exp2(x * log2(e))
# A decode stretch shorter than this costs more to merge than it gains in parallel programs.
MIN_KEYS_PER_SPLIT = 128


def _attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, block_table_ptr,
                      stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_bt,
                      scale, v_scale, num_heads,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                      NUM_SPLITS: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                      WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, FMT: tl.constexpr, FROM_FP8: tl.constexpr):
    tile, seq = tl.program_id(0), tl.program_id(1)
    kv_head, split = tl.program_id(2) // NUM_SPLITS, tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len * GROUP:
        return
    k_start = tl.load(cu_k_ptr + seq)
    k_len = tl.load(cu_k_ptr + seq + 1) - k_start
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    query, head = rows // GROUP, kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, BLOCK_D)
    row_mask, dim_mask = rows < q_len * GROUP, dims < HEAD_DIM
    token = (q_start + query).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    query_pos = k_len - q_len + query
    # The keys this tile can see, then this program's stretch of them (all of them without splits).
    end = k_len
    if CAUSAL:
        end = tl.minimum(k_len, k_len - q_len + ((tile + 1) * BLOCK_M - 1) // GROUP + 1)
    per_split = tl.cdiv(tl.cdiv(end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    stop = tl.minimum(end, start + per_split)
    if WINDOW >= 0:  # the tile's first query sees nothing before its position - WINDOW
        start = tl.maximum(start, k_len - q_len + (tile * BLOCK_M) // GROUP - WINDOW)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scores, in log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # running sum of exp2(score - m_i) * value
    for first in range(start, stop, BLOCK_N):
        pos = first + tl.arange(0, BLOCK_N)
        key_mask = pos < stop
        if PAGE:
            block = tl.load(block_table_ptr + seq * stride_bt + pos // PAGE, mask=key_mask, other=0)
            key_row = block.to(tl.int64) * PAGE + pos % PAGE
        else:
            key_row = (k_start + pos).to(tl.int64)
        k = tl.load(k_ptr + key_row[None, :] * stride_k_t + kv_head * stride_k_h + dims[:, None],
                    mask=key_mask[None, :] & dim_mask[:, None], other=0.0)
        v = tl.load(v_ptr + key_row[:, None] * stride_v_t + kv_head * stride_v_h + dims[None, :],
                    mask=key_mask[:, None] & dim_mask[None, :], other=0.0)
        if FMT:  # fp8 codes: exact in q's dtype
            k, v = FROM_FP8(k, FMT).to(q.dtype), FROM_FP8(v, FMT).to(q.dtype)
        allowed = key_mask[None, :]
        if CAUSAL:
            allowed = allowed & (pos[None, :] <= query_pos[:, None])
        if WINDOW >= 0:
            allowed = allowed & (pos[None, :] >= query_pos[:, None] - WINDOW)
        s = tl.dot(q, k, input_precision=PRECISION) * scale
        if SOFTCAP > 0:  # scale is in log2 units and SOFTCAP too: tanh(s / SOFTCAP) is tanh(score / softcap)
            s = SOFTCAP * (1.0 - 2.0 / (tl.exp(2.0 * s / SOFTCAP) + 1.0))
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp2(-inf) = 0, not NaN
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]  # a row with no keys (a padded decode row) gives 0
    if NUM_SPLITS == 1:
        tl.store(out_ptr + (token * num_heads + head)[:, None] * HEAD_DIM + dims[None, :], out,
                 mask=row_mask[:, None] & dim_mask[None, :])
    else:  # a partial output and its log-sum-exp (-inf for an empty stretch), for _merge_kernel
        part = (token * num_heads + head) * NUM_SPLITS + split
        tl.store(out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=row_mask[:, None] & dim_mask[None, :])
        tl.store(lse_ptr + part, tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf")),
                 mask=row_mask)


def _merge_kernel(part_ptr, lse_ptr, out_ptr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  NUM_SPLITS: tl.constexpr):
    """One (token, head): the stretches' outputs weighted by their share of the softmax's sum."""
    row = tl.program_id(0).to(tl.int64)
    splits, dims = tl.arange(0, NUM_SPLITS), tl.arange(0, BLOCK_D)
    lse = tl.load(lse_ptr + row * NUM_SPLITS + splits)
    top = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # 0 for an empty stretch
    parts = tl.load(part_ptr + (row * NUM_SPLITS + splits)[:, None] * HEAD_DIM + dims[None, :],
                    mask=dims[None, :] < HEAD_DIM, other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + dims, out, mask=dims < HEAD_DIM)


def tile_sizes(rows: int, head_dim: int, itemsize: int) -> tuple[int, int, int]:
    """``BLOCK_M`` rows (no more than a sequence's rows need), ``BLOCK_N`` keys and ``BLOCK_D``: powers
    of two of at least 16 (``tl.dot``'s least), tiles of at most 32 KB of queries and 16 KB of keys,
    so that the pipelined tiles fit an A100's 164 KB of shared memory at head size 256 in float32."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = max(16, min(64, triton.next_power_of_2(rows), 32768 // (block_d * itemsize)))
    block_n = max(16, min(64, 16384 // (block_d * itemsize)))
    return block_m, block_n, block_d


def _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, causal, block_table,
               window_size, softcap, k_descale, v_descale, num_splits=1):
    """Launch ``_attention_kernel`` over q ``[num_tokens, H, D]`` (the last dimension contiguous)."""
    fmt = fp8_format(k.dtype)
    if fmt:  # read as bytes: Triton's own e4m3 type needs sm_89
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    num_tokens, num_heads, head_dim = q.shape
    left = window_left(window_size, causal)
    num_kv_heads = k.shape[-2]
    group = num_heads // num_kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_table is None:  # packed like q: [num_tokens, Hk, D]
        page, stride_k, stride_v, stride_bt = 0, k.stride()[:2], v.stride()[:2], 0
    else:  # paged: [num_blocks, block_size, Hk, D]
        page, stride_k, stride_v, stride_bt = k.shape[1], k.stride()[1:3], v.stride()[1:3], block_table.stride(0)
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "a key's head_dim values must be contiguous"
    block_m, block_n, block_d = tile_sizes(max_seqlen_q * group, head_dim, q.element_size())
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    parts = out if num_splits == 1 else torch.empty(num_tokens, num_heads, num_splits, head_dim,
                                                    dtype=torch.float32, device=q.device)
    lse = None if num_splits == 1 else torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32,
                                                   device=q.device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    grid = (triton.cdiv(max_seqlen_q * group, block_m), num_seqs, num_kv_heads * num_splits)
    jit(_attention_kernel)[grid](
        q, k, v, parts, lse, cu_seqlens_q, cu_seqlens_k, block_table, q.stride(0), q.stride(1), *stride_k,
        *stride_v, stride_bt, (softmax_scale or head_dim ** -0.5) * LOG2E * k_descale, v_descale, num_heads,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page,
        NUM_SPLITS=num_splits, CAUSAL=causal, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WINDOW=left, SOFTCAP=softcap * LOG2E, FMT=fmt, FROM_FP8=jit(from_fp8) if fmt else None)
    if num_splits > 1:
        jit(_merge_kernel)[(num_tokens * num_heads,)](parts, lse, out, HEAD_DIM=head_dim, BLOCK_D=block_d,
                                                      NUM_SPLITS=num_splits)
    return out


def flash_attn_varlen_func_triton(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  softmax_scale=None, causal=False, block_table=None, window_size=(-1, -1),
                                  softcap=0.0, k_descale=1.0, v_descale=1.0):
    """flash-attn's ``flash_attn_varlen_func``: packed sequences; k and v packed like q, or the paged
    caches read through ``block_table`` (then each sequence's keys start in the cache)."""
    return _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, causal, block_table,
                      window_size, softcap, k_descale, v_descale)


@functools.cache
def _num_cores(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def decode_num_splits(batch: int, num_kv_heads: int, max_keys: int, device: torch.device) -> int:
    """How many stretches each sequence's keys are cut into: enough programs for two per core (a
    streaming multiprocessor; on the interpreter, a notional 4), none shorter than
    ``MIN_KEYS_PER_SPLIT`` keys, a power of two (the merge reads them as one vector). ``max_keys``
    is what the block table can hold, a shape, so a captured graph's grid is right for any length."""
    cores = _num_cores(device)
    wanted = min(triton.cdiv(2 * cores, batch * num_kv_heads), triton.cdiv(max_keys, MIN_KEYS_PER_SPLIT))
    return min(triton.next_power_of_2(max(wanted, 1)), 64)


def flash_attn_with_kvcache_triton(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None,
                                   causal=False, window_size=(-1, -1), softcap=0.0, k_descale=1.0, v_descale=1.0):
    """flash-attn's ``flash_attn_with_kvcache`` for decode: q ``[batch, 1, H, D]``, sequence b's keys
    the first ``cache_seqlens[b]`` slots of its blocks; a row of length 0 (a padded row) gives zeros."""
    batch, seqlen_q = q.shape[:2]
    if seqlen_q != 1:
        raise ValueError(f"flash_attn_with_kvcache_triton takes one query per sequence, got {seqlen_q}")
    # As a packed prefill of one query per sequence: sequence b's queries are row b alone.
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    cu_k = torch.zeros(batch + 1, dtype=torch.int32, device=q.device)
    torch.cumsum(cache_seqlens, 0, out=cu_k[1:])
    num_splits = decode_num_splits(batch, k_cache.shape[2], block_table.shape[1] * k_cache.shape[1], q.device)
    out = _attention(q[:, 0], k_cache, v_cache, cu_q, cu_k, 1, softmax_scale, causal, block_table, window_size,
                     softcap, k_descale, v_descale, num_splits)
    return out.unsqueeze(1)
