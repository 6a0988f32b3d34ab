"""How close a run came to the machine's limits: decode against memory bandwidth, prefill against compute.

A decode step computes one new token per sequence. To do it, it reads every weight once (each used
for 2 FLOPs per sequence in the batch: far fewer FLOPs per byte than a CPU or GPU can do while the
byte arrives, until the batch reaches the hundreds) and every running sequence's keys and values
up to its context length (used by only its own query heads: a few FLOPs per byte, at any batch
size). So a decode step's time is bounded below by the bytes it must read over the memory's
bandwidth, and the K/V term grows with the batch and the context while the weights' stays. On
nano-vllm's benchmark (Qwen3-0.6B: 28 layers x 2 x 8 kv heads x 128 x 2 bytes = 115 KB of K/V per
token of context; 256 requests of 100..1024 tokens in and out) the steps read about 15 TB of K/V
against 1.2 TB of weights: the cache, not the model, is what decode waits for.

A prefill step computes many tokens of one prompt per weight read, so it is bound by compute
instead: 2 FLOPs per weight per token through the projections (the LM head only for the rows that
sample), plus attention's, 4 x heads x head_dim per query and key it attends to in each layer (the
scores q.k and the weighted sum of values).

``StepCosts`` holds those per-model numbers, read off a loaded model runner (with tensor
parallelism, rank 0's shard: its weights, its kv heads, its query heads); ``roofline`` sums them
over the steps trace.py's ``StepObserver`` recorded (each step's phase, every sequence's span of
positions, its seconds) and divides by the peaks, measured here (``measure_bandwidth``,
``measure_peak_flops``) or given. Not counted: the embedding lookup (a step reads only its tokens'
rows), the element-wise kernels and norms' arithmetic, the LM head's rows for drafts and prompt
logprobs; quantized layers count the weight their one-row kernel reads (linear.py; where a batch
goes through oneDNN's int8 GEMM, its int8 copy is read instead).
"""

import time
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class StepCosts:
    weight_bytes: int  # what one decode step reads of the weights
    kv_layers: list[tuple[int, int, int | None]]  # per layer: K/V bytes per token, attention FLOPs per key, window
    matmul_params: int  # the decoder's projections' weights (each 2 FLOPs per token)
    lm_head_params: int  # the LM head's (2 FLOPs each per sampled row)

    @classmethod
    def of(cls, runner) -> "StepCosts":
        """The costs of a loaded ``ModelRunner``'s model and KV cache (its dtype, as allocated)."""
        model = runner.model
        seen, weight_bytes = set(), 0
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                continue  # looked up, not read whole (a tied LM head reads the table, counted there)
            for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                if not name.startswith("gemm_") and t.data_ptr() not in seen:  # a tied weight counts once
                    seen.add(t.data_ptr())
                    weight_bytes += t.numel() * t.element_size()
        matmul_params = sum(m.in_features * m.out_features for m in model.modules()
                            if isinstance(m, nn.Linear) and m is not model.lm_head)
        kv_layers = [(2 * a.num_kv_heads * a.head_dim * a.k_cache.element_size(), 4 * a.num_heads * a.head_dim,
                      a.window_size[0] + 1 if a.window_size[0] >= 0 else None) for a in runner.attention_layers]
        return cls(weight_bytes, kv_layers, matmul_params, model.lm_head.in_features * model.lm_head.out_features)


def attended_keys(start: int, num_tokens: int, window: int | None) -> int:
    """Keys that queries at positions ``start .. start + num_tokens - 1`` see in all, causally: the
    query at position p sees p + 1 keys, or ``window`` once p + 1 passes it."""
    end = start + num_tokens
    window = end if window is None else window

    def triangle(n: int) -> int:
        return n * (n + 1) // 2
    return triangle(min(end, window)) - triangle(min(start, window)) + window * max(0, end - max(start, window))


def roofline(records: list[dict], costs: StepCosts, peak_bandwidth: float, peak_flops: float) -> dict:
    """Bytes the decode steps had to read and FLOPs the prefill steps had to do, over their seconds,
    as rates and as fractions of the peaks (bytes/s, FLOP/s). ``records``: StepObserver's, one per
    step with its "phase" ("decode" or "prefill", the engine's), "spans" (each sequence's tokens
    already in the cache and tokens computed now), "sampling_seqs" and "seconds"."""
    decode_weight = decode_kv = decode_seconds = prefill_flops = prefill_seconds = 0
    for r in records:
        if r["phase"] == "decode":
            decode_weight += costs.weight_bytes
            decode_kv += sum(kv_bytes * min(start + n, window or start + n)
                             for start, n in r["spans"] for kv_bytes, _, window in costs.kv_layers)
            decode_seconds += r["seconds"]
        else:
            prefill_flops += 2 * costs.matmul_params * sum(n for _, n in r["spans"])
            prefill_flops += 2 * costs.lm_head_params * r["sampling_seqs"]
            prefill_flops += sum(flops * attended_keys(start, n, window)
                                 for start, n in r["spans"] for _, flops, window in costs.kv_layers)
            prefill_seconds += r["seconds"]
    decode_rate = (decode_weight + decode_kv) / decode_seconds if decode_seconds else 0.0
    prefill_rate = prefill_flops / prefill_seconds if prefill_seconds else 0.0
    return {"decode_weight_bytes": decode_weight, "decode_kv_bytes": decode_kv, "decode_step_seconds": decode_seconds,
            "decode_bytes_per_s": decode_rate, "decode_bandwidth_fraction": decode_rate / peak_bandwidth,
            "prefill_flops": prefill_flops, "prefill_step_seconds": prefill_seconds,
            "prefill_flops_per_s": prefill_rate, "prefill_compute_fraction": prefill_rate / peak_flops,
            "peak_bandwidth_bytes_per_s": peak_bandwidth, "peak_flops_per_s": peak_flops}


def _best_seconds(device: torch.device, work, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``work``, after one untimed (page faults, kernel choice)."""
    best = float("inf")
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(device: torch.device, repeats: int = 5) -> float:
    """Memory bandwidth in bytes/s: one large copy (bytes read plus bytes written) over its best time;
    128 MiB on CPU (several times a last-level cache), 1 GiB on a GPU."""
    nbytes = 1 << 30 if device.type == "cuda" else 1 << 27
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_seconds(device, lambda: dst.copy_(src), repeats)


def measure_peak_flops(device: torch.device, dtype: torch.dtype, repeats: int = 3) -> float:
    """Compute peak in FLOP/s: torch's matmul of two square matrices in ``dtype`` over its best time,
    the size doubled from 128 until one takes 50 ms, enough to run at its full rate, or reaches 2048
    on CPU, 8192 on a GPU (a CPU with no fast path for the dtype, bf16 on AVX2, stops early rather
    than spend minutes on it)."""
    n, largest = 128, 8192 if device.type == "cuda" else 2048
    while True:
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        seconds = _best_seconds(device, lambda: a @ b, repeats)
        if seconds >= 0.05 or n >= largest:
            return 2 * n ** 3 / seconds
        n *= 2
