// The 8-bit KV cache's two fp8 formats on CPU (kv_cache_dtype.py): decoding a cached code to
// float32 for attention, and encoding a key or value into its code for the store.
//
// x86 CPUs have no fp8 instructions. Decoding is a lookup in a 256-entry table of each format's
// values (1 KB, in L1 beside the loop that reads it), made once by bit arithmetic: one load per
// value, exact for every code. Building float32 bits directly instead (shift the exponent and
// mantissa into place, then multiply by a power of two) would make e4m3's subnormal codes
// float32 denormals first, which a flush-to-zero mode, set by any library in the process, turns
// into 0. Encoding happens only for a step's new tokens (one row per token, where attention
// reads every cached row every step), so it is written for exactness: float32's mantissa rounded
// to 3 (2) bits to nearest even in the integer bits, or, below the smallest normal value, the
// value in units of the subnormal step rounded to nearest even; the same bytes as torch's .to().
// Codes for NaN and infinity are never written (values are clamped to the largest finite) and so
// never decoded.
#pragma once
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

// A cached value's code, one type per format so that overloads pick the format's table.
struct fp8_e4m3 { uint8_t bits; };  // torch.float8_e4m3fn: bias 7, 3 mantissa bits, largest 448
struct fp8_e5m2 { uint8_t bits; };  // torch.float8_e5m2: bias 15, 2 mantissa bits, largest 57344

template <int MANT, int BIAS>
static std::array<float, 256> fp8_table() {
  std::array<float, 256> table{};
  for (int code = 0; code < 256; code++) {
    const int exponent = (code & 0x7F) >> MANT, mantissa = code & ((1 << MANT) - 1);
    const float value = exponent ? std::ldexp(float((1 << MANT) + mantissa), exponent - BIAS - MANT)
                                 : std::ldexp(float(mantissa), 1 - BIAS - MANT);  // subnormal
    table[code] = code & 0x80 ? -value : value;
  }
  return table;
}
static const std::array<float, 256> E4M3_VALUES = fp8_table<3, 7>(), E5M2_VALUES = fp8_table<2, 15>();

static inline float to_float(fp8_e4m3 x) { return E4M3_VALUES[x.bits]; }
static inline float to_float(fp8_e5m2 x) { return E5M2_VALUES[x.bits]; }

// x (already multiplied by the inverse scale) as a code of MANT mantissa bits and exponent BIAS.
template <int MANT, int BIAS>
static inline uint8_t fp8_code(float x, float largest) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint8_t sign = (bits >> 24) & 0x80;
  const float a = std::fmin(std::fabs(x), largest);
  std::memcpy(&bits, &a, sizeof bits);
  if (a < std::ldexp(1.f, 1 - BIAS))  // subnormal: a multiple of the step, 2^(1 - BIAS - MANT)
    return sign | uint8_t(std::nearbyint(std::ldexp(a, BIAS + MANT - 1)));
  bits += (1u << (22 - MANT)) - 1 + ((bits >> (23 - MANT)) & 1);
  return sign | uint8_t((bits >> (23 - MANT)) - ((127 - BIAS) << MANT));
}
static inline void store(float x, fp8_e4m3* out) { out->bits = fp8_code<3, 7>(x, 448.f); }
static inline void store(float x, fp8_e5m2* out) { out->bits = fp8_code<2, 15>(x, 57344.f); }
