// The weight-only quantized linear layers on CPU, for AVX2 and, where the CPU has it, AVX-512 VNNI:
// out = x @ W.T (+ bias), W in 4 or 8 bits.
//
// A decode step at batch 1 streams every weight of the model once, so its speed is set by the
// weight's bytes: 0.625 per weight in int4, against 4 in float32. To read them that fast, the
// arithmetic must keep up: widening each weight to float32 and multiplying there costs more
// instructions than the memory costs time. So, as llama.cpp does, each row of x is quantized too,
// to int8 in blocks of 32 with a float scale, and the products are taken 32 at a time in integer
// arithmetic (vpmaddubsw: unsigned bytes times signed bytes, pairs summed). Only each block's sum
// becomes a float, scaled by the weight block's scale times the x block's. With AVX-512 VNNI the
// products and their sums are one instruction (vpdpbusd, the same integers) on 512-bit registers
// (int4: two tiles per register; int8: a tile's rows n and n + 4): batched steps and prefill
// 1.2-1.4x faster on a Sapphire Rapids, where they are bound by these instructions; a decode
// step's layers, bound by memory, are unchanged.
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
// Layouts (quantization.py packs them). The rows of W come in tiles of TILE = 8; a tile's blocks
// are stored one after another, each holding that block of the tile's 8 rows, so a thread reads its
// tiles front to back as one stream.
//   int4: uint8 [N / 8, K / 32, 160]: 128 bytes of q, then 8 float16 scales, then 8 float16 mins.
//         The q are read as eight 32-byte vectors, vector g holding elements 4g .. 4g + 3 of the 8
//         rows (row j in bytes 4j .. 4j + 3); the 128 bytes are 4 runs of 32, run c holding vector
//         c in its low nibbles and vector c + 4 in its high ones. So vpmaddubsw of vector g with
//         x's elements 4g .. 4g + 3, broadcast, gives each row's products in its own 32-bit lane:
//         the tile's 8 dot products come out in one register, ready for the rows' 8 scales, and
//         nothing is summed across lanes. At batch 1 this took the instructions per weight byte
//         from about 0.56 (4-row tiles, a horizontal sum per row) to 0.32.
//   int8: int8 [N / 8, K / 32, 8, 32] (the tile's 8 rows side by side), and float32 scales [N].
// x: float32 or bfloat16 [M, K], rows x_stride elements apart; out: x's dtype [M, N], contiguous;
// bias: x's dtype [N] or null. K is a multiple of 32, N of 4.
// nanoengine/cpu_library.py compiles this file on first use; cpu_kernels.py checks the arguments
// and calls it through ctypes.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_bfloat16.h"
#include "cpu_graph.h"

constexpr int BLOCK = 32;      // weights (and x values) sharing one scale
constexpr int TILE = 8;        // rows of W stored (and, in int4, computed) together
constexpr int INT4_BLOCK_BYTES = TILE * (BLOCK / 2 + 2 + 2);  // q, then float16 scales and mins
constexpr int INT8_HALF = 4;   // int8 computes a tile as two halves of 4 rows
// Rows of x computed together, against one unpacked weight block: the int4 kernel holds a float
// accumulator per row beside the block's 8 unpacked vectors, which AVX-512's 32 vector registers
// have room for 8 of (AVX2's 16, for 4).
#if defined(__AVX512F__)
constexpr int MAX_ROWS = 8;
#else
constexpr int MAX_ROWS = 4;
#endif
constexpr int CHUNK = 256;     // rows of x whose int8 copy stays in cache while a tile is read
// Each thread streams its tiles from memory, and the hardware prefetcher alone left the memory bus
// partly idle: asking for the bytes PREFETCH ahead of the block being computed made a batch-1 pass
// over 30 layers' int4 weights (66 MB) 8-15% faster (int8, 3-7%); 1 KB to 4 KB ahead did as well.
constexpr int PREFETCH = 2048;

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

// acc plus eight sums of four adjacent products (in int32): unsigned bytes u times signed bytes s.
// AVX-512 VNNI does it in one instruction (vpdpbusd); AVX2 in two, through int16 pairs (vpmaddubsw:
// |u| <= 127 in int8, <= 15 in int4, so no pair saturates and both give the same integers).
static inline __m256i dot_add_u8_s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// Eight sums of four adjacent products, as floats.
static inline __m256 dot_u8_s8(__m256i u, __m256i s) {
  return _mm256_cvtepi32_ps(dot_add_u8_s8(_mm256_setzero_si256(), u, s));
}

// x's 4 int8 values at p, in every 32-bit lane.
static inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

template <typename T, int COLS>
static void store_rows(const float (*sums)[COLS], int rows, const T* bias, T* out, int64_t N) {
  for (int r = 0; r < rows; r++)
    for (int n = 0; n < COLS; n++) store(sums[r][n] + (bias ? to_float(bias[n]) : 0.0f), out + r * N + n);
}

// ROWS rows of x (from row m) against one int4 tile; blocks = K / 32. Lane j of every vector is
// the tile's row j.
template <int ROWS, typename T>
static void tile_int4(const QuantizedRows& x, int m, int K, const uint8_t* tile, const T* bias, T* out, int64_t N) {
  const int blocks = K / BLOCK;
  __m256 acc[ROWS];
  for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < blocks; b++) {
    const uint8_t* block = tile + b * INT4_BLOCK_BYTES;
    for (int line = 0; line < INT4_BLOCK_BYTES; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(block) + PREFETCH + line, _MM_HINT_T0);
    __m256i w[8];  // vector g: elements 4g .. 4g + 3 of each row, as bytes 0..15
    for (int c = 0; c < 4; c++) {
      const __m256i run = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * c));
      w[c] = _mm256_and_si256(run, _mm256_set1_epi8(15));
      w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(run, 4), _mm256_set1_epi8(15));
    }
    const __m256 scales = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 128)));
    const __m256 mins = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 144)));
    for (int r = 0; r < ROWS; r++) {
      const int8_t* xq = &x.q[size_t(m + r) * K + b * BLOCK];
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
      __m256i sums = _mm256_setzero_si256();
      for (int g = 0; g < 8; g++) sums = dot_add_u8_s8(sums, w[g], broadcast4(xq + 4 * g));
      const __m256 dots = _mm256_cvtepi32_ps(sums);
#else
      // Pairs of products summed in int16: at most 2 x 15 x 127 each, 8 x that over the block: no
      // overflow, and one widening to int32 for the whole block instead of one per vector.
      __m256i pairs = _mm256_maddubs_epi16(w[0], broadcast4(xq));
      for (int g = 1; g < 8; g++) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[g], broadcast4(xq + 4 * g)));
      const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
      const size_t xb = size_t(m + r) * blocks + b;
      acc[r] = _mm256_fmadd_ps(dots, _mm256_mul_ps(scales, _mm256_set1_ps(x.scale[xb])), acc[r]);
      acc[r] = _mm256_fmadd_ps(mins, _mm256_set1_ps(x.sum[xb]), acc[r]);
      acc[r] = _mm256_fmadd_ps(scales, _mm256_set1_ps(7.5f * x.rounding[xb]), acc[r]);
    }
  }
  float sums[ROWS][TILE];
  for (int r = 0; r < ROWS; r++) _mm256_storeu_ps(sums[r], acc[r]);
  store_rows<T, TILE>(sums, ROWS, bias, out + int64_t(m) * N, N);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool INT4_PAIRS = true;
// tile_int4 for two adjacent tiles at once, in 512-bit registers: lanes 0..7 hold the first tile's
// rows, 8..15 the second's, so each instruction does twice the work (a speculative verify step's
// few rows, and batched steps, are bound by these instructions, not by memory).
template <int ROWS, typename T>
static void tile_pair_int4(const QuantizedRows& x, int m, int K, const uint8_t* first, const T* bias, T* out,
                           int64_t N) {
  const int blocks = K / BLOCK;
  const uint8_t* second = first + int64_t(blocks) * INT4_BLOCK_BYTES;
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
  for (int b = 0; b < blocks; b++) {
    const uint8_t* block[2] = {first + b * INT4_BLOCK_BYTES, second + b * INT4_BLOCK_BYTES};
    for (const uint8_t* half : block)
      for (int line = 0; line < INT4_BLOCK_BYTES; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(half) + PREFETCH + line, _MM_HINT_T0);
    __m512i w[8];
    for (int c = 0; c < 4; c++) {
      const __m512i run = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block[0] + 32 * c))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block[1] + 32 * c)), 1);
      w[c] = _mm512_and_si512(run, _mm512_set1_epi8(15));
      w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(run, 4), _mm512_set1_epi8(15));
    }
    const auto halves = [&](int offset) {  // the two tiles' 8 float16 values at offset, as 16 floats
      return _mm512_cvtph_ps(_mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block[0] + offset))),
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(block[1] + offset)), 1));
    };
    const __m512 scales = halves(128), mins = halves(144);
    for (int r = 0; r < ROWS; r++) {
      const int8_t* xq = &x.q[size_t(m + r) * K + b * BLOCK];
      __m512i sums = _mm512_setzero_si512();
      for (int g = 0; g < 8; g++) {
        int32_t v;
        std::memcpy(&v, xq + 4 * g, sizeof v);
        sums = _mm512_dpbusd_epi32(sums, w[g], _mm512_set1_epi32(v));
      }
      const size_t xb = size_t(m + r) * blocks + b;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(scales, _mm512_set1_ps(x.scale[xb])), acc[r]);
      acc[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(x.sum[xb]), acc[r]);
      acc[r] = _mm512_fmadd_ps(scales, _mm512_set1_ps(7.5f * x.rounding[xb]), acc[r]);
    }
  }
  float sums[ROWS][2 * TILE];
  for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(sums[r], acc[r]);
  store_rows<T, 2 * TILE>(sums, ROWS, bias, out + int64_t(m) * N, N);
}
#else
constexpr bool INT4_PAIRS = false;
template <int ROWS, typename T>
static void tile_pair_int4(const QuantizedRows&, int, int, const uint8_t*, const T*, T*, int64_t) {}
#endif

// ROWS rows of x (from row m) against half an int8 tile: 4 rows, the first at q, blocks TILE rows
// apart; their scales are row_scales[0..3].
template <int ROWS, typename T>
static void half_tile_int8(const QuantizedRows& x, int m, int K, const int8_t* q, const float* row_scales,
                           const T* bias, T* out, int64_t N) {
  constexpr int H = INT8_HALF;
  const int blocks = K / BLOCK;
  __m256 acc[ROWS][H];
  for (int r = 0; r < ROWS; r++)
    for (int n = 0; n < H; n++) acc[r][n] = _mm256_setzero_ps();
  for (int b = 0; b < blocks; b++) {
    // The whole block further on, both halves' rows. A tile's halves are computed one after the
    // other, each over all its blocks, so the first pass leaves the second's bytes in cache; asked
    // for only by the second pass, they came from memory on demand (the LM head in int8 at batch 1,
    // three runs: 1.31-1.41 -> 1.25-1.33 ms).
    for (int line = 0; line < TILE * BLOCK; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(q + b * TILE * BLOCK) + PREFETCH + line, _MM_HINT_T0);
    __m256i w[H], magnitude[H];
    for (int n = 0; n < H; n++) {
      w[n] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (b * TILE + n) * BLOCK));
      magnitude[n] = _mm256_abs_epi8(w[n]);
    }
    for (int r = 0; r < ROWS; r++) {
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&x.q[size_t(m + r) * K + b * BLOCK]));
      const __m256 xs = _mm256_set1_ps(x.scale[size_t(m + r) * blocks + b]);
      for (int n = 0; n < H; n++)
        acc[r][n] = _mm256_fmadd_ps(dot_u8_s8(magnitude[n], _mm256_sign_epi8(xq, w[n])), xs, acc[r][n]);
    }
  }
  float sums[ROWS][H];
  for (int r = 0; r < ROWS; r++)
    for (int n = 0; n < H; n++) sums[r][n] = horizontal_sum(acc[r][n]) * row_scales[n];
  store_rows<T, H>(sums, ROWS, bias, out + int64_t(m) * N, N);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// half_tile_int8 for the whole tile at once in 512-bit registers: vector n holds rows n and n + 4
// (its halves), so 4 instructions do what 8 did. AVX-512 has no vpsignb: x's sign is moved onto
// the lanes where w is negative by a masked negation instead (x is never -128).
template <int ROWS, typename T>
static void tile_int8_wide(const QuantizedRows& x, int m, int K, const int8_t* q, const float* row_scales,
                           const T* bias, T* out, int64_t N) {
  constexpr int H = INT8_HALF;
  const int blocks = K / BLOCK;
  __m512 acc[ROWS][H];
  for (int r = 0; r < ROWS; r++)
    for (int n = 0; n < H; n++) acc[r][n] = _mm512_setzero_ps();
  for (int b = 0; b < blocks; b++) {
    for (int line = 0; line < TILE * BLOCK; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(q + b * TILE * BLOCK) + PREFETCH + line, _MM_HINT_T0);
    __m512i magnitude[H];
    __mmask64 negative[H];
    for (int n = 0; n < H; n++) {
      const __m512i w = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (b * TILE + n) * BLOCK))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (b * TILE + n + H) * BLOCK)), 1);
      magnitude[n] = _mm512_abs_epi8(w);
      negative[n] = _mm512_movepi8_mask(w);
    }
    for (int r = 0; r < ROWS; r++) {
      const __m256i row = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&x.q[size_t(m + r) * K + b * BLOCK]));
      const __m512i xq = _mm512_inserti64x4(_mm512_castsi256_si512(row), row, 1);
      const __m512 xs = _mm512_set1_ps(x.scale[size_t(m + r) * blocks + b]);
      for (int n = 0; n < H; n++) {
        const __m512i signed_x = _mm512_mask_sub_epi8(xq, negative[n], _mm512_setzero_si512(), xq);
        const __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), magnitude[n], signed_x);
        acc[r][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), xs, acc[r][n]);
      }
    }
  }
  float sums[ROWS][TILE];
  for (int r = 0; r < ROWS; r++)
    for (int n = 0; n < H; n++) {
      sums[r][n] = horizontal_sum(_mm512_castps512_ps256(acc[r][n])) * row_scales[n];
      sums[r][n + H] = horizontal_sum(_mm512_extractf32x8_ps(acc[r][n], 1)) * row_scales[n + H];
    }
  store_rows<T, TILE>(sums, ROWS, bias, out + int64_t(m) * N, N);
}
#endif

// Rows m..end-1 in groups, each computed by fn(std::integral_constant<int, ROWS>(), first row):
// MOST at a time, then the rest (a speculative verify step's few rows, say) in as few passes over
// the weights as can be.
template <int MOST, typename Fn>
static void row_groups(int m, int end, Fn fn) {
  for (; m + MOST <= end; m += MOST) fn(std::integral_constant<int, MOST>(), m);
  for (; m + 4 <= end; m += 4) fn(std::integral_constant<int, 4>(), m);
  if (end - m == 3) fn(std::integral_constant<int, 3>(), m);
  if (end - m == 2) fn(std::integral_constant<int, 2>(), m);
  if (end - m == 1) fn(std::integral_constant<int, 1>(), m);
}

// ROWS rows of x against one tile, in either format.
template <int ROWS, typename T>
static void tile(const QuantizedRows& x, int m, int K, const char* w, const float* row_scales, const T* bias,
                 T* out, int64_t N) {
  if (!row_scales) return tile_int4<ROWS>(x, m, K, reinterpret_cast<const uint8_t*>(w), bias, out, N);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  // 4 x 4 accumulators per row of x, at most.
  return row_groups<4>(m, m + ROWS, [&](auto group, int r) {
    tile_int8_wide<decltype(group)::value>(x, r, K, reinterpret_cast<const int8_t*>(w), row_scales, bias, out, N);
  });
#endif
  for (int half = 0; half < TILE; half += INT8_HALF)  // 2 x 4 accumulators per row of x, at most
    for (int r = 0; r < ROWS; r += 2)
      ROWS - r >= 2 ? half_tile_int8<2>(x, m + r, K, reinterpret_cast<const int8_t*>(w) + half * BLOCK,
                                        row_scales + half, bias ? bias + half : nullptr, out + half, N)
                    : half_tile_int8<1>(x, m + r, K, reinterpret_cast<const int8_t*>(w) + half * BLOCK,
                                        row_scales + half, bias ? bias + half : nullptr, out + half, N);
}

// Rows are taken CHUNK at a time; within a chunk the threads share out the tiles, and each runs
// all the chunk's rows against its tiles, MAX_ROWS at a time (int4 unpacks each weight block once
// for them all). A decode step is one chunk, and reads the weight once.
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
  const int64_t tile_bytes = row_scales ? int64_t(K) * TILE : int64_t(K / BLOCK) * INT4_BLOCK_BYTES;
  const char* weight = static_cast<const char*>(w);
  const bool pairs = INT4_PAIRS && !row_scales;  // int4 tiles two at a time, where AVX-512 VNNI can
  const int units = pairs ? (tiles + 1) / 2 : tiles;
  for (int chunk = 0; chunk < M; chunk += CHUNK) {
    const int chunk_end = std::min(M, chunk + CHUNK);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int unit = 0; unit < units; unit++) {
      const int t = unit * (pairs ? 2 : 1);
      const char* tile_w = weight + t * tile_bytes;
      const T* b = bias ? bias + t * TILE : nullptr;
      T* o = out + t * TILE;
      const float* s = row_scales ? row_scales + t * TILE : nullptr;
      if (pairs && t + 1 < tiles)
        row_groups<MAX_ROWS>(chunk, chunk_end, [&](auto group, int m) {
          tile_pair_int4<decltype(group)::value>(rows, m, K, reinterpret_cast<const uint8_t*>(tile_w), b, o, N);
        });
      else
        row_groups<MAX_ROWS>(chunk, chunk_end, [&](auto group, int m) {
          tile<decltype(group)::value>(rows, m, K, tile_w, s, b, o, N);
        });
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

// Each entry point's twin for a CPU graph's replay (cpu_graph.h).
REPLAYABLE(quantized_linear_float32)
REPLAYABLE(quantized_linear_bfloat16)
