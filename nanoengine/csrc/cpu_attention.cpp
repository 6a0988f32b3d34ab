// Attention over the paged KV cache on CPU: the jobs flash-attn does on CUDA, in two kernels, and
// the store that writes each step's keys and values into the cache (store_kvcache, a row copy).
//
// Decode (flash_attn_with_kvcache) reads every cached key and value once per step and does little
// arithmetic with them, so its cost is memory traffic. In pure torch it has to gather each
// sequence's blocks into a padded copy first and then read that copy with batched matmuls: three
// passes over K/V. Here one task per sequence walks its block table and reads each key and value
// once, in place.
//
// Prefill (flash_attn_varlen_func) is the opposite: every key meets every later query, so its cost
// is arithmetic, and torch's CPU SDPA reaches only 40-65 GFLOP/s at prompt lengths of 32-256.
// Here one task per (sequence, kv head) converts that head's keys and values to float32 once and
// then scores tiles of query rows against a vector register's worth of keys at a time, which keeps
// the scores in registers while it sweeps the head dimension. Where the CPU has AMX, bfloat16
// prefill makes both of its products on the tiles instead (prefill_head_amx): the benchmark's
// prompts (9,769 tokens, 9 heads over 3), five interleaved rounds, 21.4-23.9 -> 7.1-9.9 ms a layer.
//
// nanoengine/cpu_library.py compiles this file on first use, for one head size (HEAD_DIM), and
// cpu_kernels.py calls it through ctypes, having checked every argument's dtype and shape; each
// entry point checks the values of its index arguments itself, before following any, and returns
// an error code (0: done). T is bfloat16 (as its bits) or float; Cache, the cache's type, is T or, for an
// 8-bit cache (kv_cache_dtype.py), fp8_e4m3 or fp8_e5m2 (cpu_fp8.h), the generic code's case only.
// An 8-bit cache's k_scale is folded into the softmax scale by the caller, and its v_scale into each
// output (v_scale, 1 for other caches). Layouts (all contiguous):
//   k/v_cache     Cache [num_blocks, block_size, num_kv_heads, HEAD_DIM]
//   block_table   int32 [batch, max_blocks];  seqlens int32 [batch]: each sequence's cached tokens
//   decode        q, out T [batch, num_heads, HEAD_DIM]
//   prefill       q, out T [num_tokens, num_heads, HEAD_DIM], sequence b's queries at rows
//                 cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1, the last of them at its last key's position
// except that q's tokens are q_stride elements apart: q is a view into the qkv projection's output.
// Two options of flash-attn's, for Mistral's and Gemma's layers: window_left >= 0 (window_size's
// left) lets a query at position p see only the keys p - window_left .. p; softcap > 0 caps each
// scaled score at softcap * tanh(score / softcap). Both act on a row's softmax only
// (softmax_in_place), once per row, so a layer without them runs the same loops as before.
#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_amx.h"
#include "cpu_bfloat16.h"
#include "cpu_fp8.h"
#include "cpu_graph.h"

constexpr int D = HEAD_DIM;
// Prefill's tiles fit the vector registers: KEYS keys (one register of floats) against ROWS query
// rows, whose ROWS registers of scores stay in registers (AVX512 has 32, AVX2 16). Wider tiles than
// the CPU's registers are split and spilled by the compiler: AVX512's 16 x 16 made prefill 9x
// slower on an AVX2 CPU (128 tokens, 9 heads: 3.5 against 0.38 ms a layer).
#ifdef __AVX512F__
constexpr int KEYS = 16, ROWS = 16;
#else
constexpr int KEYS = 8, ROWS = 8;
#endif
constexpr int LANES = std::gcd(D, KEYS);  // floats per vector in decode, and when summing values in prefill
using KeyVec = float __attribute__((vector_size(KEYS * sizeof(float))));
using ValueVec = float __attribute__((vector_size(LANES * sizeof(float))));

// Calls fn(t, row) for tokens t = 0 .. seqlen-1 of one sequence, in order; row points at token
// t's keys (or values) of the kv heads the caller reads, row_size values side by side. A slot
// holds all kv heads (slot_size values); cache points at the caller's first head in slot 0.
// Walking block by block reads the cache front to back within each block. Each row is prefetched
// a block ahead, only the part the caller reads: a sequence's blocks lie anywhere in the cache,
// where the hardware prefetcher cannot guess them (measured on shuffled blocks: decode attention
// 34 -> 25 ms per step at batch 64). One row per token read, not a whole block at a block's
// start: that burst stalled the loop (batch 1, 192 tokens, 30 layers: 1.39 -> 1.18 ms).
template <typename T, typename Fn>
static void for_each_token(const T* cache, const int32_t* blocks, int seqlen, int block_size, size_t slot_size,
                           size_t row_size, Fn fn) {
  for (int b = 0, t = 0; t < seqlen; b++) {
    const T* slot = cache + size_t(blocks[b]) * block_size * slot_size;
    // The same row of the next block, if there is one (else only stepped along, never read).
    const T* next = t + block_size < seqlen ? cache + size_t(blocks[b + 1]) * block_size * slot_size : slot;
    for (int n = std::min(block_size, seqlen - t); n > 0; n--, t++, slot += slot_size, next += slot_size) {
      if (t + block_size < seqlen)
        for (size_t byte = 0; byte < row_size * sizeof(T); byte += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(next) + byte);
      fn(t, slot);
    }
  }
}

// The softmax of one row of scores, s[first .. n), in place: exp(s - max) (unnormalised), with
// s[0 .. first) (keys left of the window) set to 0. Returns the sum; max is the largest score.
// The soft cap is a pass of its own, so that a row without one runs the plain loops.
static inline float softmax_in_place(float* s, int first, int n, float softcap, float& max) {
  if (softcap > 0.f)
    for (int t = first; t < n; t++) s[t] = softcap * std::tanh(s[t] / softcap);
  max = *std::max_element(s + first, s + n);
  float sum = 0.f;
  std::fill(s, s + first, 0.f);
  for (int t = first; t < n; t++) sum += s[t] = std::exp(s[t] - max);
  return sum;
}

// The first key a query at position pos sees: 0, or with a window the first inside it.
static inline int first_key(int pos, int window_left) {
  return window_left < 0 ? 0 : std::max(0, pos - window_left);
}

// Every entry point checks its index arguments before following any (O(batch * max_blocks)
// integer compares, free beside the work) and returns an error code, 0 if all is well; the codes
// are distinct across the kernels (rotary's, in cpu_layers.cpp, is 4).
enum Error { BAD_SLOT = 1, BAD_BLOCK = 2, BAD_SEQLEN = 3, BAD_CU_SEQLENS_Q = 5, BAD_LENGTHS = 6 };

// store_kvcache: row i of key and value (one token's kv heads, side by side) is copied to slot
// slot_mapping[i] of each cache; -1 marks a padding row, which writes nothing. Bytes are bytes,
// so one kernel serves every dtype; the strides are in bytes too. Every slot is checked before
// the first copy, so that a bad one changes nothing: BAD_SLOT if one lies outside [-1, num_slots).
extern "C" int store_kvcache(const char* key, const char* value, int64_t key_stride, int64_t value_stride,
                             char* k_cache, char* v_cache, const int64_t* slot_mapping, int num_tokens,
                             int64_t num_slots, int64_t row_bytes, int num_threads) {
  for (int i = 0; i < num_tokens; i++)
    if (slot_mapping[i] < -1 || slot_mapping[i] >= num_slots) return BAD_SLOT;
#pragma omp parallel for num_threads(num_threads) if (num_tokens * row_bytes >= (1 << 20))
  for (int i = 0; i < num_tokens; i++) {
    if (slot_mapping[i] < 0) continue;
    std::memcpy(k_cache + slot_mapping[i] * row_bytes, key + i * key_stride, row_bytes);
    std::memcpy(v_cache + slot_mapping[i] * row_bytes, value + i * value_stride, row_bytes);
  }
  return 0;
}

// store_kvcache into an 8-bit cache: each value times its inverse scale, encoded (cpu_fp8.h); the
// strides and row (num_kv_heads * HEAD_DIM) are in values.
template <typename T, typename Cache>
static int store_kvcache_fp8(const T* key, const T* value, int64_t key_stride, int64_t value_stride, Cache* k_cache,
                             Cache* v_cache, const int64_t* slot_mapping, int num_tokens, int64_t num_slots,
                             int64_t row, float k_inverse_scale, float v_inverse_scale, int num_threads) {
  for (int i = 0; i < num_tokens; i++)
    if (slot_mapping[i] < -1 || slot_mapping[i] >= num_slots) return BAD_SLOT;
#pragma omp parallel for num_threads(num_threads) if (num_tokens * row >= (1 << 18))
  for (int i = 0; i < num_tokens; i++) {
    if (slot_mapping[i] < 0) continue;
    for (int64_t j = 0; j < row; j++) {
      store(to_float(key[i * key_stride + j]) * k_inverse_scale, k_cache + slot_mapping[i] * row + j);
      store(to_float(value[i * value_stride + j]) * v_inverse_scale, v_cache + slot_mapping[i] * row + j);
    }
  }
  return 0;
}

// BAD_BLOCK unless every entry of block_table [batch, max_blocks] names a block of the cache.
static int check_block_table(const int32_t* block_table, int batch, int max_blocks, int num_blocks) {
  for (size_t i = 0; i < size_t(batch) * max_blocks; i++)
    if (block_table[i] < 0 || block_table[i] >= num_blocks) return BAD_BLOCK;
  return 0;
}

// LANES values at p, as floats.
static inline ValueVec load(const float* p) {
  ValueVec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename Cache>  // bfloat16, or an fp8 code
static inline ValueVec load(const Cache* p) {
  ValueVec v;
  for (int lane = 0; lane < LANES; lane++) v[lane] = to_float(p[lane]);
  return v;
}

// Lane j of the result is the sum of v[j]'s lanes (v: LANES vectors, LANES a power of two). Each
// round adds neighbouring lanes of two vectors into one, halving the vectors: LANES - 1 steps of
// two shuffles and an add in all, where a horizontal sum per score is a chain of about six.
template <size_t... I>
static inline ValueVec add_pairs(ValueVec a, ValueVec b, std::index_sequence<I...>) {
  return __builtin_shufflevector(a, b, (2 * I)...) + __builtin_shufflevector(a, b, (2 * I + 1)...);
}
static inline ValueVec sum_each(ValueVec* v) {
  for (int n = LANES; n > 1; n /= 2)
    for (int i = 0; i < n / 2; i++) v[i] = add_pairs(v[2 * i], v[2 * i + 1], std::make_index_sequence<LANES>{});
  return v[0];
}

// One sequence, in two passes over its blocks: the scores q.k of every query head for every key, a
// softmax per query head, then the probability-weighted sum of the values. The heads are
// num_kv_heads kv heads and their query heads, of the slot_size / D kv heads each cache row holds
// (all of them, or decode's share: the caller offsets q, the caches and out to its first). With
// lse, each query head's log-sum-exp of its scores as well (decode's splits merge by it).
// Both passes take LANES tokens at a time (a chunk). Scores: a query head's LANES dot products
// are summed in vectors, then across them at once (sum_each). Values: each query head's sums stay
// in registers over the chunk. Against plain loops over d, which the compiler left with a
// horizontal sum per score and the sums in memory: batch 1, 192 tokens, 30 layers, 1.72 -> 1.39 ms.
// Keys before `first` (left of a sliding window) get probability 0.
template <typename T, typename Cache, typename O>
static void attend(const T* q, const Cache* k_cache, const Cache* v_cache, const int32_t* blocks, int seqlen,
                   int block_size, int num_heads, int num_kv_heads, size_t slot_size, float scale, int first,
                   float softcap, float v_scale, std::vector<float>& scores, O* out, float* lse = nullptr) {
  constexpr int C = D / LANES;  // vectors per head
  const int group = num_heads / num_kv_heads, padded = (seqlen + LANES - 1) / LANES * LANES;
  const size_t row_size = size_t(num_kv_heads) * D;
  std::vector<ValueVec> qv(num_heads * C), acc(num_heads * C, ValueVec{});
  std::vector<float> inverse_sum(num_heads);
  for (int i = 0; i < num_heads * C; i++) qv[i] = load(q + i * LANES) * scale;
  scores.resize(size_t(num_heads) * padded);
  // Calls fn(t0, n, rows) for each chunk: tokens t0 .. t0 + n - 1, rows[j] pointing at token t0 + j's
  // cache row; rows past n repeat the last, so that reading them stays in bounds.
  auto for_each_chunk = [&](const Cache* cache, auto fn) {
    const Cache* rows[LANES];
    for_each_token(cache, blocks, seqlen, block_size, slot_size, row_size, [&](int t, const Cache* row) {
      rows[t % LANES] = row;
      if (t % LANES == LANES - 1 || t == seqlen - 1) {
        std::fill(rows + t % LANES + 1, rows + LANES, row);
        fn(t - t % LANES, t % LANES + 1, rows);
      }
    });
  };
  for_each_chunk(k_cache, [&](int t0, int, const Cache* const* rows) {
    for (int g = 0; g < num_heads; g++) {
      const int kv = g / group * D;
      ValueVec dots[LANES];
      for (int j = 0; j < LANES; j++) {
        dots[j] = qv[g * C] * load(rows[j] + kv);
        for (int c = 1; c < C; c++) dots[j] += qv[g * C + c] * load(rows[j] + kv + c * LANES);
      }
      const ValueVec sums = sum_each(dots);
      std::memcpy(&scores[size_t(g) * padded + t0], &sums, sizeof sums);
    }
  });
  for (int g = 0; g < num_heads; g++) {
    float max;
    const float sum = softmax_in_place(&scores[size_t(g) * padded], first, seqlen, softcap, max);
    inverse_sum[g] = v_scale / sum;
    if (lse) lse[g] = max + std::log(sum);  // the log of the softmax's denominator
  }
  for_each_chunk(v_cache, [&](int t0, int n, const Cache* const* rows) {
    for (int g = 0; g < num_heads; g++) {
      const int kv = g / group * D;
      ValueVec sums[C];
      std::copy_n(&acc[g * C], C, sums);
      for (int j = 0; j < n; j++) {
        const float p = scores[size_t(g) * padded + t0 + j];
        for (int c = 0; c < C; c++) sums[c] += p * load(rows[j] + kv + c * LANES);
      }
      std::copy_n(sums, C, &acc[g * C]);
    }
  });
  for (int g = 0; g < num_heads; g++)
    for (int c = 0; c < C; c++)
      for (int lane = 0; lane < LANES; lane++)
        store(acc[g * C + c][lane] * inverse_sum[g], out + g * D + c * LANES + lane);
}

#if defined(__AVX512BF16__) && HEAD_DIM % 32 == 0
// The same in bfloat16 on a CPU with AVX512-BF16, whose vdpbf16ps multiplies pairs of bfloat16
// values and adds both products to a float32 lane, reading the cache as it is stored. Both
// passes take 16 tokens at a time, all heads, and prefetch the next 16 tokens' rows as they go.
// q.k sums a key's D products in 16 lanes, and the 16 keys' lanes are then added up together
// (sum_lanes). The values are summed in pairs of tokens, their rows interleaved so that each
// float32 lane meets one dimension of both, against their two probabilities rounded to bfloat16
// as flash-attn rounds them. Measured at the benchmark's batch 64, 30 layers: 12.5-12.9 ms against
// 17.5 for the generic code (7.0 against 12.9 with the cache in L3); a decode step, 45.5 -> 42.6 ms.
#include <immintrin.h>

// Lane j of the result is the sum of the 16 lanes of a[j]: adjacent lanes first, then wider.
static inline __m512 sum_lanes(const __m512* a) {
  __m512 quads[4];  // quads[i], 128-bit lane L: the sums over lane L of a[4i], ..., a[4i + 3]
  for (int i = 0; i < 4; i++) {
    const __m512* x = a + 4 * i;
    const __m512d ab = _mm512_castps_pd(_mm512_unpacklo_ps(x[0], x[1]) + _mm512_unpackhi_ps(x[0], x[1]));
    const __m512d cd = _mm512_castps_pd(_mm512_unpacklo_ps(x[2], x[3]) + _mm512_unpackhi_ps(x[2], x[3]));
    quads[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(ab, cd)) + _mm512_castpd_ps(_mm512_unpackhi_pd(ab, cd));
  }
  const __m512 q01 = _mm512_shuffle_f32x4(quads[0], quads[1], 0x88) + _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD);
  const __m512 q23 = _mm512_shuffle_f32x4(quads[2], quads[3], 0x88) + _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD);
  return _mm512_shuffle_f32x4(q01, q23, 0x88) + _mm512_shuffle_f32x4(q01, q23, 0xDD);
}

// The cache rows (one token's kv heads, side by side) of tokens t0 .. t0 + 15 of a sequence;
// tokens past its end repeat its last one, so that reading them stays in bounds. These helpers are
// forced inline: as calls they made the kernel 1.8x slower.
#define INLINE inline __attribute__((always_inline))
static INLINE const uint16_t* row_of(const uint16_t* cache, const int32_t* blocks, int t, int block_size,
                                     size_t slot_size) {
  return cache + (size_t(blocks[t / block_size]) * block_size + t % block_size) * slot_size;
}

static INLINE void chunk_rows(const uint16_t* cache, const int32_t* blocks, int t0, int seqlen, int block_size,
                              size_t slot_size, const uint16_t* rows[16]) {
  for (int j = 0; j < 16; j++) rows[j] = row_of(cache, blocks, std::min(t0 + j, seqlen - 1), block_size, slot_size);
}

// The rows of the 16 tokens from t0 (tokens past the end: none), prefetched a few lines at a time
// between the work on the chunk before (`some`), not all at once: a prefetch that finds every one
// of the core's line-fill buffers taken waits for one to free, and the arithmetic behind it waited
// too (batch 41 at 222 tokens, 30 layers: 15.1-17.5 -> 14.0-16.5 ms, three interleaved rounds).
struct ChunkPrefetch {
  const char* rows[16];
  int num_rows = 0, lines_per_row = 1, lines = 0, row = 0, line = 0;  // (row, line): the next to ask for

  INLINE void start(const uint16_t* cache, const int32_t* blocks, int t0, int seqlen, int block_size,
                    size_t slot_size, size_t row_size) {
    num_rows = std::max(0, std::min(16, seqlen - t0));
    for (int j = 0; j < num_rows; j++)
      rows[j] = reinterpret_cast<const char*>(row_of(cache, blocks, t0 + j, block_size, slot_size));
    lines_per_row = int((row_size * sizeof(uint16_t) + 63) / 64);
    lines = num_rows * lines_per_row;
    row = line = 0;
  }
  // The next `count` lines; a pass over the chunk before calls it `parts` times, each with
  // share(parts), so that every line is asked for by its end.
  INLINE void some(int count) {
    for (; count > 0 && row < num_rows; count--) {
      _mm_prefetch(rows[row] + 64 * line, _MM_HINT_T0);
      if (++line == lines_per_row) line = 0, row++;
    }
  }
  INLINE int share(int parts) const { return (lines + parts - 1) / parts; }
};

static void attend(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* blocks,
                   int seqlen, int block_size, int num_heads, int num_kv_heads, size_t slot_size, float scale,
                   int first, float softcap, float v_scale, std::vector<float>& scores, uint16_t* out) {
  constexpr int C = D / 32;  // vectors of 32 bfloat16 per head
  constexpr int MAX_HEADS = 64;
  if (num_heads > MAX_HEADS)
    return attend<uint16_t, uint16_t>(q, k_cache, v_cache, blocks, seqlen, block_size, num_heads, num_kv_heads,
                                      slot_size, scale, first, softcap, v_scale, scores, out);
  const int group = num_heads / num_kv_heads, padded = (seqlen + 15) / 16 * 16;
  const size_t row_size = size_t(num_kv_heads) * D;
  thread_local std::vector<uint16_t> probs_buffer;
  scores.resize(size_t(num_heads) * padded);
  probs_buffer.resize(size_t(num_heads) * padded);
  uint16_t* probs = probs_buffer.data();  // bfloat16, zero past seqlen
  __m512 acc[MAX_HEADS][2 * C];           // per head: its sums, in the interleaved order below
  float inverse_sum[MAX_HEADS];
  const uint16_t* rows[16];

  ChunkPrefetch ahead;
  ahead.start(k_cache, blocks, 0, seqlen, block_size, slot_size, row_size);
  ahead.some(ahead.lines);
  for (int t0 = 0; t0 < seqlen; t0 += 16) {
    ahead.start(k_cache, blocks, t0 + 16, seqlen, block_size, slot_size, row_size);
    const int per_head = ahead.share(num_heads);
    chunk_rows(k_cache, blocks, t0, seqlen, block_size, slot_size, rows);
    for (int g = 0; g < num_heads; g++) {
      ahead.some(per_head);
      const uint16_t* qg = q + g * D;
      const int kv_head = g / group;
      __m512 dots[16];
      for (int j = 0; j < 16; j++) {
        dots[j] = _mm512_setzero_ps();
        for (int c = 0; c < C; c++)
          dots[j] = _mm512_dpbf16_ps(dots[j], (__m512bh)_mm512_loadu_si512(qg + 32 * c),
                                     (__m512bh)_mm512_loadu_si512(rows[j] + kv_head * D + 32 * c));
      }
      _mm512_storeu_ps(&scores[size_t(g) * padded + t0], sum_lanes(dots) * scale);
    }
  }

  ahead.start(v_cache, blocks, 0, seqlen, block_size, slot_size, row_size);
  ahead.some(ahead.lines);
  for (int g = 0; g < num_heads; g++) {
    float* s = &scores[size_t(g) * padded];
    float max;
    const float sum = softmax_in_place(s, first, seqlen, softcap, max);
    std::fill(s + seqlen, s + padded, 0.f);
    inverse_sum[g] = v_scale / sum;
    std::fill(acc[g], acc[g] + 2 * C, _mm512_setzero_ps());
    for (int t = 0; t < padded; t += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&probs[size_t(g) * padded + t]),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + t)));
  }

  for (int t0 = 0; t0 < seqlen; t0 += 16) {
    ahead.start(v_cache, blocks, t0 + 16, seqlen, block_size, slot_size, row_size);
    const int per_pair = ahead.share(num_kv_heads * 8);  // a chunk with a next one is whole: 8 pairs of tokens
    chunk_rows(v_cache, blocks, t0, seqlen, block_size, slot_size, rows);
    for (int h = 0; h < num_kv_heads; h++)
      for (int i = 0; i < std::min(16, seqlen - t0); i += 2) {
        ahead.some(per_pair);
        // Each 128-bit lane of unpacklo/hi holds 4 dimensions of both rows, paired:
        // pairs[2c] dimensions 32c + 8L + 0..3 of lane L, pairs[2c + 1] dimensions 32c + 8L + 4..7.
        __m512bh pairs[2 * C];
        for (int c = 0; c < C; c++) {
          const __m512i a = _mm512_loadu_si512(rows[i] + h * D + 32 * c);
          const __m512i b = _mm512_loadu_si512(rows[i + 1] + h * D + 32 * c);
          pairs[2 * c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
          pairs[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
        }
        for (int g = h * group; g < (h + 1) * group; g++) {
          uint32_t p;  // the probabilities of tokens t0 + i and t0 + i + 1
          std::memcpy(&p, &probs[size_t(g) * padded + t0 + i], sizeof p);
          for (int c = 0; c < 2 * C; c++)
            acc[g][c] = _mm512_dpbf16_ps(acc[g][c], (__m512bh)_mm512_set1_epi32(p), pairs[c]);
        }
      }
  }

  for (int g = 0; g < num_heads; g++)
    for (int c = 0; c < 2 * C; c++) {
      alignas(64) float sums[16];
      _mm512_store_ps(sums, acc[g][c]);
      for (int lane = 0; lane < 16; lane++) {
        const int d = 32 * (c / 2) + 8 * (lane / 4) + 4 * (c % 2) + lane % 4;
        store(sums[lane] * inverse_sum[g], out + g * D + d);
      }
    }
}
#endif

// One task per sequence, shared out over as many OpenMP threads as torch uses (sequences differ
// in length, hence the dynamic schedule). libgomp is the one torch loaded, so the threads are its.
// With fewer sequences than threads (a single chat stream), one task per (sequence, kv head,
// split) instead, so that every thread works: a kv head and its query heads need nothing of the
// others, and a split is a stretch of the sequence's blocks (flash-decoding's idea), attended
// alone. The splits' outputs are then added up weighed by their softmax sums: with lse_s the
// log-sum-exp of split s's scores, out = sum_s exp(lse_s - L) * out_s, where L = log sum_s exp(lse_s).
// Splits make twice as many tasks as threads: with 3 kv heads on 2 threads, one thread had two
// heads to the other's one (batch 1, 30 layers: 1,024 tokens 6.5-6.6 -> 5.4-5.8 ms; 192 tokens
// 1.19-1.20 -> 1.11-1.17 ms). Not in bfloat16: a split rounds differently from the whole (its merge,
// and its probabilities in float32), so a sequence's output would depend on how many sequences
// share its step, and in bfloat16 that difference flips a seeded sample (at token 3 of 40, alone
// against beside one other request); a task per kv head computes exactly what the whole does. It
// is faster too, since splits take the generic code: batch 1, 30 layers, 2 threads with
// AVX512-BF16, 192 tokens 0.73-0.81 -> 0.59-0.63 ms, 1,024 tokens 1.98-2.12 -> 1.42-1.51 ms.
template <typename T, typename Cache>
static int decode(const T* q, int64_t q_stride, const Cache* k_cache, const Cache* v_cache, const int32_t* block_table,
                  const int32_t* seqlens, T* out, int batch, int max_blocks, int num_blocks, int block_size,
                  int num_heads, int num_kv_heads, float scale, int window_left, float softcap, float v_scale,
                  int num_threads) {
  if (int error = check_block_table(block_table, batch, max_blocks, num_blocks)) return error;
  for (int i = 0; i < batch; i++)
    if (seqlens[i] < 0 || seqlens[i] > int64_t(max_blocks) * block_size) return BAD_SEQLEN;
  const int parts = batch < num_threads ? num_kv_heads : 1;
  const int splits = batch < num_threads && !std::is_same_v<T, uint16_t>
                         ? (2 * num_threads + batch * parts - 1) / (batch * parts) : 1;
  const int heads = num_heads / parts, kv_heads = num_kv_heads / parts;
  // Each split's output and log-sum-exp, [batch][split][head]. A split with no keys keeps output 0
  // and the lowest float as its lse (not -inf: fast-math assumes no infinities), which weighs it 0
  // beside any split with keys, and gives a padded row (no keys at all) zeros, as flash-attn does.
  constexpr float NO_KEYS = std::numeric_limits<float>::lowest();
  std::vector<float> split_out(splits > 1 ? size_t(batch) * splits * num_heads * D : 0, 0.f);
  std::vector<float> split_lse(splits > 1 ? size_t(batch) * splits * num_heads : 0, NO_KEYS);
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scores;  // per thread, reused across its tasks
#pragma omp for schedule(dynamic)
    for (int task = 0; task < batch * parts * splits; task++) {
      const int i = task / (parts * splits), part = task / splits % parts, split = task % splits;
      const T* qh = q + i * q_stride + part * heads * D;
      const Cache *k = k_cache + part * kv_heads * D, *v = v_cache + part * kv_heads * D;
      const int32_t* blocks = block_table + size_t(i) * max_blocks;
      const size_t slot_size = size_t(num_kv_heads) * D;
      const int window_first = first_key(seqlens[i] - 1, window_left);  // the query sits at the last key
      if (splits == 1) {
        T* o = out + (size_t(i) * num_heads + part * heads) * D;
        if (seqlens[i] == 0)  // a padded batch row: zeros, as flash-attn gives
          std::fill(o, o + heads * D, T(0));
        else
          attend(qh, k, v, blocks, seqlens[i], block_size, heads, kv_heads, slot_size, scale, window_first, softcap,
                 v_scale, scores, o);
        continue;
      }
      const int split_blocks = ((seqlens[i] + block_size - 1) / block_size + splits - 1) / splits;
      const int first = split * split_blocks * block_size;  // the split's first token
      const int length = std::min(seqlens[i] - first, split_blocks * block_size);
      if (first >= seqlens[i] || first + length <= window_first) continue;  // no keys, or all left of the window
      const size_t row = (size_t(i) * splits + split) * num_heads + part * heads;
      attend(qh, k, v, blocks + split * split_blocks, length, block_size, heads, kv_heads, slot_size, scale,
             std::max(0, window_first - first), softcap, v_scale, scores, &split_out[row * D], &split_lse[row]);
    }
  }
  for (int i = 0; i < batch && splits > 1; i++)
    for (int g = 0; g < num_heads; g++) {
      float largest = NO_KEYS, total = 0.f, o[D] = {};
      for (int split = 0; split < splits; split++)
        largest = std::max(largest, split_lse[(size_t(i) * splits + split) * num_heads + g]);
      for (int split = 0; split < splits; split++) {
        const size_t row = (size_t(i) * splits + split) * num_heads + g;
        const float weight = std::exp(split_lse[row] - largest);  // the largest weighs 1: total >= 1
        total += weight;
        for (int d = 0; d < D; d++) o[d] += weight * split_out[row * D + d];
      }
      for (int d = 0; d < D; d++) store(o[d] / total, out + (size_t(i) * num_heads + g) * D + d);
    }
  return 0;
}

// Prefill: the queries of one sequence that share one kv head, against that head's keys. Its rows
// are (query i, head g of the kv head's group), i-major, so every row of a tile reads the same keys.
template <typename T, typename Cache>
static void prefill_head(const T* q, int64_t q_stride, const Cache* k_cache, const Cache* v_cache,
                         const int32_t* blocks, int q_start, int lq, int seqlen, int block_size, int num_heads,
                         int num_kv_heads, float scale, bool causal, int window_left, float softcap, float v_scale,
                         int kv_head, T* out,
                         std::vector<float>& keys, std::vector<float>& values, std::vector<float>& scores) {
  const int group = num_heads / num_kv_heads;
  const int padded = (seqlen + KEYS - 1) / KEYS * KEYS;
  keys.assign(size_t(padded) * D, 0.f);  // blocks of KEYS keys, each transposed: [padded / KEYS][D][KEYS]
  values.resize(size_t(padded) * D);     // [padded][D]
  scores.resize(size_t(ROWS) * padded);
  const size_t slot_size = size_t(num_kv_heads) * D;
  for_each_token(k_cache + kv_head * D, blocks, seqlen, block_size, slot_size, D, [&](int t, const Cache* k) {
    for (int d = 0; d < D; d++) keys[(size_t(t / KEYS) * D + d) * KEYS + t % KEYS] = to_float(k[d]);
  });
  for_each_token(v_cache + kv_head * D, blocks, seqlen, block_size, slot_size, D, [&](int t, const Cache* v) {
    for (int d = 0; d < D; d++) values[size_t(t) * D + d] = to_float(v[d]);
  });
  for (int row0 = 0; row0 < lq * group; row0 += ROWS) {
    const int rows = std::min(ROWS, lq * group - row0);
    alignas(64) float qf[ROWS][D] = {};  // rows past the end stay zero; their scores are discarded
    int first[ROWS], last_key[ROWS];     // the mask: row r sees keys first[r] .. last_key[r]
    for (int r = 0; r < ROWS; r++) {
      const int row = row0 + std::min(r, rows - 1), i = row / group, head = kv_head * group + row % group;
      if (r < rows)
        for (int d = 0; d < D; d++) qf[r][d] = to_float(q[(q_start + i) * q_stride + head * D + d]) * scale;
      last_key[r] = causal ? seqlen - lq + i : seqlen - 1;
      first[r] = first_key(seqlen - lq + i, window_left);
    }
    // Scores of the whole tile, KEYS keys at a time: ROWS vectors of KEYS scores stay in registers.
    for (int k0 = first[0] / KEYS * KEYS; k0 <= last_key[ROWS - 1]; k0 += KEYS) {
      KeyVec s[ROWS] = {};
      for (int d = 0; d < D; d++) {
        KeyVec key;
        std::memcpy(&key, &keys[size_t(k0) * D + d * KEYS], sizeof key);  // block k0 / KEYS, row d
#pragma GCC unroll 16
        for (int r = 0; r < ROWS; r++) s[r] += qf[r][d] * key;
      }
      for (int r = 0; r < ROWS; r++) std::memcpy(&scores[size_t(r) * padded + k0], &s[r], sizeof s[r]);
    }
    // Each row: an exact softmax over the keys it sees, then the weighted sum of their values.
    for (int r = 0; r < rows; r++) {
      float* p = &scores[size_t(r) * padded];
      const int n = last_key[r] + 1;
      float max;
      const float sum = softmax_in_place(p, first[r], n, softcap, max);
      ValueVec acc[D / LANES] = {};
      for (int j = first[r]; j < n; j++)
        for (int c = 0; c < D / LANES; c++) {
          ValueVec value;
          std::memcpy(&value, &values[size_t(j) * D + c * LANES], sizeof value);
          acc[c] += p[j] * value;
        }
      alignas(64) float o[D];
      std::memcpy(o, acc, sizeof o);
      const int row = row0 + r, i = row / group, head = kv_head * group + row % group;
      for (int d = 0; d < D; d++) store(o[d] / sum * v_scale, out + (size_t(q_start + i) * num_heads + head) * D + d);
    }
  }
}

#if defined(__AMX_TILE__) && defined(__AVX512BF16__) && HEAD_DIM % 64 == 0
#define AMX_PREFILL
// Prefill on AMX's tiles (cpu_amx.h), in bfloat16 for a head size that is a multiple of 64: the
// same tasks, rows and exact softmax as prefill_head, with both products, q.k and p.v, made 16 x
// 16 outputs per tile instruction. Each task first lays its kv head's keys and values out as the
// weight operand of a tile product, as cpu_linear.cpp packs a weight:
//   keys    per 16 keys, D / 2 rows of the 16 keys' dimension pairs (2p, 2p + 1): a tile per 32 dims;
//   values  per 32 keys, D / 16 tiles of 16 rows of 16 dimensions' key pairs (2p, 2p + 1).
// A tile of 16 rows then gets its scores, 64 keys (four sums tiles) at a time, a softmax per row
// into bfloat16 probabilities (rounded, as flash-attn rounds them before p.v; the sums stay
// float32), and p.v 32 keys at a time into four tiles of 16 dimensions. Keys past a row's last
// get probability 0 and the values past the sequence's last key are 0, so whole tiles are read.
// Both products keep four sums tiles in flight, as the matmul kernels do, so that no product waits
// for the one before it into the same sums.
constexpr int AMX_KEYS = 64;  // keys scored at a time, and what the task's buffers are padded to

struct AmxScratch {
  std::vector<uint32_t> keys;    // [padded / 16][D / 2][16]: a key's dimension pair
  std::vector<uint16_t> values;  // [padded / 32][D / 16][16][16][2]
  std::vector<float> scores;     // [16][padded]
  std::vector<uint16_t> probs;   // [16][padded]
};

// Tokens t and t + 1's values (b null past the last token) into their row of each value tile:
// dimension j of a tile's 16 is the pair (a[j], b[j]), interleaved by one permute per 16 pairs.
static inline void pack_value_pair(const uint16_t* a, const uint16_t* b, uint16_t* row) {
  alignas(64) static const auto index = [] {
    std::array<uint16_t, 64> index{};  // [0, 32): the low 16 dims' pairs; [32, 64): the high 16's
    for (int k = 0; k < 32; k++) index[k] = k / 2 + k % 2 * 32, index[32 + k] = 16 + k / 2 + k % 2 * 32;
    return index;
  }();
  const __m512i low = _mm512_load_si512(&index[0]), high = _mm512_load_si512(&index[32]);
  for (int d = 0; d < D; d += 32) {
    const __m512i x = _mm512_loadu_si512(a + d), y = b ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
    _mm512_storeu_si512(row + d / 16 * 512, _mm512_permutex2var_epi16(x, low, y));
    _mm512_storeu_si512(row + (d / 16 + 1) * 512, _mm512_permutex2var_epi16(x, high, y));
  }
}

// e^x, x <= 0 (a score less the row's largest): 2^(x log2 e) as 2^n (the integer nearest) times
// 2^f, |f| <= 1/2, by its Taylor series to degree 6. Relative error (measured against double's
// exp): under 7e-7 for x >= -10, under 4e-6 down to -80, mostly x log2 e's own rounding; far
// below the bf16 rounding the probabilities then get.
// With std::exp, GCC vectorised the softmax's loop but left each row's remainder to scalar expf
// calls: 10% of this kernel's time.
static inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.54035304e-4f);
  for (float c : {1.33335581e-3f, 9.61812911e-3f, 5.55041087e-2f, 2.40226507e-1f, 6.93147181e-1f, 1.f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

static void prefill_head_amx(const uint16_t* q, int64_t q_stride, const uint16_t* k_cache, const uint16_t* v_cache,
                             const int32_t* blocks, int q_start, int lq, int seqlen, int block_size, int num_heads,
                             int num_kv_heads, float scale, bool causal, int kv_head, uint16_t* out,
                             AmxScratch& scratch) {
  const int group = num_heads / num_kv_heads, padded = (seqlen + AMX_KEYS - 1) / AMX_KEYS * AMX_KEYS;
  const size_t slot_size = size_t(num_kv_heads) * D;
  scratch.keys.resize(size_t(padded) * D / 2);  // past seqlen: what is left there; those scores are masked
  scratch.values.assign(size_t(padded) * D, 0);
  scratch.scores.resize(16 * size_t(padded));
  scratch.probs.resize(16 * size_t(padded));
  for_each_token(k_cache + kv_head * D, blocks, seqlen, block_size, slot_size, D, [&](int t, const uint16_t* k) {
    uint32_t* column = &scratch.keys[size_t(t / 16) * 16 * D / 2 + t % 16];
    for (int p = 0; p < D / 2; p++) std::memcpy(&column[p * 16], k + 2 * p, 4);
  });
  const uint16_t* even = nullptr;
  for_each_token(v_cache + kv_head * D, blocks, seqlen, block_size, slot_size, D, [&](int t, const uint16_t* v) {
    uint16_t* row = &scratch.values[size_t(t / 32) * 32 * D + t % 32 / 2 * 32];
    if (t % 2) pack_value_pair(even, v, row);
    else if (t == seqlen - 1) pack_value_pair(v, nullptr, row);
    else even = v;
  });
  for (int row0 = 0; row0 < lq * group; row0 += 16) {
    const int rows = std::min(16, lq * group - row0);
    alignas(64) uint16_t qt[16][D] = {};  // rows past the end stay zero; their outputs are not stored
    int last_key[16];
    for (int r = 0; r < rows; r++) {
      const int row = row0 + r, i = row / group, head = kv_head * group + row % group;
      std::memcpy(qt[r], q + (q_start + i) * q_stride + head * D, sizeof qt[r]);
      last_key[r] = causal ? seqlen - lq + i : seqlen - 1;
    }
    const int end = last_key[rows - 1] + 1, end64 = (end + AMX_KEYS - 1) / AMX_KEYS * AMX_KEYS;
    for (int k0 = 0; k0 < end64; k0 += AMX_KEYS) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int s = 0; s < D / 32; s++) {  // 32 dimensions at a time: keys k0 + 16j in tile j
        const uint32_t* k = &scratch.keys[size_t(k0) * D / 2 + 16 * 16 * s];
        _tile_loadd(4, &qt[0][32 * s], D * 2);
        _tile_loadd(6, k, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, k + 8 * D, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, k + 16 * D, 64);
        _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(7, k + 24 * D, 64);
        _tile_dpbf16ps(3, 4, 7);
      }
      _tile_stored(0, &scratch.scores[k0], padded * 4);
      _tile_stored(1, &scratch.scores[k0 + 16], padded * 4);
      _tile_stored(2, &scratch.scores[k0 + 32], padded * 4);
      _tile_stored(3, &scratch.scores[k0 + 48], padded * 4);
    }
    float sums[16];
    for (int r = 0; r < rows; r++) {
      const float* s = &scratch.scores[size_t(r) * padded];
      uint16_t* p = &scratch.probs[size_t(r) * padded];
      const int n = last_key[r] + 1;
      const float max = *std::max_element(s, s + n) * scale;
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < end64; j += 16) {
        const __mmask16 live = n - j >= 16 ? 0xffff : n <= j ? 0 : (1u << (n - j)) - 1;
        const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(scale), _mm512_set1_ps(max));
        const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive(x));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), (__m256i)_mm512_cvtneps_pbh(e));
      }
      sums[r] = _mm512_reduce_add_ps(sum);
    }
    for (int d0 = 0; d0 < D; d0 += 64) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int k0 = 0; k0 < end64; k0 += 32) {
        const uint16_t* v = &scratch.values[size_t(k0) * D + d0 / 16 * 512];
        _tile_loadd(4, &scratch.probs[k0], padded * 2);
        _tile_loadd(5, v, 64);
        _tile_loadd(6, v + 512, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(7, v + 1024, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, v + 1536, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 4, 5);
      }
      alignas(64) float o[16][64];
      _tile_stored(0, &o[0][0], sizeof o[0]);
      _tile_stored(1, &o[0][16], sizeof o[0]);
      _tile_stored(2, &o[0][32], sizeof o[0]);
      _tile_stored(3, &o[0][48], sizeof o[0]);
      for (int r = 0; r < rows; r++) {
        const int row = row0 + r, i = row / group, head = kv_head * group + row % group;
        uint16_t* o_row = out + (size_t(q_start + i) * num_heads + head) * D + d0;
        for (int d = 0; d < 64; d++) store(o[r][d] / sums[r], &o_row[d]);
      }
    }
  }
}
#endif

// One task per (sequence, kv head); tasks differ in size with the square of the length. Sequence
// b has cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys, the last of its queries at the last of them.
// A sequence with one query (a decode row of a chunked-prefill step, or a prompt whose only new
// token follows a cached prefix) is attended as decode attends: converting its keys and values
// for one row of queries took 1.4x as long (40 such rows of 200 keys, 1.1 against 0.8 ms a layer).
template <typename T, typename Cache>
static int prefill(const T* q, int64_t q_stride, const Cache* k_cache, const Cache* v_cache, const int32_t* block_table,
                   const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k, T* out, int batch, int num_tokens,
                   int max_blocks, int num_blocks, int block_size, int num_heads, int num_kv_heads, float scale,
                   int causal, int window_left, float softcap, float v_scale, int num_threads) {
  if (cu_seqlens_q[0] != 0 || cu_seqlens_q[batch] != num_tokens || cu_seqlens_k[0] != 0) return BAD_CU_SEQLENS_Q;
  for (int b = 0; b < batch; b++) {
    const int64_t lq = int64_t(cu_seqlens_q[b + 1]) - cu_seqlens_q[b];
    const int64_t lk = int64_t(cu_seqlens_k[b + 1]) - cu_seqlens_k[b];
    if (lq < 0 || lk < lq) return BAD_LENGTHS;
    if (lk > int64_t(max_blocks) * block_size) return BAD_SEQLEN;
  }
  if (int error = check_block_table(block_table, batch, max_blocks, num_blocks)) return error;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> keys, values, scores;  // per thread, reused across its tasks
#ifdef AMX_PREFILL
    AmxScratch scratch;
    // AMX's softmax has neither a window nor a soft cap: those layers take prefill_head.
    const bool amx = std::is_same_v<T, uint16_t> && window_left < 0 && softcap == 0.f && amx_granted();
    if (amx) configure_tiles();
#endif
#pragma omp for schedule(dynamic) collapse(2)
    for (int b = 0; b < batch; b++)
      for (int h = 0; h < num_kv_heads; h++) {
        const int q_start = cu_seqlens_q[b], lq = cu_seqlens_q[b + 1] - q_start;
        const int lk = cu_seqlens_k[b + 1] - cu_seqlens_k[b], group = num_heads / num_kv_heads;
        const int32_t* blocks = block_table + size_t(b) * max_blocks;
        if (lq == 1)
          attend(q + q_start * q_stride + h * group * D, k_cache + h * D, v_cache + h * D, blocks, lk, block_size,
                 group, 1, size_t(num_kv_heads) * D, scale, first_key(lk - 1, window_left), softcap, v_scale,
                 scores, out + (size_t(q_start) * num_heads + h * group) * D);
        else {
#ifdef AMX_PREFILL
          if constexpr (std::is_same_v<T, uint16_t> && std::is_same_v<Cache, uint16_t>)
            if (amx) {
              prefill_head_amx(q, q_stride, k_cache, v_cache, blocks, q_start, lq, lk, block_size, num_heads,
                               num_kv_heads, scale, causal, h, out, scratch);
              continue;
            }
#endif
          prefill_head(q, q_stride, k_cache, v_cache, blocks, q_start, lq, lk, block_size, num_heads, num_kv_heads,
                       scale, causal, window_left, softcap, v_scale, h, out, keys, values, scores);
        }
      }
#ifdef AMX_PREFILL
    if (amx) _tile_release();
#endif
  }
  return 0;
}

// The entry points ctypes calls, each with its twin for a CPU graph's replay (cpu_graph.h): each
// kernel for bfloat16 (T = uint16_t) and float32, over a cache of the same type or of fp8 codes
// (named for both: decode_bfloat16_fp8_e4m3, and store_kvcache_bfloat16_fp8_e4m3 to write one).
#define ATTENTION_ENTRY_POINTS(NAME, T, C)                                                                         \
  extern "C" int decode_##NAME(const T* q, int64_t q_stride, const C* k_cache, const C* v_cache,                  \
                               const int32_t* block_table, const int32_t* seqlens, T* out, int batch,              \
                               int max_blocks, int num_blocks, int block_size, int num_heads, int num_kv_heads,    \
                               float scale, int window_left, float softcap, float v_scale, int num_threads) {      \
    return decode(q, q_stride, k_cache, v_cache, block_table, seqlens, out, batch, max_blocks, num_blocks,        \
                  block_size, num_heads, num_kv_heads, scale, window_left, softcap, v_scale, num_threads);          \
  }                                                                                                                \
  extern "C" int prefill_##NAME(const T* q, int64_t q_stride, const C* k_cache, const C* v_cache,                 \
                                const int32_t* block_table, const int32_t* cu_seqlens_q,                           \
                                const int32_t* cu_seqlens_k, T* out, int batch, int num_tokens, int max_blocks,   \
                                int num_blocks, int block_size, int num_heads, int num_kv_heads, float scale,      \
                                int causal, int window_left, float softcap, float v_scale, int num_threads) {      \
    return prefill(q, q_stride, k_cache, v_cache, block_table, cu_seqlens_q, cu_seqlens_k, out, batch,            \
                   num_tokens, max_blocks, num_blocks, block_size, num_heads, num_kv_heads, scale, causal,         \
                   window_left, softcap, v_scale, num_threads);                                                    \
  }                                                                                                                \
  REPLAYABLE(decode_##NAME)                                                                                        \
  REPLAYABLE(prefill_##NAME)
#define FP8_ENTRY_POINTS(NAME, T, C)                                                                               \
  ATTENTION_ENTRY_POINTS(NAME, T, C)                                                                               \
  extern "C" int store_kvcache_##NAME(const T* key, const T* value, int64_t key_stride, int64_t value_stride,     \
                                      C* k_cache, C* v_cache, const int64_t* slot_mapping, int num_tokens,         \
                                      int64_t num_slots, int64_t row, float k_inverse_scale,                       \
                                      float v_inverse_scale, int num_threads) {                                    \
    return store_kvcache_fp8(key, value, key_stride, value_stride, k_cache, v_cache, slot_mapping, num_tokens,    \
                             num_slots, row, k_inverse_scale, v_inverse_scale, num_threads);                      \
  }                                                                                                                \
  REPLAYABLE(store_kvcache_##NAME)

REPLAYABLE(store_kvcache)
ATTENTION_ENTRY_POINTS(bfloat16, uint16_t, uint16_t)
ATTENTION_ENTRY_POINTS(float32, float, float)
FP8_ENTRY_POINTS(bfloat16_fp8_e4m3, uint16_t, fp8_e4m3)
FP8_ENTRY_POINTS(bfloat16_fp8_e5m2, uint16_t, fp8_e5m2)
FP8_ENTRY_POINTS(float32_fp8_e4m3, float, fp8_e4m3)
FP8_ENTRY_POINTS(float32_fp8_e5m2, float, fp8_e5m2)
