// The two passes around oneDNN's int8 GEMM (int8_gemm.py): x into two int8 digits per value before
// it, the int32 products back into x's dtype after it.
//
// quantize_activations: per row of x, v = round(x / scale) with scale = largest |x| / (127 * 128),
// so |v| <= 16256, written as two int8 digits v = 128 * hi + lo (hi in -127..127, lo in -64..64):
// row m's digits are rows 2m (hi) and 2m + 1 (lo) of q, so one GEMM multiplies both.
// rescale: out[m, n] = (128 * acc[2m, n] + acc[2m + 1, n]) * x_scale[m] * w_scale[n] + bias[n].
//
// Plain loops: with -O3 -march=native the compiler vectorises them for whatever the CPU has.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_bfloat16.h"
#include "cpu_graph.h"

constexpr float DIGIT = 128;           // lo's weight is 1, hi's 128
constexpr float LARGEST = 127 * DIGIT;  // |v| at most, so that hi fits int8

template <typename T>
static void quantize_activations(const T* x, int64_t x_stride, int M, int K, int8_t* q, float* scales,
                                 int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (M >= 16)
  for (int m = 0; m < M; m++) {
    const T* row = x + m * x_stride;
    float largest = 0.0f;
    for (int k = 0; k < K; k++) largest = std::max(largest, std::fabs(to_float(row[k])));
    const float inverse = largest > 0 ? LARGEST / largest : 0.0f;
    int8_t* hi = q + int64_t(2 * m) * K;
    int8_t* lo = hi + K;
    for (int k = 0; k < K; k++) {
      const float v = std::nearbyint(to_float(row[k]) * inverse);
      const float h = std::nearbyint(v * (1 / DIGIT));
      hi[k] = int8_t(h);
      lo[k] = int8_t(v - DIGIT * h);
    }
    scales[m] = largest / LARGEST;
  }
}

template <typename T>
static void rescale(const int32_t* acc, const float* x_scales, const float* w_scales, const T* bias, T* out,
                    int M, int N, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (int64_t(M) * N >= (1 << 14))
  for (int m = 0; m < M; m++) {
    const int32_t* hi = acc + int64_t(2 * m) * N;
    const int32_t* lo = hi + N;
    const float xs = x_scales[m];
    T* y = out + int64_t(m) * N;
#pragma omp simd
    for (int n = 0; n < N; n++)
      store((float(hi[n]) * DIGIT + float(lo[n])) * xs * w_scales[n] + (bias ? to_float(bias[n]) : 0.0f), &y[n]);
  }
}

extern "C" {
void quantize_activations_float32(const float* x, int64_t x_stride, int M, int K, int8_t* q, float* scales,
                                  int num_threads) {
  quantize_activations(x, x_stride, M, K, q, scales, num_threads);
}
void quantize_activations_bfloat16(const uint16_t* x, int64_t x_stride, int M, int K, int8_t* q, float* scales,
                                   int num_threads) {
  quantize_activations(x, x_stride, M, K, q, scales, num_threads);
}
void rescale_float32(const int32_t* acc, const float* x_scales, const float* w_scales, const float* bias,
                     float* out, int M, int N, int num_threads) {
  rescale(acc, x_scales, w_scales, bias, out, M, N, num_threads);
}
void rescale_bfloat16(const int32_t* acc, const float* x_scales, const float* w_scales, const uint16_t* bias,
                      uint16_t* out, int M, int N, int num_threads) {
  rescale(acc, x_scales, w_scales, bias, out, M, N, num_threads);
}
}

// Each entry point's twin for a CPU graph's replay (cpu_graph.h).
REPLAYABLE(quantize_activations_float32)
REPLAYABLE(quantize_activations_bfloat16)
REPLAYABLE(rescale_float32)
REPLAYABLE(rescale_bfloat16)
