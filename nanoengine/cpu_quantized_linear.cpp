// The weight-only quantized linear layers on CPU, for AVX2: out = x @ W.T (+ bias), W in 4 or 8 bits.
//
// A decode step at batch 1 streams every weight of the model once, so its speed is set by the
// weight's bytes: 0.625 per weight in int4, against 4 in float32. To read them that fast, the
// arithmetic must keep up: widening each weight to float32 and multiplying there costs more
// instructions than the memory costs time. So, as llama.cpp does, each row of x is quantized too,
// to int8 in blocks of 32 with a float scale, and the products are taken 32 at a time in integer
// arithmetic (vpmaddubsw: unsigned bytes times signed bytes, pairs summed). Only each block's sum
// becomes a float, scaled by the weight block's scale times the x block's.
//
// int4: w = q * scale + min per block of 32 along a row (GGUF's Q4_1), q in 0..15. With x ~ xs * p
// (p the int8 values, xs their scale):
//   sum_k w_k x_k ~ scale * xs * sum_k q_k p_k + min * sum_k x_k + 7.5 * scale * (sum_k x_k - xs * sum_k p_k).
// The middle term uses the x block's exact sum. The last one is zero but for x's rounding: it makes
// the rounding errors meet q - 7.5, centred on zero, rather than q, whose errors would add up (on
// tests/test_quantization.py's weights, the largest error fell from 2.6% of the largest output to
// 0.9%). Both sums are computed once per row of x.
// int8: w = q * scale[row], q in -127..127. vpmaddubsw wants one side unsigned: |q| times x with
// q's sign moved onto it (vpsignb), as llama.cpp does for Q8_0.
//
// Layouts (quantization.py packs them). The rows of W come in tiles of TILE = 4; a tile's blocks
// are stored one after another, each holding that block of the tile's 4 rows side by side, so a
// thread reads its tiles front to back as one stream.
//   int4: uint8 [N / 4, K / 32, 80]: 4 rows x 16 bytes of q (byte i: element i in the low nibble,
//         element 16 + i in the high one), then 4 float16 scales, then 4 float16 mins.
//   int8: int8 [N / 4, K / 32, 4, 32], and float32 scales [N].
// x: float32 or bfloat16 [M, K], rows x_stride elements apart; out: x's dtype [M, N], contiguous;
// bias: x's dtype [N] or null. K is a multiple of 32, N of 4.
// nanoengine/cpu_library.py compiles this file on first use; cpu_kernels.py checks the arguments
// and calls it through ctypes.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_bfloat16.h"

constexpr int BLOCK = 32;   // weights (and x values) sharing one scale
constexpr int TILE = 4;     // rows of W computed together: each x block is loaded once for four
constexpr int MAX_ROWS = 2; // rows of x computed together: 2 x 4 accumulators, 4 weight registers
constexpr int CHUNK = 256;  // rows of x whose int8 copy stays in cache while a tile is read

// x's rows in int8, as the kernels read them: per row, K values, and per block a scale, the
// block's sum of the original values, and that sum less the int8 values' (their rounding).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> scale, sum, rounding;
};

static inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
static inline __m256 load8(const uint16_t* x) {  // bfloat16 is float32's top half
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

static inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// One block of 32 values: its largest magnitude maps to 127.
template <typename T>
static void quantize_block(const T* x, int8_t* q, float* scale, float* sum, float* rounding) {
  __m256 v[4], amax = _mm256_setzero_ps(), total = _mm256_setzero_ps();
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  for (int i = 0; i < 4; i++) {
    v[i] = load8(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[i]));
    total = _mm256_add_ps(total, v[i]);
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float largest = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  *scale = largest / 127;
  *sum = horizontal_sum(total);
  const __m256 inverse = _mm256_set1_ps(largest > 0 ? 127 / largest : 0);
  __m256i n[4];
  for (int i = 0; i < 4; i++) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));  // rounds to nearest
  const __m256i q_total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
  *rounding = *sum - *scale * horizontal_sum(_mm256_cvtepi32_ps(q_total));
  // int32 -> int8 with packs, which interleave 128-bit lanes; the permute puts them back in order
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

template <typename T>
static void quantize_rows(const T* x, int64_t x_stride, int M, int K, QuantizedRows& rows, int num_threads) {
  const int blocks = K / BLOCK;
  rows.q.resize(size_t(M) * K);
  rows.scale.resize(size_t(M) * blocks);
  rows.sum.resize(size_t(M) * blocks);
  rows.rounding.resize(size_t(M) * blocks);
#pragma omp parallel for num_threads(num_threads) if (M >= 16)
  for (int m = 0; m < M; m++)
    for (int b = 0; b < blocks; b++)
      quantize_block(x + m * x_stride + b * BLOCK, &rows.q[size_t(m) * K + b * BLOCK],
                     &rows.scale[size_t(m) * blocks + b], &rows.sum[size_t(m) * blocks + b],
                     &rows.rounding[size_t(m) * blocks + b]);
}

// Eight sums of four adjacent products, as floats: unsigned bytes u times signed bytes s.
static inline __m256 dot_u8_s8(__m256i u, __m256i s) {
  const __m256i pairs = _mm256_maddubs_epi16(u, s);  // |u| <= 127 in int8, <= 15 in int4: no saturation
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// 16 bytes of packed nibbles as 32 bytes 0..15: low nibbles first, then high ones.
static inline __m256i unpack_nibbles(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);
  return _mm256_and_si256(both, _mm256_set1_epi8(15));
}

template <typename T>
static void store_rows(const float (*sums)[TILE], int rows, const T* bias, T* out, int64_t N) {
  for (int r = 0; r < rows; r++)
    for (int n = 0; n < TILE; n++) store(sums[r][n] + (bias ? to_float(bias[n]) : 0.0f), out + r * N + n);
}

// ROWS rows of x (from row m) against one int4 tile; blocks = K / 32.
template <int ROWS, typename T>
static void tile_int4(const QuantizedRows& x, int m, int K, const uint8_t* tile, const T* bias, T* out, int64_t N) {
  const int blocks = K / BLOCK;
  __m256 acc[ROWS][TILE];
  __m128 min_terms[ROWS];  // the min and rounding terms, for the tile's 4 rows
  for (int r = 0; r < ROWS; r++) {
    min_terms[r] = _mm_setzero_ps();
    for (int n = 0; n < TILE; n++) acc[r][n] = _mm256_setzero_ps();
  }
  for (int b = 0; b < blocks; b++) {
    const uint8_t* block = tile + b * 80;
    __m256i w[TILE];
    for (int n = 0; n < TILE; n++) w[n] = unpack_nibbles(block + 16 * n);
    const __m128 scales = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 64)));
    const __m128 mins = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 72)));
    alignas(16) float s[4];
    _mm_store_ps(s, scales);
    for (int r = 0; r < ROWS; r++) {
      const size_t xb = size_t(m + r) * blocks + b;
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&x.q[size_t(m + r) * K + b * BLOCK]));
      const float xs = x.scale[xb];
      for (int n = 0; n < TILE; n++)
        acc[r][n] = _mm256_fmadd_ps(dot_u8_s8(w[n], xq), _mm256_set1_ps(s[n] * xs), acc[r][n]);
      min_terms[r] = _mm_fmadd_ps(mins, _mm_set1_ps(x.sum[xb]), min_terms[r]);
      min_terms[r] = _mm_fmadd_ps(scales, _mm_set1_ps(7.5f * x.rounding[xb]), min_terms[r]);
    }
  }
  float sums[ROWS][TILE];
  for (int r = 0; r < ROWS; r++) {
    alignas(16) float mt[4];
    _mm_store_ps(mt, min_terms[r]);
    for (int n = 0; n < TILE; n++) sums[r][n] = horizontal_sum(acc[r][n]) + mt[n];
  }
  store_rows(sums, ROWS, bias, out + int64_t(m) * N, N);
}

// ROWS rows of x (from row m) against one int8 tile, whose rows' scales are row_scales[0..3].
template <int ROWS, typename T>
static void tile_int8(const QuantizedRows& x, int m, int K, const int8_t* tile, const float* row_scales,
                      const T* bias, T* out, int64_t N) {
  const int blocks = K / BLOCK;
  __m256 acc[ROWS][TILE];
  for (int r = 0; r < ROWS; r++)
    for (int n = 0; n < TILE; n++) acc[r][n] = _mm256_setzero_ps();
  for (int b = 0; b < blocks; b++) {
    __m256i w[TILE], magnitude[TILE];
    for (int n = 0; n < TILE; n++) {
      w[n] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + (b * TILE + n) * BLOCK));
      magnitude[n] = _mm256_abs_epi8(w[n]);
    }
    for (int r = 0; r < ROWS; r++) {
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&x.q[size_t(m + r) * K + b * BLOCK]));
      const __m256 xs = _mm256_set1_ps(x.scale[size_t(m + r) * blocks + b]);
      for (int n = 0; n < TILE; n++)
        acc[r][n] = _mm256_fmadd_ps(dot_u8_s8(magnitude[n], _mm256_sign_epi8(xq, w[n])), xs, acc[r][n]);
    }
  }
  float sums[ROWS][TILE];
  for (int r = 0; r < ROWS; r++)
    for (int n = 0; n < TILE; n++) sums[r][n] = horizontal_sum(acc[r][n]) * row_scales[n];
  store_rows(sums, ROWS, bias, out + int64_t(m) * N, N);
}

// Rows are taken CHUNK at a time; within a chunk the threads share out the tiles, and each runs
// all the chunk's rows against its tiles, MAX_ROWS at a time. A decode step is one chunk, and
// reads the weight once.
template <typename T>
static void quantized_linear(const T* x, int64_t x_stride, const void* w, const float* row_scales, const T* bias,
                             T* out, int M, int N, int K, int num_threads) {
  if (M == 0) return;
  // Reused across calls, so a step allocates nothing. Per calling thread, and named through a
  // reference below: inside the parallel loops the name of a thread_local is each worker's own.
  static thread_local QuantizedRows caller_rows;
  QuantizedRows& rows = caller_rows;
  quantize_rows(x, x_stride, M, K, rows, num_threads);
  const int tiles = N / TILE;
  const int64_t tile_bytes = row_scales ? int64_t(K) * TILE : int64_t(K / BLOCK) * 80;
  const char* weight = static_cast<const char*>(w);
  for (int chunk = 0; chunk < M; chunk += CHUNK) {
    const int chunk_end = std::min(M, chunk + CHUNK);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int t = 0; t < tiles; t++) {
      const char* tile = weight + t * tile_bytes;
      const T* b = bias ? bias + t * TILE : nullptr;
      T* o = out + t * TILE;
      for (int m = chunk; m < chunk_end; m += MAX_ROWS) {
        const bool pair = m + 1 < chunk_end;
        if (row_scales) {
          const int8_t* q = reinterpret_cast<const int8_t*>(tile);
          pair ? tile_int8<2>(rows, m, K, q, row_scales + t * TILE, b, o, N)
               : tile_int8<1>(rows, m, K, q, row_scales + t * TILE, b, o, N);
        } else {
          const uint8_t* q = reinterpret_cast<const uint8_t*>(tile);
          pair ? tile_int4<2>(rows, m, K, q, b, o, N) : tile_int4<1>(rows, m, K, q, b, o, N);
        }
      }
    }
  }
}

// row_scales: null for int4 (its scales are in the packed weight), int8's per-row scales otherwise.
extern "C" {
void quantized_linear_float32(const float* x, int64_t x_stride, const void* w, const float* row_scales,
                              const float* bias, float* out, int M, int N, int K, int num_threads) {
  quantized_linear(x, x_stride, w, row_scales, bias, out, M, N, K, num_threads);
}
void quantized_linear_bfloat16(const uint16_t* x, int64_t x_stride, const void* w, const float* row_scales,
                               const uint16_t* bias, uint16_t* out, int M, int N, int K, int num_threads) {
  quantized_linear(x, x_stride, w, row_scales, bias, out, M, N, K, num_threads);
}
}
