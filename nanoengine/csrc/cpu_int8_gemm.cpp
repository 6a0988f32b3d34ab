// The int8 GEMM path (cpu_int8_gemm.py): x rotated and rounded to int8 before the GEMM, the int32
// products back into x's dtype after it, and, on CPUs with AMX, the GEMM itself.
//
// quantize_activations: per row of x, each block of `block` values (a power of two, 16 to 512; 1:
// none) times the Hadamard matrix of that size (entries +-1), then v = round(x' / scale) with
// scale = largest |x'| / 127. The weight was multiplied by the same matrix
// (int8_gemm.quantize_weight), so the product is unchanged, and the rotation spreads a channel far
// larger than the rest over its block.
// rescale: out[m, n] = acc[m, n] * x_scale[m] * w_scale[n] + bias[n].
// amx_gemm: the GEMM by AMX tiles and the rescale as each block of sums is done (below).
//
// Plain loops and vectors of 16 floats (GCC's vector extension): with -O3 -march=native the
// compiler turns them into whatever the CPU has.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_bfloat16.h"
#include "cpu_graph.h"

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

// The Hadamard matrix's first four rounds of butterflies (pairs 1, 2, 4 and 8 apart) within 16
// values: lane j meets lane j ^ h, the lower of the two keeps the sum, the upper the difference.
static inline f32x16 hadamard16(f32x16 v) {
  const i32x16 partner1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
  const i32x16 partner2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
  const i32x16 partner4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
  const i32x16 partner8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
  const f32x16 sign1 = {1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1};
  const f32x16 sign2 = {1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1};
  const f32x16 sign4 = {1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1};
  const f32x16 sign8 = {1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1};
  v = __builtin_shuffle(v, partner1) + v * sign1;
  v = __builtin_shuffle(v, partner2) + v * sign2;
  v = __builtin_shuffle(v, partner4) + v * sign4;
  return __builtin_shuffle(v, partner8) + v * sign8;
}

static inline f32x16 load16(const float* x) {
  f32x16 v;
  std::memcpy(&v, x, sizeof v);
  return v;
}
static inline f32x16 load16(const uint16_t* x) {  // 16 bfloat16 as floats: each the top half of one
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
  u16x16 halves;
  std::memcpy(&halves, x, sizeof halves);
  const u32x16 bits = __builtin_convertvector(halves, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
static inline void store16(f32x16 v, float* x) { std::memcpy(x, &v, sizeof v); }
static inline f32x16 max_abs(f32x16 largest, f32x16 v) {
  v = v < 0 ? -v : v;
  return largest > v ? largest : v;
}

// Each block of `block` values of x (K of them, block from 16 up) times the Hadamard matrix, into
// r: log2(block) rounds of butterflies, pairs h apart for h = 1, 2, 4, ..; the first four within
// each vector as x is read, the rest between whole vectors, two rounds at a time where two are left
// (rounds h and 2h over four vectors a, b, c, d, each pass over r in L1 costing its loads and
// stores). The last pass also finds the largest |value|, which it returns. Folding the reading of
// x and the search for the largest into the rounds' passes, rather than a pass each, made the pass
// that rounds x 1.1-1.4x faster (41 and 4,885 rows, K = 576 and 1,536; three interleaved rounds).
template <typename T>
static float hadamard(const T* x, float* r, int K, int block) {
  f32x16 largest = {};
  bool last = block == 16;
  for (int k = 0; k < K; k += 16) {
    const f32x16 v = hadamard16(load16(x + k));
    if (last) largest = max_abs(largest, v);
    store16(v, r + k);
  }
  int h = 16;
  for (; 4 * h <= block; h *= 4) {
    last = 4 * h == block;
    for (int start = 0; start < K; start += 4 * h)
      for (int k = start; k < start + h; k += 16) {
        const f32x16 a = load16(r + k), b = load16(r + k + h), c = load16(r + k + 2 * h), d = load16(r + k + 3 * h);
        const f32x16 v[4] = {(a + b) + (c + d), (a - b) + (c - d), (a + b) - (c + d), (a - b) - (c - d)};
        for (int i = 0; i < 4; i++) {
          if (last) largest = max_abs(largest, v[i]);
          store16(v[i], r + k + i * h);
        }
      }
  }
  if (h < block)
    for (int start = 0; start < K; start += 2 * h)
      for (int k = start; k < start + h; k += 16) {
        const f32x16 a = load16(r + k), b = load16(r + k + h);
        largest = max_abs(max_abs(largest, a + b), a - b);
        store16(a + b, r + k);
        store16(a - b, r + k + h);
      }
  float top = 0.0f;
  for (int lane = 0; lane < 16; lane++) top = std::max(top, largest[lane]);
  return top;
}

template <typename T>
static void quantize_activations(const T* x, int64_t x_stride, int M, int K, int block, int8_t* q,
                                 int64_t q_stride, float* scales, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (M >= 16)
  {
    std::vector<float> rotated(K);
#pragma omp for
    for (int m = 0; m < M; m++) {
      const T* row = x + m * x_stride;
      float* r = rotated.data();
      float largest = 0.0f;
      if (block >= 16) {
        largest = hadamard(row, r, K, block);
      } else {
        for (int k = 0; k < K; k++) r[k] = to_float(row[k]);
        for (int k = 0; k < K; k++) largest = std::max(largest, std::fabs(r[k]));
      }
      const float inverse = largest > 0 ? 127 / largest : 0.0f;
      int8_t* out = q + m * q_stride;
      for (int k = 0; k < K; k++) out[k] = int8_t(std::nearbyint(r[k] * inverse));
      scales[m] = largest / 127;
    }
  }
}

// One row of out from its row of int32 sums. Both GEMMs end here, with the multiply-adds spelled
// out, so that they give the same bits for the same sums.
template <typename T>
static inline void rescale_row(const int32_t* acc, float x_scale, const float* w_scales, const T* bias, T* y,
                               int N) {
#pragma omp simd
  for (int n = 0; n < N; n++)
    store(std::fma(float(acc[n]) * x_scale, w_scales[n], bias ? to_float(bias[n]) : 0.0f), &y[n]);
}

template <typename T>
static void rescale(const int32_t* acc, const float* x_scales, const float* w_scales, const T* bias, T* out,
                    int M, int N, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (int64_t(M) * N >= (1 << 14))
  for (int m = 0; m < M; m++)
    rescale_row(acc + int64_t(m) * N, x_scales[m], w_scales, bias, out + int64_t(m) * N, N);
}

// The GEMM on AMX (cpu_amx.h): tdpbssd multiplies a tile of x (16 rows, 64 values of k, int8)
// by a tile of the weight (64 values of k for 16 columns, 16 rows of 4 k's per column) into
// 16 x 16 int32 sums. oneDNN's int8 GEMM as torch calls it (torch._int_mm) does not use AMX, nor
// fold in the rescale; this does, two to four times faster (docs/quantization.md). A thread takes
// a strip of 32 columns and sweeps a chunk of blocks of 32 rows of x along it (AMX_CHUNK at a
// time, as cpu_linear.cpp does), so the strip's weight is read from memory once a chunk and then
// from cache; each block's sums are rescaled as soon as it is done.
//
// Layouts: q int8 [ceil(M / 32) * 32, Kp] (Kp = K rounded up to 64; the padding may hold
// anything, as the weight is zero there); w from int8_gemm.pack_weight, [ceil(N / 32) * 2, Kp / 64,
// 16, 64]: tile (s, b) holds columns 16s.. of k block b, row r, bytes 4j..4j + 3 being
// weight[16s + j, 64b + 4r ..] (zero past N and K).
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include "cpu_amx.h"

constexpr int TILE_SIZE = 16 * TILE_BYTES;

extern "C" int amx_ready() { return amx_granted() ? 0 : -1; }

template <typename T>
static int amx_gemm(const int8_t* q, const float* x_scales, int M, int Kp, const int8_t* w, const float* w_scales,
                    const T* bias, T* out, int N, int num_threads) {
  const int strips = (N + 31) / 32, k_blocks = Kp / TILE_BYTES, row_blocks = (M + 31) / 32;
  const bool stream = streams_out(out, M, N, sizeof(T));
#pragma omp parallel num_threads(num_threads)
  {
    configure_tiles();
    alignas(64) int32_t sums[32][32];
    for (int chunk = 0; chunk < row_blocks; chunk += AMX_CHUNK) {
#pragma omp for schedule(static)
      for (int s = 0; s < strips; s++) {
        const int8_t* w0 = w + int64_t(2 * s) * k_blocks * TILE_SIZE;  // the strip's two columns of tiles
        const int8_t* w1 = w0 + int64_t(k_blocks) * TILE_SIZE;
        const int n0 = 32 * s, columns = std::min(32, N - n0);
        alignas(64) float w_scale[32] = {};
        alignas(64) T b[32] = {};
        std::copy(w_scales + n0, w_scales + n0 + columns, w_scale);
        if (bias) std::copy(bias + n0, bias + n0 + columns, b);
        for (int r = chunk; r < std::min(row_blocks, chunk + AMX_CHUNK); r++) {
          const int8_t* q0 = q + int64_t(32 * r) * Kp;
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          // the first block of rows prefetches the next strip, as cpu_linear.cpp's does
          const int8_t* next = r == chunk && s + 1 < strips ? w1 + int64_t(k_blocks) * TILE_SIZE : nullptr;
          const bool lower_half = M > 32 * r + 16;  // a last block of at most 16 rows skips it
          for (int kb = 0; kb < k_blocks; kb++) {
            if (next) prefetch_tiles(reinterpret_cast<const char*>(next + kb * 2 * TILE_SIZE));
            _tile_loadd(6, w0 + kb * TILE_SIZE, TILE_BYTES);
            _tile_loadd(7, w1 + kb * TILE_SIZE, TILE_BYTES);
            _tile_loadd(4, q0 + kb * TILE_BYTES, Kp);
            _tile_dpbssd(0, 4, 6);
            _tile_dpbssd(1, 4, 7);
            if (lower_half) {
              _tile_loadd(5, q0 + 16 * Kp + kb * TILE_BYTES, Kp);
              _tile_dpbssd(2, 5, 6);
              _tile_dpbssd(3, 5, 7);
            }
          }
          store_sums(sums);
          for (int i = 0, m = 32 * r; i < 32 && m < M; i++, m++) {
            alignas(64) T y[32];
            rescale_row(sums[i], x_scales[m], w_scale, bias ? b : nullptr, y, 32);
            T* o = out + int64_t(m) * N + n0;
            if (columns < 32) {
              std::copy(y, y + columns, o);
              continue;
            }
            for (int byte = 0; byte < int(sizeof y); byte += 64)
              store_line(reinterpret_cast<char*>(o) + byte, _mm512_load_si512(reinterpret_cast<char*>(y) + byte), stream);
          }
        }
      }
    }
    _mm_sfence();
    _tile_release();
  }
  return 0;
}
#else
extern "C" int amx_ready() { return -1; }  // built for a CPU without AMX
template <typename T>
static int amx_gemm(const int8_t*, const float*, int, int, const int8_t*, const float*, const T*, T*, int, int) {
  return -1;
}
#endif

extern "C" {
void quantize_activations_float32(const float* x, int64_t x_stride, int M, int K, int block, int8_t* q,
                                  int64_t q_stride, float* scales, int num_threads) {
  quantize_activations(x, x_stride, M, K, block, q, q_stride, scales, num_threads);
}
void quantize_activations_bfloat16(const uint16_t* x, int64_t x_stride, int M, int K, int block, int8_t* q,
                                   int64_t q_stride, float* scales, int num_threads) {
  quantize_activations(x, x_stride, M, K, block, q, q_stride, scales, num_threads);
}
void rescale_float32(const int32_t* acc, const float* x_scales, const float* w_scales, const float* bias,
                     float* out, int M, int N, int num_threads) {
  rescale(acc, x_scales, w_scales, bias, out, M, N, num_threads);
}
void rescale_bfloat16(const int32_t* acc, const float* x_scales, const float* w_scales, const uint16_t* bias,
                      uint16_t* out, int M, int N, int num_threads) {
  rescale(acc, x_scales, w_scales, bias, out, M, N, num_threads);
}
int amx_gemm_float32(const int8_t* q, const float* x_scales, int M, int Kp, const int8_t* w, const float* w_scales,
                     const float* bias, float* out, int N, int num_threads) {
  return amx_gemm(q, x_scales, M, Kp, w, w_scales, bias, out, N, num_threads);
}
int amx_gemm_bfloat16(const int8_t* q, const float* x_scales, int M, int Kp, const int8_t* w, const float* w_scales,
                      const uint16_t* bias, uint16_t* out, int N, int num_threads) {
  return amx_gemm(q, x_scales, M, Kp, w, w_scales, bias, out, N, num_threads);
}
}

// Each entry point's twin for a CPU graph's replay (cpu_graph.h).
REPLAYABLE(quantize_activations_float32)
REPLAYABLE(quantize_activations_bfloat16)
REPLAYABLE(rescale_float32)
REPLAYABLE(rescale_bfloat16)
REPLAYABLE(amx_gemm_float32)
REPLAYABLE(amx_gemm_bfloat16)
