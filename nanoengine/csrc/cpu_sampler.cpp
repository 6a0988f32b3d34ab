// A token per row of logits, drawn from softmax(row / temperature) by inverting its cumulative
// distribution at the row's uniform number: sampler.py's temperature, softmax and `inverse_cdf`
// in one read of the row and a second read of one chunk of it. In torch those are five passes over
// the batch's logits (the division, the softmax's three, the chunk sums), each writing or reading
// 8 MB at batch 41 over a 49,152-token vocabulary.
//
// Per row: the max (so that no exponential overflows); each chunk of CHUNK tokens' sum of
// exp((logit - max) / T), unnormalised, since only where u times the total falls matters; the
// chunk holding that point; and in it the token whose running sum first passes it. A logit of
// -inf (cut by a filter or a grammar) has no mass and is never picked. It is told by its bits:
// -ffast-math lets the compiler assume that no value is infinite.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_bfloat16.h"

constexpr int CHUNK = 256;  // sampler.py's SAMPLER_CHUNK: a chunk's logits stay in L1 for the second read

// e^x for x <= 0, as 2^n 2^f (n = round(x log2 e), |f| <= 1/2, 2^f by its Taylor series to degree
// 6), written on scalars so that GCC vectorises the loop that calls it for whatever vectors the
// CPU has; std::exp there was a call into the vector math library per 16 values, and the kernel
// 1.2-1.4x slower (41 rows of 49,152, six interleaved rounds). Below about -87 it gives 2^-126
// times a little rather than underflowing: a mass no uniform number can find among the row's.
static inline float exp_nonpositive(float x) {
  const float t = std::max(x * 1.44269504f, -126.f), n = std::nearbyint(t), f = t - n;
  float p = 1.54035304e-4f;
  for (float c : {1.33335581e-3f, 9.61812911e-3f, 5.55041087e-2f, 2.40226507e-1f, 6.93147181e-1f, 1.f}) p = p * f + c;
  const int32_t bits = (int32_t(n) + 127) << 23;  // 2^n
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

template <typename T>
static inline float mass(T logit, float max, float inverse_temperature) {
  const float x = to_float(logit);
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits == 0xFF800000u ? 0.f : exp_nonpositive((x - max) * inverse_temperature);  // 0xFF800000: -inf
}

template <typename T>
static int64_t sample_row(const T* x, int vocab, float temperature, float u, std::vector<float>& sums) {
  const float inverse_temperature = 1.f / temperature;
  float max = to_float(x[0]);
  for (int i = 1; i < vocab; i++) max = std::max(max, to_float(x[i]));
  const int chunks = (vocab + CHUNK - 1) / CHUNK;
  float total = 0.f;
  for (int c = 0; c < chunks; c++) {
    const int end = std::min(vocab, (c + 1) * CHUNK);
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int i = c * CHUNK; i < end; i++) s += mass(x[i], max, inverse_temperature);
    sums[c] = s;
    total += s;
  }
  // u is in [0, 1), but u * total may round up to total: the target stays strictly below it.
  const float target = std::min(u * total, std::nextafter(total, 0.f));
  int c = 0;
  float before = 0.f;
  while (c < chunks - 1 && before + sums[c] <= target) before += sums[c++];
  int64_t last = -1;
  for (int i = c * CHUNK, end = std::min(vocab, (c + 1) * CHUNK); i < end; i++) {
    const float p = mass(x[i], max, inverse_temperature);
    if (p == 0.f) continue;
    before += p;
    last = i;
    if (target < before) return i;
  }
  if (last >= 0) return last;  // the target past the chunk's sum as added here: its last token with mass
  for (int i = vocab - 1; i >= 0; i--)  // a chunk left with no mass by rounding: the row's last token with some
    if (mass(x[i], max, inverse_temperature) > 0.f) return i;
  return 0;
}

template <typename T>
static void sample(const T* logits, int64_t stride, int rows, int vocab, const float* temperatures,
                   const float* uniform, int64_t* out, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows > 1)
  {
    std::vector<float> sums((vocab + CHUNK - 1) / CHUNK);
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) out[r] = sample_row(logits + r * stride, vocab, temperatures[r], uniform[r], sums);
  }
}

extern "C" {
void sample_float32(const float* logits, int64_t stride, int rows, int vocab, const float* temperatures,
                    const float* uniform, int64_t* out, int num_threads) {
  sample(logits, stride, rows, vocab, temperatures, uniform, out, num_threads);
}
void sample_bfloat16(const uint16_t* logits, int64_t stride, int rows, int vocab, const float* temperatures,
                     const float* uniform, int64_t* out, int num_threads) {
  sample(logits, stride, rows, vocab, temperatures, uniform, out, num_threads);
}
}
