// AMX's tiles, for the kernels that use them (cpu_linear.cpp in bf16, cpu_int8_gemm.cpp in int8,
// and cpu_attention.cpp's bf16 prefill), where the compiler was told the CPU has them
// (-march=native on a CPU with AMX).
//
// A tile register holds 16 rows of 64 bytes. One tile instruction multiplies a tile of x (16 rows
// by 64 bytes of k) by a tile of the weight (the same k for 16 columns, laid out as 16 rows of k
// pairs or quads, column by column) into 16 x 16 float32 or int32 sums: 16 x 16 x 32 bf16 or
// 16 x 16 x 64 int8 multiply-adds, 256 times what one 512-bit vector instruction does. Both
// matmul kernels block the same way: 32 rows by 32 columns, two tiles of x, two of the weight,
// four of sums, all eight tile registers, and each sum is made over k in the same order whatever
// the number of rows.
#pragma once
#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

// Blocks of 32 rows taken at a time (256 rows; x's share of a core's 2 MB L2 at K = 1536) while
// every strip of columns passes.
constexpr int AMX_CHUNK = 8;

// Linux gives a process AMX's 8 KB of tile state only once it asks (arch_prctl, XTILEDATA), for
// the whole process, as oneDNN asks too; a thread that uses the tiles unasked is killed. Asked once.
static inline bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
  return granted;
}

// Every tile register 16 rows of 64 bytes, for this thread (each thread loads its own).
static inline void configure_tiles() {
  struct {  // the hardware's 64-byte format (palette 1)
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; t++) config.rows[t] = 16, config.bytes_per_row[t] = 64;
  _tile_loadconfig(&config);
}

// Two tiles' bytes (2 KB) of a weight strip into L2, ahead of the loads that will want them. Not
// into L1: there each prefetch holds one of the core's few line-fill buffers until its line
// arrives from memory, and the tile loads queue behind them (30 layers' matmuls, weights from
// memory: 5-8% faster at 1 row, level or faster at 41 and 64).
constexpr int TILE_BYTES = 64;
static inline void prefetch_tiles(const char* p) {
  for (int line = 0; line < 2 * 16 * TILE_BYTES; line += 64) _mm_prefetch(p + line, _MM_HINT_T1);
}

// Whether out, N columns of `bytes_per_value` each over M rows, is written past the cache. An
// ordinary store first reads its line from memory (to own it), so a prefill's output, megabytes
// that no cache keeps until the next kernel reads them, costs a read as well as a write: with
// streaming stores, whole lines that skip that read, the four matmuls of a SmolLM2 layer at 4,864
// rows took 18.1-18.2 ms against 22.6-22.7 in bf16, and through the int8 GEMM 18.0-41.7 against
// 27.5-53.3 (interleaved runs, two rounds). A decode step's layer outputs (64 rows at most, under
// 1 MB) stay in cache for the next kernel; its LM head's logits pass 4 MB from 43 rows, and the
// sampler reads them once. Strips are whole lines when N is a multiple of 32 and out starts on one.
static inline bool streams_out(const void* out, int M, int N, int bytes_per_value) {
  return N % 32 == 0 && reinterpret_cast<uintptr_t>(out) % 64 == 0 && int64_t(M) * N * bytes_per_value > (4 << 20);
}

// One 64-byte line of out, through the cache or streamed past it. A thread that streamed calls
// _mm_sfence() before its work is handed on, as streaming stores are not ordered with the others.
static inline void store_line(void* line, __m512i v, bool stream) {
  if (stream)
    _mm512_stream_si512(static_cast<__m512i*>(line), v);
  else
    _mm512_storeu_si512(line, v);
}

// Tiles 0-3 (sums) side by side into a [32][32] array of 4-byte sums.
template <typename S>
static inline void store_sums(S (*sums)[32]) {
  _tile_stored(0, &sums[0][0], 32 * sizeof(S));
  _tile_stored(1, &sums[0][16], 32 * sizeof(S));
  _tile_stored(2, &sums[16][0], 32 * sizeof(S));
  _tile_stored(3, &sums[16][16], 32 * sizeof(S));
}
#endif
