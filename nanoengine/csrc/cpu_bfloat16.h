// bfloat16 <-> float32 for nanoengine's CPU kernels. A bfloat16 is the top half of a float32's
// bits; the kernels take bfloat16 tensors as uint16_t and compute in float32.
#pragma once
#include <cstdint>
#include <cstring>

static inline float to_float(float x) { return x; }
static inline float to_float(uint16_t bf16) {
  uint32_t bits = uint32_t(bf16) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}
static inline void store(float x, float* out) { *out = x; }
static inline void store(float x, uint16_t* out) {  // to bfloat16, rounding to nearest even
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof x);
  *out = uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}
// x rounded to T and read back: the value a torch op computing in T would have stored.
template <typename T>
static inline float round_to(float x) {
  T t;
  store(x, &t);
  return to_float(t);
}
