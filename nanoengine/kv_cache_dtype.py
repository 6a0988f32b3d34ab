"""The KV cache's storage type (vLLM's ``kv_cache_dtype``): the model's dtype, or 8-bit floats.

Why: a decode step reads every running sequence's keys and values once, and at long contexts
those bytes outweigh the weights' (issue 59). Stored in 8 bits they are half of bfloat16's, and a
cache of the same memory holds twice the tokens.

The names are vLLM's: ``"auto"`` (the model's dtype), ``"fp8"`` = ``"fp8_e4m3"`` (torch's
``float8_e4m3fn``: 4 exponent bits, 3 mantissa bits, largest value 448, no infinities) and
``"fp8_e5m2"`` (``float8_e5m2``: 5 and 2, largest 57344: more range, half the precision). The
cache tensors have those torch dtypes, so every kernel tells the format from the cache itself.

Each attention layer has vLLM's per-tensor scales, ``k_scale`` and ``v_scale`` (attention.py):
a key is stored as ``key / k_scale`` rounded to the format, and read back as ``stored * k_scale``.
They are 1.0 here: nanoengine's loader does not read scales from checkpoints (a checkpoint that
carries ``k_scale`` tensors is refused by name, as any tensor with no place in the model is).

``quantize`` and ``dequantize`` are the contract, in torch: every store kernel writes the bytes
``quantize`` writes (to nearest, ties to even, after clamping to the largest finite value, which
e4m3fn would otherwise turn into NaN and e5m2 into infinity), and every attention kernel attends as
the pure-torch reference does over ``dequantize``'s values. The kernels divide by a scale as a
multiplication by its float32 reciprocal, as ``quantize`` does, so that all of them write the same
bytes. Outputs are close to, not the same as, those of an ``"auto"`` cache: greedy tokens may differ.
"""

import struct

import torch

KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the cache tensors are allocated with."""
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def inverse_scale(scale: float) -> float:
    """1 / scale in float32: what every store kernel multiplies by. (Rounded without a torch op,
    which a CPU graph's capture would refuse as a value read.)"""
    return struct.unpack("f", struct.pack("f", 1.0 / scale))[0]


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in ``dtype`` (an fp8 dtype): rounded to nearest even, clamped to the largest finite."""
    largest = torch.finfo(dtype).max
    return (x.float() * inverse_scale(scale)).clamp_(-largest, largest).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What attention reads from cache values x: ``x * scale`` in ``dtype``; x itself from a cache
    that is not fp8."""
    if not is_fp8(x.dtype):
        return x
    return (x.float() * scale).to(dtype)
