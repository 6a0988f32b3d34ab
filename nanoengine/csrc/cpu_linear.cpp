// The linear layers on CPU in bfloat16: out = x @ weight.T (+ bias), for the AVX512-BF16
// instruction vdpbf16ps, which multiplies pairs of bfloat16 values and adds both products to a
// float32 lane: 32 multiply-adds per instruction; and, where the CPU has AMX, for its tiles.
//
// A decode step multiplies a few dozen rows by every weight of the model, 270 MB for SmolLM2, so
// the weights stream from main memory once per step. oneDNN's kernels (torch's bf16 matmul)
// neither stream them at full speed nor hide the reads behind the arithmetic at these shapes:
// measured on SmolLM2's 30 layers, 8.3 ms at batch 8 and 25.7 at batch 64, against 5.9 and 18.9 ms
// here. Two things make the difference. The weight is packed once so that the kernel reads it
// front to back, and while the kernel works on one strip of 32 output columns it prefetches the
// next strip into cache. At prefill's thousands of rows the two run at the same speed (~800
// GFLOP/s, measured in interleaved runs of the benchmark's prefill), so one kernel serves both.
//
// With AMX (linear_amx, below) the same packed weight is read as tiles, at every row count: one
// tdpbf16ps is 16 x 16 x 32 multiply-adds, 256 vdpbf16ps' worth. Each output is summed over k
// in the same order whatever the number of rows, so a row's result does not depend on its batch,
// as on the vdpbf16ps path (which is why oneDNN's AMX matmul, blocked differently by row count,
// is not used instead: docs/quantization.md).
//
// Layouts: x bfloat16 [M, K] with rows x_stride apart; out bfloat16 [M, N], contiguous; bias
// bfloat16 [N] or null. The packed weight is [ceil(N / 32), K / 2, 32, 2]: strip s, k pair p,
// column j, element e holds weight[32 s + j, 2 p + e] (zero past row N). K is even.
// nanoengine/cpu_library.py compiles this file on first use; cpu_kernels.py checks the arguments
// and calls it through ctypes.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_bfloat16.h"
#include "cpu_graph.h"

constexpr int COLUMNS = 32;   // output columns of one strip: two vectors of 16 float32 sums
constexpr int MAX_ROWS = 14;  // rows computed together: 2 x 14 accumulators fill the 32 vector registers

// ROWS rows of x against one strip of the weight. Each k pair's weights are loaded once and meet
// every row, whose pair of x values is broadcast to all lanes. rows <= ROWS rows are stored; the
// loads of the others repeat the last row, so that they stay in bounds.
template <int ROWS>
static void strip(const uint16_t* x, int64_t x_stride, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                  int64_t out_stride, int K, int rows, int columns, const char* prefetch) {
  __m512 acc[ROWS][2];
  for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const uint32_t* pairs[ROWS];  // x's rows, read as pairs of bfloat16
  for (int r = 0; r < ROWS; r++) pairs[r] = reinterpret_cast<const uint32_t*>(x + std::min(r, rows - 1) * x_stride);
  for (int p = 0; p < K / 2; p++) {
    if (prefetch) {  // the next strip: as many bytes ahead as this k pair reads
      _mm_prefetch(prefetch + p * 2 * COLUMNS * 2, _MM_HINT_T0);
      _mm_prefetch(prefetch + p * 2 * COLUMNS * 2 + 64, _MM_HINT_T0);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + p * 2 * COLUMNS);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + p * 2 * COLUMNS + COLUMNS);
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; r++) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(pairs[r][p]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xr, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xr, w1);
    }
  }
  alignas(64) float b[COLUMNS] = {};
  for (int j = 0; bias && j < columns; j++) b[j] = to_float(bias[j]);
  const uint32_t mask = columns == COLUMNS ? ~0u : (1u << columns) - 1;  // the columns that exist
  for (int r = 0; r < rows; r++) {  // round to bfloat16 once, after the bias, as oneDNN does
    _mm256_mask_storeu_epi16(out + r * out_stride, mask, (__m256i)_mm512_cvtneps_pbh(acc[r][0] + _mm512_load_ps(b)));
    _mm256_mask_storeu_epi16(out + r * out_stride + 16, mask >> 16,
                             (__m256i)_mm512_cvtneps_pbh(acc[r][1] + _mm512_load_ps(b + 16)));
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "cpu_amx.h"

// tdpbf16ps (cpu_amx.h) on blocks of 32 rows by one strip of 32 columns: the tiles of x are 16
// rows by 32 values of k, the weight's 16 k pairs of 16 columns (in the packed strip, rows of 128
// bytes, one half each). A thread takes a strip and sweeps a chunk of blocks of rows along it (a
// decode step's rows are one chunk, so the strip is read from memory once); a prefill's rows are
// taken AMX_CHUNK blocks at a time, so that they stay in each core's cache while every strip
// passes (4,096 rows, three shapes: 1.1-1.6 -> 1.2-2.1 TFLOP/s). Tiles load 16 rows, so the last
// rows of x (M % 32) are copied into a block of their own, this thread's (a row's sums are its
// own, so what the rows below them hold from an earlier call does not matter, and is never
// stored). K is a multiple of 32.
static void linear_amx(const uint16_t* x, int64_t x_stride, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                       int M, int N, int K, int num_threads) {
  const int strips = (N + COLUMNS - 1) / COLUMNS, k_blocks = K / 32, full = M / 32, tail = M % 32;
  const int blocks = full + (tail > 0);
  static thread_local std::vector<uint16_t> last;  // not zeroed each call: at batch 1, 121 of them a step
  if (last.size() < size_t(32) * K) last.resize(size_t(32) * K);
  for (int r = 0; r < tail; r++) std::memcpy(&last[r * K], x + (32 * full + r) * x_stride, K * sizeof(uint16_t));
  const uint16_t* last_block = last.data();  // the calling thread's, for every thread below
  const bool stream = streams_out(out, M, N, sizeof(uint16_t));
#pragma omp parallel num_threads(num_threads)
  {
    configure_tiles();
    alignas(64) float sums[32][COLUMNS];
    for (int chunk = 0; chunk < blocks; chunk += AMX_CHUNK) {
#pragma omp for schedule(static)
      for (int s = 0; s < strips; s++) {
        const uint16_t* ws = w + int64_t(s) * K * COLUMNS;
        const int columns = std::min(COLUMNS, N - s * COLUMNS);
        alignas(64) float b[COLUMNS] = {};
        for (int j = 0; bias && j < columns; j++) b[j] = to_float(bias[s * COLUMNS + j]);
        const uint32_t mask = columns == COLUMNS ? ~0u : (1u << columns) - 1;
        for (int block = chunk; block < std::min(blocks, chunk + AMX_CHUNK); block++) {
          const bool is_last = block == full;
          const uint16_t* x0 = is_last ? last_block : x + int64_t(32 * block) * x_stride;
          const int64_t stride = (is_last ? K : x_stride) * sizeof(uint16_t);
          const int rows = is_last ? tail : 32;
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          // The first block of rows reads the strip from memory, and prefetches the next one (at
          // batch 1 the tiles otherwise wait on memory: 30 layers' matmuls between other kernels
          // took 16-18 ms against 12-13 with vdpbf16ps, and 14-15 with this).
          const bool first = block == chunk && s + 1 < strips;
          const char* next = first ? reinterpret_cast<const char*>(ws + int64_t(K) * COLUMNS) : nullptr;
          for (int kb = 0; kb < k_blocks; kb++) {
            if (next) prefetch_tiles(next + kb * 2 * TILE_BYTES * 16);
            _tile_loadd(6, ws + kb * 32 * COLUMNS, 2 * COLUMNS * sizeof(uint16_t));
            _tile_loadd(7, ws + kb * 32 * COLUMNS + 32, 2 * COLUMNS * sizeof(uint16_t));
            _tile_loadd(4, x0 + kb * 32, stride);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (rows > 16) {  // a last block of at most 16 rows skips its lower half
              _tile_loadd(5, reinterpret_cast<const char*>(x0 + kb * 32) + 16 * stride, stride);
              _tile_dpbf16ps(2, 5, 6);
              _tile_dpbf16ps(3, 5, 7);
            }
          }
          store_sums(sums);
          for (int i = 0; i < rows; i++) {  // bias, then one rounding to bfloat16, as below
            uint16_t* o = out + int64_t(32 * block + i) * N + s * COLUMNS;
            const __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sums[i]) + _mm512_load_ps(b));
            const __m256i hi = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sums[i] + 16) + _mm512_load_ps(b + 16));
            if (columns == COLUMNS) {
              store_line(o, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), stream);
            } else {
              _mm256_mask_storeu_epi16(o, mask, lo);
              _mm256_mask_storeu_epi16(o + 16, mask >> 16, hi);
            }
          }
        }
      }
    }
    _mm_sfence();
    _tile_release();
  }
}
#endif

// Rows are taken CHUNK at a time, a chunk's x small enough to stay in each core's cache while all
// of the weight streams past it; within a chunk the threads share out the strips, and each runs
// all the chunk's rows of its strips, at most MAX_ROWS at a time (in equal blocks: 41 rows are
// 3 x 14 minus one, not 14 + 14 + 13). A decode step is one chunk, and reads the weight once.
constexpr int CHUNK = 16 * MAX_ROWS;

extern "C" void linear_bfloat16(const uint16_t* x, int64_t x_stride, const uint16_t* w, const uint16_t* bias,
                                uint16_t* out, int M, int N, int K, int num_threads) {
  if (M == 0) return;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (K % 32 == 0 && amx_granted()) return linear_amx(x, x_stride, w, bias, out, M, N, K, num_threads);
#endif
  const int strips = (N + COLUMNS - 1) / COLUMNS;
  const int blocks = (std::min(M, CHUNK) + MAX_ROWS - 1) / MAX_ROWS;
  const int rows_per_block = (std::min(M, CHUNK) + blocks - 1) / blocks;
#pragma omp parallel num_threads(num_threads)
  for (int chunk = 0; chunk < M; chunk += CHUNK) {
    const int chunk_end = std::min(M, chunk + CHUNK);
#pragma omp for schedule(static)
    for (int s = 0; s < strips; s++) {
      const uint16_t* ws = w + int64_t(s) * K * COLUMNS;
      const int columns = std::min(COLUMNS, N - s * COLUMNS);
      for (int m = chunk; m < chunk_end; m += rows_per_block) {
        const int rows = std::min(rows_per_block, chunk_end - m);
        // The first block of rows reads the strip from memory, and prefetches the next one.
        const bool first = m == chunk && s + 1 < strips;
        const char* prefetch = first ? reinterpret_cast<const char*>(ws + int64_t(K) * COLUMNS) : nullptr;
        const uint16_t* b = bias ? bias + s * COLUMNS : nullptr;
        const uint16_t* xm = x + m * x_stride;
        uint16_t* o = out + int64_t(m) * N + s * COLUMNS;
        switch (rows_per_block) {
#define CASE(n) \
  case n: strip<n>(xm, x_stride, ws, b, o, N, K, rows, columns, prefetch); break;
          CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7)
          CASE(8) CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14)
#undef CASE
        }
      }
    }
  }
}

// Each entry point's twin for a CPU graph's replay (cpu_graph.h).
REPLAYABLE(linear_bfloat16)
