// The decoder's element-wise ops on CPU, each one pass over its rows: vLLM's fused_add_rms_norm
// and silu_and_mul. torch runs them as 8 and 3 small ops; at decode batch sizes each op costs
// more to launch than to compute, and in prefill each is a pass over memory.
//
// nanoengine/cpu_kernels.py compiles this file on first use and calls it through ctypes. T is
// bfloat16 (as its bits) or float; x, residual and out are contiguous [rows, cols].
#include <cmath>
#include <cstddef>

#include "cpu_bfloat16.h"

// The decoder's residual add and the RMSNorm after it (vLLM's fused_add_rms_norm), row by row:
// residual += x, rounded to T as torch's add would; out = weight * normalised residual, with the
// normalisation in float32 and rounded to T before the weight, as HF's RMSNorm does. With no
// residual (the first layer), out = RMSNorm(x). One task per block of rows.
template <typename T>
static void add_rms_norm(const T* x, T* residual, const T* weight, T* out, int rows, int cols, float eps,
                         int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (size_t(rows) * cols >= (1 << 16))
  for (int i = 0; i < rows; i++) {
    const T* xi = x + size_t(i) * cols;
    T* ri = residual ? residual + size_t(i) * cols : nullptr;
    float sum_squares = 0.f;
    for (int j = 0; j < cols; j++) {
      float value = to_float(xi[j]);
      if (ri) {
        store(value + to_float(ri[j]), ri + j);
        value = to_float(ri[j]);
      }
      sum_squares += value * value;
    }
    const float rms_inverse = 1.f / std::sqrt(sum_squares / cols + eps);
    const T* normalised = ri ? ri : xi;
    for (int j = 0; j < cols; j++) {
      T n;
      store(to_float(normalised[j]) * rms_inverse, &n);
      store(to_float(weight[j]) * to_float(n), out + size_t(i) * cols + j);
    }
  }
}

// The gated MLP's activation: x holds [gate | up] per row, out = SiLU(gate) * up, each rounded
// to T as torch's two ops would.
template <typename T>
static void silu_and_mul(const T* x, T* out, int rows, int cols, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (size_t(rows) * cols >= (1 << 16))
  for (int i = 0; i < rows; i++) {
    const T* gate = x + size_t(i) * 2 * cols;
    const T* up = gate + cols;
    for (int j = 0; j < cols; j++) {
      const float g = to_float(gate[j]);
      T silu;
      store(g / (1.f + std::exp(-g)), &silu);
      store(to_float(silu) * to_float(up[j]), out + size_t(i) * cols + j);
    }
  }
}

// The entry points ctypes calls: each kernel for bfloat16 (T = uint16_t) and for float32.
extern "C" {
void add_rms_norm_bfloat16(const uint16_t* x, uint16_t* residual, const uint16_t* weight, uint16_t* out, int rows,
                           int cols, float eps, int num_threads) {
  add_rms_norm(x, residual, weight, out, rows, cols, eps, num_threads);
}
void add_rms_norm_float32(const float* x, float* residual, const float* weight, float* out, int rows, int cols,
                          float eps, int num_threads) {
  add_rms_norm(x, residual, weight, out, rows, cols, eps, num_threads);
}
void silu_and_mul_bfloat16(const uint16_t* x, uint16_t* out, int rows, int cols, int num_threads) {
  silu_and_mul(x, out, rows, cols, num_threads);
}
void silu_and_mul_float32(const float* x, float* out, int rows, int cols, int num_threads) {
  silu_and_mul(x, out, rows, cols, num_threads);
}
}
