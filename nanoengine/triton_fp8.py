"""fp8 codes in Triton by bit arithmetic: the 8-bit KV cache's store and read on a GPU.

Triton has fp8 types, but its e4m3 (``float8e4nv``) needs sm_89 or newer: an A100 (sm_80) refuses
it. So the cache is handed to the kernels as bytes (a uint8 view) and these two helpers convert,
with integer and float32 operations that every target has, and the interpreter too:

- ``from_fp8``: e5m2 is float16's top byte, so a code shifted left by 8 is its float16; e4m3's
  exponent and mantissa, shifted into float16's, give the value / 256 exactly (e4m3's subnormals
  land on float16's), so a multiply by 256 restores it.
- ``to_fp8``: the value clamped to the largest finite one, then, for a normal value, float32's
  mantissa rounded to 3 (2) bits in the integer bits, to nearest even (a carry into the exponent is
  the next binade, as it should be); for a subnormal one, ``(a + M) - M`` with M's unit in the last
  place the subnormal step, which float addition rounds to nearest even.

Each takes ``FMT`` (``fp8_format``: 1 for e4m3fn, 2 for e5m2) and is passed to a kernel as a
constexpr argument, made by ``triton_attention.jit`` for the mode in force (compiled or
interpreted), so that the kernel calls it as a device function either way.
"""

from __future__ import annotations

import torch

from nanoengine.triton_jit import tl

E4M3, E5M2 = 1, 2


def fp8_format(dtype: torch.dtype) -> int:
    """The ``FMT`` of a cache dtype, 0 for one that is not fp8."""
    return {torch.float8_e4m3fn: E4M3, torch.float8_e5m2: E5M2}.get(dtype, 0)


def from_fp8(code, FMT: tl.constexpr):
    """uint8 codes -> their float32 values."""
    if FMT == 2:
        return (code.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(tl.float32)
    half = ((code & 0x7F).to(tl.uint16) << 7) | ((code & 0x80).to(tl.uint16) << 8)
    return half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


def to_fp8(x, FMT: tl.constexpr):
    """float32 values (already divided by the scale) -> uint8 codes."""
    if FMT == 2:  # 2 mantissa bits, exponent bias 15
        a = tl.minimum(tl.abs(x), 57344.0)
        # step 2^-16, 128's float32 ulp; a capped so that the unused lanes' int conversion stays in range
        subnormal = ((tl.minimum(a, 1.0) + 128.0) - 128.0) * 65536.0
        bits = a.to(tl.int32, bitcast=True)
        normal = ((bits + 0xFFFFF + ((bits >> 21) & 1)) >> 21) - (112 << 2)
        code = tl.where(a < 6.103515625e-05, subnormal.to(tl.int32), normal)  # below 2^-14
    else:  # 3 mantissa bits, exponent bias 7
        a = tl.minimum(tl.abs(x), 448.0)
        subnormal = ((tl.minimum(a, 1.0) + 16384.0) - 16384.0) * 512.0  # step 2^-9: 16384's float32 ulp
        bits = a.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
        code = tl.where(a < 0.015625, subnormal.to(tl.int32), normal)  # below 2^-6
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    return (code | sign).to(tl.uint8)

