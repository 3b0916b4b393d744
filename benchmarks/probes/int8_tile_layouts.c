// What the layout of x costs the 16-row int8 tile (AVX512-VNNI), outside cbserve: a Q4_0 weight of
// N x K in the file's rows (18-byte blocks), tiles of 16 weight rows (scales gathered, quants
// transposed, as engine/csrc/quant_cpu.cpp's tile_int8_lanes does), times 16 rows of int8 x, both cores
// by OpenMP's static split, best of 7. x's int8 blocks, their sums and scales are laid out either
// by row (row r's block b at r * K + 32 b, cbserve's QuantizedX today) or, built with -DBY_BLOCK, by
// block (block b of the 16 rows together, row r at (16 b + r) * 32), so that the 16 rows of a block
// sit at fixed offsets from one pointer. -DFIXED_K=2048 makes K a constant (then the row-major offsets
// are constants as well). K is otherwise the first argument.
//
//   gcc -O3 -fopenmp -march=native benchmarks/probes/int8_tile_layouts.c -o /tmp/itl_rows
//   gcc -O3 -fopenmp -march=native -DBY_BLOCK benchmarks/probes/int8_tile_layouts.c -o /tmp/itl_blocks
//   gcc -O3 -fopenmp -march=native -DFIXED_K=2048 benchmarks/probes/int8_tile_layouts.c -o /tmp/itl_fixed
//   for p in rows blocks fixed; do OMP_NUM_THREADS=2 /tmp/itl_$p 2048; done
//
// AVX512-VNNI hosts only (the tile is the VNNI one). docs/benchmarks.md (the 1B shape on Zen 5) has
// its figures. Not part of the build or the tests.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define R 16  // rows of x
#define G 8   // rows of x whose sums are built side by side

// engine/csrc/int8_lanes.h's transpose16x16, copied: this program is plain C and builds without ATen
static void transpose16x16(const uint8_t* base, long rb, __m512i out[4]) {
  __m512i z[4];
  for (int a = 0; a < 4; ++a) {
    z[a] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(base + a * rb)));
    for (int l = 1; l < 4; ++l)
      z[a] = _mm512_inserti32x4(z[a], _mm_loadu_si128((const __m128i*)(base + (a + 4 * l) * rb)), l);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  out[0] = _mm512_unpacklo_epi64(t0, t2);
  out[1] = _mm512_unpackhi_epi64(t0, t2);
  out[2] = _mm512_unpacklo_epi64(t1, t3);
  out[3] = _mm512_unpackhi_epi64(t1, t3);
}

int main(int argc, char** argv) {
#ifdef BY_BLOCK
  enum { by_block = 1 };
#else
  enum { by_block = 0 };
#endif
#ifdef FIXED_K
  const long K = FIXED_K;
  (void)argc, (void)argv;
#else
  const long K = argc > 1 ? atol(argv[1]) : 2048;
#endif
  const long N = 49152, blocks = K / 32, rb = blocks * 18;  // the 1B shape's LM head: 56 MB, past the L3
  uint8_t* w = aligned_alloc(64, N * rb + 4096);
  for (long i = 0; i < N * rb; ++i) w[i] = (uint8_t)(i * 131 + 7);
  for (long i = 0; i < N * blocks; ++i) memcpy(w + i * 18, &(uint16_t){0x3c00}, 2);  // scales 1.0
  int8_t* x = aligned_alloc(64, R * K);
  int32_t* sq = aligned_alloc(64, R * blocks * 4);
  float* xd = aligned_alloc(64, R * blocks * 4);
  for (long i = 0; i < R * K; ++i) x[i] = (int8_t)(i * 7);
  for (long i = 0; i < R * blocks; ++i) sq[i] = i % 50, xd[i] = 0.01f;
  float* y = aligned_alloc(64, N * R * 4);
  const __m512i lanes = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)rb));
  double best = 1e9;
  for (int rep = 0; rep < 7; ++rep) {
    const double t0 = omp_get_wtime();
#pragma omp parallel for schedule(static)
    for (long t = 0; t < N / 16; ++t) {
      const uint8_t* tile = w + t * 16 * rb;
      __m512 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
      for (long b = 0; b < blocks; ++b) {
        const uint8_t* blk = tile + b * 18;
        for (int i = 0; i < 16; ++i) _mm_prefetch((const char*)(blk + (16 + i) * rb), _MM_HINT_T0);
        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(lanes, blk, 1)));
        __m512i nib[4], wq[8];
        transpose16x16(blk + 2, rb, nib);
        for (int g = 0; g < 4; ++g) {
          wq[g] = _mm512_and_si512(nib[g], _mm512_set1_epi8(0x0f));
          wq[4 + g] = _mm512_and_si512(_mm512_srli_epi16(nib[g], 4), _mm512_set1_epi8(0x0f));
        }
        for (int r1 = 0; r1 < R; r1 += G) {
          __m512i sum[G];
          for (int r = 0; r < G; ++r) {
            const long i = by_block ? b * R + r1 + r : (r1 + r) * blocks + b;
            sum[r] = _mm512_set1_epi32(-8 * sq[i]);
          }
          for (int g = 0; g < 8; ++g)
            for (int r = 0; r < G; ++r) {
              const int8_t* xb = by_block ? x + (b * R + r1 + r) * 32 : x + (r1 + r) * K + b * 32;
              sum[r] = _mm512_dpbusd_epi32(sum[r], wq[g], _mm512_set1_epi32(((const int32_t*)xb)[g]));
            }
          for (int r = 0; r < G; ++r) {
            const long i = by_block ? b * R + r1 + r : (r1 + r) * blocks + b;
            acc[r1 + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), _mm512_mul_ps(d, _mm512_set1_ps(xd[i])), acc[r1 + r]);
          }
        }
      }
      for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (t * R + r) * 16, acc[r]);
    }
    const double s = omp_get_wtime() - t0;
    if (s < best) best = s;
  }
  printf("x by %s, K %ld%s: %.2f ms, %.1f G-MAC/s (checksum %d)\n", by_block ? "block" : "row", K,
#ifdef FIXED_K
         " (fixed)",
#else
         "",
#endif
         best * 1e3, (double)N * K * R / best / 1e9, (int)y[12345] & 1);
  return 0;
}
