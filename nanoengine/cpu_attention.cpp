// Decode attention over the paged KV cache on CPU: the job flash_attn_with_kvcache does on CUDA.
//
// Decode reads every cached key and value once per step and does little arithmetic with them, so
// its cost is memory traffic. In pure torch it has to gather each sequence's blocks into a padded
// copy first and then read that copy with batched matmuls: three passes over K/V. Here one task
// per sequence walks its block table and reads each key and value once, in place.
//
// nanoengine/cpu_attention.py compiles this file on first use, for one head size (HEAD_DIM), and
// calls it through ctypes. Layouts (all contiguous):
//   q, out        float32 [batch, num_heads, HEAD_DIM]
//   k/v_cache     T [num_blocks, block_size, num_kv_heads, HEAD_DIM], T = bfloat16 bits or float
//   block_table   int32 [batch, max_blocks];  seqlens int32 [batch]
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

constexpr int D = HEAD_DIM;

static inline float to_float(float x) { return x; }
static inline float to_float(uint16_t bf16) {  // bfloat16 is the top half of a float32
  uint32_t bits = uint32_t(bf16) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// Calls fn(t, slot) for tokens t = 0 .. seqlen-1 of one sequence, in order; slot points at token
// t's keys (or values) for all kv heads, side by side. Walking block by block reads the cache
// front to back within each block.
template <typename T, typename Fn>
static void for_each_token(const T* cache, const int32_t* blocks, int seqlen, int block_size, size_t slot_size,
                           Fn fn) {
  for (int b = 0, t = 0; t < seqlen; b++) {
    const T* slot = cache + size_t(blocks[b]) * block_size * slot_size;
    for (int n = std::min(block_size, seqlen - t); n > 0; n--, t++, slot += slot_size) fn(t, slot);
  }
}

// One sequence, every head, in two passes over its blocks: the scores q.k of every query head for
// every key, a softmax per query head, then the probability-weighted sum of the values.
template <typename T>
static void attend(const float* q, const T* k_cache, const T* v_cache, const int32_t* blocks, int seqlen,
                   int block_size, int num_heads, int num_kv_heads, float scale, float* scores, float* out) {
  const int group = num_heads / num_kv_heads;  // query heads per kv head (GQA)
  const size_t slot_size = size_t(num_kv_heads) * D;
  for_each_token(k_cache, blocks, seqlen, block_size, slot_size, [&](int t, const T* k) {
    for (int h = 0; h < num_kv_heads; h++) {
      float key[D];
      for (int d = 0; d < D; d++) key[d] = to_float(k[h * D + d]);
      for (int g = h * group; g < (h + 1) * group; g++) {
        float s = 0.f;
        for (int d = 0; d < D; d++) s += q[g * D + d] * key[d];
        scores[g * seqlen + t] = s * scale;
      }
    }
  });
  for (int g = 0; g < num_heads; g++) {
    float* s = scores + g * seqlen;
    const float max = *std::max_element(s, s + seqlen);
    float sum = 0.f;
    for (int t = 0; t < seqlen; t++) sum += s[t] = std::exp(s[t] - max);
    for (int t = 0; t < seqlen; t++) s[t] /= sum;
  }
  std::fill(out, out + num_heads * D, 0.f);
  for_each_token(v_cache, blocks, seqlen, block_size, slot_size, [&](int t, const T* v) {
    for (int h = 0; h < num_kv_heads; h++) {
      float value[D];
      for (int d = 0; d < D; d++) value[d] = to_float(v[h * D + d]);
      for (int g = h * group; g < (h + 1) * group; g++)
        for (int d = 0; d < D; d++) out[g * D + d] += scores[g * seqlen + t] * value[d];
    }
  });
}

// One task per sequence, shared out over as many OpenMP threads as torch uses (sequences differ
// in length, hence the dynamic schedule). libgomp is the one torch loaded, so the threads are its.
template <typename T>
static void decode(const float* q, const T* k_cache, const T* v_cache, const int32_t* block_table,
                   const int32_t* seqlens, float* out, int batch, int max_blocks, int block_size,
                   int num_heads, int num_kv_heads, float scale, int num_threads) {
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scores;  // per thread, reused across its sequences
#pragma omp for schedule(dynamic)
    for (int i = 0; i < batch; i++) {
      float* o = out + size_t(i) * num_heads * D;
      if (seqlens[i] == 0) {  // a padded batch row: zeros, as flash-attn gives
        std::fill(o, o + num_heads * D, 0.f);
        continue;
      }
      scores.resize(size_t(num_heads) * seqlens[i]);
      attend(q + size_t(i) * num_heads * D, k_cache, v_cache, block_table + size_t(i) * max_blocks, seqlens[i],
             block_size, num_heads, num_kv_heads, scale, scores.data(), o);
    }
  }
}

extern "C" {
void decode_bfloat16(const float* q, const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* block_table,
                     const int32_t* seqlens, float* out, int batch, int max_blocks, int block_size, int num_heads,
                     int num_kv_heads, float scale, int num_threads) {
  decode(q, k_cache, v_cache, block_table, seqlens, out, batch, max_blocks, block_size, num_heads, num_kv_heads, scale,
         num_threads);
}
void decode_float32(const float* q, const float* k_cache, const float* v_cache, const int32_t* block_table,
                    const int32_t* seqlens, float* out, int batch, int max_blocks, int block_size, int num_heads,
                    int num_kv_heads, float scale, int num_threads) {
  decode(q, k_cache, v_cache, block_table, seqlens, out, batch, max_blocks, block_size, num_heads, num_kv_heads, scale,
         num_threads);
}
}
