"""flash-attn's two attention functions in plain torch: the oracle and the CPU's fallback.

They have flash-attn's signatures and semantics (the subset nanoengine uses), over the same paged
KV cache. Every attention kernel is tested against them (flash-attn on CUDA, the C++ kernels of
cpu_kernels.py on CPU), and the CPU runs them when its kernels cannot be built or do not cover a
case. Decode has two: ``flash_attn_with_kvcache_torch`` is tuned, because it doubles as that
fallback; ``flash_attn_with_kvcache_plain`` is the same contract written one sequence at a time,
for reading, and is what learner mode runs (``LLM(learner_mode=True)``).

Two of flash-attn's options serve Mistral's and Gemma's layers: ``window_size=(left, right)``, a
sliding window (a query at position p sees keys p - left .. p; HF's ``sliding_window`` W is
left = W - 1), and ``softcap`` (Gemma 2: each scaled score s becomes softcap * tanh(s / softcap)
before the softmax). Every backend takes both; none needs ``right``, which causal attention fixes at 0.

An 8-bit cache (kv_cache_dtype.py) is read as its values times flash-attn 3's ``k_descale`` and
``v_descale`` (the layer's ``k_scale`` and ``v_scale``), in q's dtype: ``dequantize``, then attention
as for any cache; the kernels are tested against exactly this.
"""

import torch
import torch.nn.functional as F

from nanoengine.kv_cache_dtype import dequantize


def window_left(window_size: tuple[int, int], causal: bool) -> int:
    """``window_size``'s left reach (-1: none); a ValueError for a right reach, which no model needs."""
    left, right = window_size
    if right != -1 and not (causal and right == 0):
        raise ValueError(f"window_size={tuple(window_size)}: only a left window is supported (right -1, or 0 "
                         "with causal=True)")
    return left


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, left: int = -1,
            softcap: float = 0.0) -> torch.Tensor:
    """Attention of one sequence: q [Lq, H, D] against k, v [Lk, Hk, D] -> [Lq, H, D].

    When Lq < Lk (the first keys come from the prefix cache) the causal mask is aligned to the
    bottom right, as in flash-attn: query i sits at position Lk - Lq + i.
    """
    lq, lk = q.shape[0], k.shape[0]
    # Expand K/V to every query head: with ``enable_gqa`` torch's CPU SDPA leaves its fused
    # kernel for the slow reference math (measured: 10x slower prefill in bf16).
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    if left >= 0 or softcap:  # SDPA has no soft cap: the math, as it reads
        query_pos, key_pos = torch.arange(lk - lq, lk, device=q.device)[:, None], torch.arange(lk, device=q.device)
        hidden = (key_pos > query_pos) if causal else torch.zeros(lq, lk, dtype=torch.bool, device=q.device)
        if left >= 0:
            hidden |= key_pos < query_pos - left
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        probs = scores.masked_fill_(hidden, float("-inf")).softmax(dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
    mask = None
    if causal and lq != lk:
        mask = torch.arange(lk, device=q.device) <= torch.arange(lq, device=q.device)[:, None] + (lk - lq)
    # 4-D [1, H, L, D]: torch's fused CPU kernel does not take 3-D inputs.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
        is_causal=causal and lq == lk, scale=scale)
    return out[0].transpose(0, 1)


def flash_attn_varlen_func_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 softmax_scale=None, causal=False, block_table=None, window_size=(-1, -1),
                                 softcap=0.0, k_descale=1.0, v_descale=1.0):
    """Reference for flash-attn's ``flash_attn_varlen_func`` (the subset nanoengine uses).

    Without ``block_table``, k and v are packed like q. With it, k and v are the paged caches
    ``[num_blocks, block_size, Hk, D]`` and sequence i's keys are read through block_table[i].
    Each sequence attends only to its own keys, so packed neighbours never mix.
    """
    left = window_left(window_size, causal)
    out = torch.empty_like(q)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    block_size = k.shape[1] if block_table is not None else 0
    for i in range(len(cu_q) - 1):
        q_i = q[cu_q[i]:cu_q[i + 1]]
        if block_table is None:
            k_i, v_i = k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        else:
            seqlen_k = cu_k[i + 1] - cu_k[i]
            blocks = block_table[i, :(seqlen_k + block_size - 1) // block_size]
            k_i, v_i = k[blocks].flatten(0, 1)[:seqlen_k], v[blocks].flatten(0, 1)[:seqlen_k]
        k_i, v_i = dequantize(k_i, k_descale, q.dtype), dequantize(v_i, v_descale, q.dtype)
        out[cu_q[i]:cu_q[i + 1]] = _attend(q_i, k_i, v_i, softmax_scale, causal, left, softcap)
    return out


def flash_attn_with_kvcache_torch(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None,
                                  causal=False, window_size=(-1, -1), softcap=0.0, k_descale=1.0, v_descale=1.0):
    """Reference for flash-attn's ``flash_attn_with_kvcache`` over a paged cache.

    q is ``[batch, seqlen_q, H, D]``; sequence b's keys are the first ``cache_seqlens[b]`` slots
    of the blocks in block_table[b]. All sequences are gathered at once and padded to the longest
    block table; the mask hides the padding. A row of length 0 (a padded batch row) gives zeros.
    """
    batch, seqlen_q, num_heads, head_dim = q.shape
    left = window_left(window_size, causal)
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = softmax_scale or head_dim ** -0.5
    # Gather every sequence's keys straight into [batch, Hk, keys, D] (keys = max_blocks *
    # block_size), the layout the matmuls read without another copy: viewed as rows of head_dim
    # values, the cache holds key (slot, head) at row slot * Hk + head.
    block_size = k_cache.shape[1]
    slots = (block_table.long()[:, :, None] * block_size + torch.arange(block_size, device=q.device)).view(batch, 1, -1)
    rows = (slots * num_kv_heads + torch.arange(num_kv_heads, device=q.device)[:, None]).flatten()
    k = k_cache.view(-1, head_dim).index_select(0, rows).view(batch, num_kv_heads, -1, head_dim)
    v = v_cache.view(-1, head_dim).index_select(0, rows).view(batch, num_kv_heads, -1, head_dim)
    k, v = dequantize(k, k_descale, q.dtype), dequantize(v, v_descale, q.dtype)
    # The query heads sharing a kv head become rows of one matmul (GQA without repeating K/V):
    # [batch, Hk, seqlen_q * group, D], rows ordered (query, head in group).
    q = q.view(batch, seqlen_q, num_kv_heads, group, head_dim).transpose(1, 2)
    scores = torch.matmul(q.reshape(batch, num_kv_heads, seqlen_q * group, head_dim), k.transpose(2, 3))
    # Query j of sequence b sits at position cache_seqlens[b] - seqlen_q + j and sees keys up to it.
    limit = cache_seqlens[:, None] - seqlen_q + (torch.arange(seqlen_q, device=q.device) if causal else seqlen_q - 1)
    key_pos = torch.arange(k.shape[2], device=q.device)
    masked = key_pos > limit[:, :, None]  # [batch, seqlen_q, keys]
    if left >= 0:
        query_pos = cache_seqlens[:, None] - seqlen_q + torch.arange(seqlen_q, device=q.device)
        masked |= key_pos < (query_pos - left)[:, :, None]
    scores = (scores.float() * scale).view(batch, num_kv_heads, seqlen_q, group, -1)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    probs = scores.masked_fill_(masked[:, None, :, None], float("-inf")).softmax(dim=-1)
    out = torch.matmul(probs.view(batch, num_kv_heads, seqlen_q * group, -1).to(v.dtype), v)
    out = out.view(batch, num_kv_heads, seqlen_q, group, head_dim).transpose(1, 2)
    out = out.reshape(batch, seqlen_q, num_heads, head_dim)
    return out.masked_fill((cache_seqlens == 0)[:, None, None, None], 0)  # flash-attn: empty rows give 0


def flash_attn_with_kvcache_plain(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None,
                                  causal=False, window_size=(-1, -1), softcap=0.0, k_descale=1.0, v_descale=1.0):
    """``flash_attn_with_kvcache`` one sequence at a time, as the math reads; same contract as the
    tuned version above (tested against it), many times slower on a large batch.

    Sequence b's keys and values are the first ``cache_seqlens[b]`` slots of its blocks, taken in
    block-table order; its ``seqlen_q`` queries are its newest positions.
    """
    batch, seqlen_q, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    left = window_left(window_size, causal)
    scale = softmax_scale or head_dim ** -0.5
    out = torch.zeros_like(q)  # a row of length 0 (a padded batch row) stays zero, as in flash-attn
    for b in range(batch):
        n = int(cache_seqlens[b])
        if n == 0:
            continue
        blocks = block_table[b, :(n + block_size - 1) // block_size].long()
        # [n, Hk, D]: blocks laid end to end, cut at n; an 8-bit cache's values times their scale
        k = dequantize(k_cache[blocks].flatten(0, 1)[:n], k_descale, q.dtype).float()
        v = dequantize(v_cache[blocks].flatten(0, 1)[:n], v_descale, q.dtype).float()
        # Grouped-query attention: each kv head serves num_heads // num_kv_heads query heads.
        k, v = (t.repeat_interleave(num_heads // num_kv_heads, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q[b].float(), k) * scale  # [H, seqlen_q, n]
        if softcap:  # Gemma 2: scores squashed into (-softcap, softcap)
            scores = softcap * torch.tanh(scores / softcap)
        # Query j sits at position n - seqlen_q + j; causal, it sees the keys up to it; with a
        # window, none before position - left.
        query_pos, key_pos = torch.arange(n - seqlen_q, n, device=q.device)[:, None], torch.arange(n, device=q.device)
        if causal:
            scores.masked_fill_(key_pos > query_pos, float("-inf"))
        if left >= 0:
            scores.masked_fill_(key_pos < query_pos - left, float("-inf"))
        out[b] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(q.dtype)
    return out
