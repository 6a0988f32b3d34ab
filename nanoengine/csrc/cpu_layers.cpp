// The decoder's element-wise ops on CPU, each one pass over its rows: vLLM's fused_add_rms_norm,
// silu_and_mul and rotary_embedding. torch runs them as 8, 3 and 11 small ops; at decode batch
// sizes each op costs more to launch than to compute, and in prefill each is a pass over memory.
//
// nanoengine/cpu_library.py compiles this file on first use; cpu_kernels.py checks the arguments'
// metadata and calls it through ctypes (rotary checks its positions itself). T is
// bfloat16 (as its bits) or float; x, residual and out are contiguous [rows, cols].
#include <cmath>
#include <cstddef>

#include "cpu_bfloat16.h"
#include "cpu_graph.h"

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
    for (int j = 0; j < cols; j++)
      store(to_float(weight[j]) * round_to<T>(to_float(normalised[j]) * rms_inverse), out + size_t(i) * cols + j);
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
      store(round_to<T>(g / (1.f + std::exp(-g))) * to_float(up[j]), out + size_t(i) * cols + j);
    }
  }
}

// Rotary embedding, in place: every head of token i turns by angle positions[i]. Each row of
// cos_sin_cache (float32) is [c, c, -s, s], so that with x = [x1, x2] the result [x1 c - x2 s,
// x2 c + x1 s] is x * cos + [x2, x1] * sin. cos and sin are rounded to T first, and each product
// and the sum after, as HF's ops round them. A token's heads are contiguous, tokens `stride` apart
// (q and k are views into the qkv projection's output).
template <typename T>
static void rotate(T* x, int64_t stride, int heads, int head_dim, const int64_t* positions, const float* cos_sin_cache,
                   int tokens, int num_threads) {
  const int half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (size_t(tokens) * heads * head_dim >= (1 << 16))
  for (int i = 0; i < tokens; i++) {
    const float* cos = cos_sin_cache + positions[i] * 2 * head_dim;
    const float* sin = cos + head_dim;
    for (int h = 0; h < heads; h++) {
      T* x1 = x + i * stride + h * head_dim;
      T* x2 = x1 + half;
      for (int j = 0; j < half; j++) {
        const float a = to_float(x1[j]), b = to_float(x2[j]);
        store(round_to<T>(a * round_to<T>(cos[j])) + round_to<T>(b * round_to<T>(sin[j])), x1 + j);
        store(round_to<T>(b * round_to<T>(cos[half + j])) + round_to<T>(a * round_to<T>(sin[half + j])), x2 + j);
      }
    }
  }
}

// Every position is checked before q or k is touched: 4 (and nothing rotated) if one lies outside
// the table's [0, max_positions) rows, else 0.
template <typename T>
static int rotary(T* q, T* k, int64_t q_stride, int64_t k_stride, int q_heads, int k_heads, int head_dim,
                  const int64_t* positions, const float* cos_sin_cache, int64_t max_positions, int tokens,
                  int num_threads) {
  for (int i = 0; i < tokens; i++)
    if (positions[i] < 0 || positions[i] >= max_positions) return 4;
  rotate(q, q_stride, q_heads, head_dim, positions, cos_sin_cache, tokens, num_threads);
  rotate(k, k_stride, k_heads, head_dim, positions, cos_sin_cache, tokens, num_threads);
  return 0;
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
int rotary_bfloat16(uint16_t* q, uint16_t* k, int64_t q_stride, int64_t k_stride, int q_heads, int k_heads,
                    int head_dim, const int64_t* positions, const float* cos_sin_cache, int64_t max_positions,
                    int tokens, int num_threads) {
  return rotary(q, k, q_stride, k_stride, q_heads, k_heads, head_dim, positions, cos_sin_cache, max_positions, tokens,
                num_threads);
}
int rotary_float32(float* q, float* k, int64_t q_stride, int64_t k_stride, int q_heads, int k_heads, int head_dim,
                   const int64_t* positions, const float* cos_sin_cache, int64_t max_positions, int tokens,
                   int num_threads) {
  return rotary(q, k, q_stride, k_stride, q_heads, k_heads, head_dim, positions, cos_sin_cache, max_positions, tokens,
                num_threads);
}
}

// Each entry point's twin for a CPU graph's replay (cpu_graph.h).
REPLAYABLE(add_rms_norm_bfloat16)
REPLAYABLE(add_rms_norm_float32)
REPLAYABLE(silu_and_mul_bfloat16)
REPLAYABLE(silu_and_mul_float32)
REPLAYABLE(rotary_bfloat16)
REPLAYABLE(rotary_float32)
