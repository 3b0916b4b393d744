// Linear layers on GGUF-quantized weights, multiplied in their blocks: Q8_0, Q4_0 and Q4_1.
//
// A weight row is the file's bytes, unchanged: blocks of 32 weights, each a float16 scale d (and
// for Q4_1 a float16 minimum m) and the quants (Q8_0: 32 int8, w = q * d; Q4_0: 16 bytes of
// nibbles, elements 0-15 in the low nibbles and 16-31 in the high ones, w = (q - 8) * d; Q4_1: the
// same nibbles, w = q * d + m). Each weight block is unpacked once for up to kRows rows of x; work
// is split over output rows.
//
// Two products. The default keeps x in float32: the block is dequantized in registers (32 floats,
// exactly the reference's values) and multiplied into the rows of x with FMAs, so the result is x
// times the dequantized weight up to the order of the float sums: the engine's output matches
// `model.generate` as it does for a float model. AVX-512 builds run it on tiles of 4 weight rows by 4
// rows of x in 512-bit vectors (each block dequantized once per tile and used by 4 rows of x, each x
// vector loaded once for 4 weight rows; above 4 rows of x a tile's weights are dequantized once into
// a buffer that every group of rows reads); each row's sums take the same steps whatever the batch.
//
// The other (`int8`, llama.cpp's way) first quantizes each row of x to int8 blocks of 32 with a
// float scale dx per block (keeping the block's sum s = dx * sum(qx)), then takes integer dot
// products block by block and scales them:
//   Q8_0: d * dx * sum(q * qx)         Q4_0: d * (dx * sum(q * qx) - 8 s)        Q4_1: d * dx * sum(q * qx) + m s
// Weight rows go in tiles of 16 (AVX-512 with VNNI: vpdpbusd) or 8 (AVX2: vpmaddubsw + vpmaddwd),
// one per 32-bit lane, transposed in registers block by block, and each row of x multiplies a whole
// tile with its 4-byte groups broadcast (x quantized in panels of 16 rows, int8_lanes.h: a pass's rows
// of one block at fixed offsets from one pointer); the rows left over (and the AVX-512 build with VNNI off) go
// one weight row at a time, 32 bytes a block, vpmaddubsw + vpmaddwd or vpdpbusd (AVX-VNNI). Both
// multiply unsigned by signed bytes, so Q4's nibbles go in as they are and Q8_0's signed quants as
// |q| against sign(qx, q), or in the VNNI tiles as q + 128 from -128 sum(qx).
// Where the build has int8 tiles (AVX512-VNNI, AVX2) a weight can also be repacked once, at load
// (`quant_repack`, as llama.cpp repacks its Q4_0 for its CPU tiles): each full tile of 16 (8) rows
// laid out block by block as the tile reads it (the scales, then the quants already transposed), so
// the int8 product reads one stream with no gather or transpose (1.3-1.6x at 16 rows on a Zen 5,
// docs/engine.md); such a weight's type carries kRepacked, and only the int8 tiles and the
// dequantization read it.
// `set_quant_vnni(false)` turns VNNI off at run time (tests prove both paths on a host that has
// it). Its results differ from the float product by x's rounding to 8 bits, and a float-rounding
// difference in x (another attention kernel) can move a rounding step: greedy output then departs
// from `model.generate` now and then, so it is not the default.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "int8_lanes.h"
#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace cbserve;

constexpr int64_t kBlock = 32;
constexpr int64_t kRows = 4;  // rows of x per unpacked weight block
constexpr int64_t kXPanel = 16;  // rows of int8 x a panel (int8_lanes.h): the int8 tiles' rows a pass
enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };  // ggml's type numbers
template <int64_t Q>
constexpr int64_t kBlockBytes = Q == kQ8_0 ? 34 : Q == kQ4_0 ? 18 : 20;  // a block's bytes
// bytes at the head of a repacked tile's block: its `rows` rows' float16 scales (and Q4_1's minimums)
constexpr int64_t repacked_head(int64_t rows, int64_t qtype) { return rows * 2 * (qtype == kQ4_1 ? 2 : 1); }

// the next tile's block in each of its N rows: a tile's rows are N short streams that the hardware
// prefetcher barely starts on before they end
template <int64_t N>
inline void prefetch_next_tile(const uint8_t* blk, int64_t row_bytes) {
  for (int64_t i = 0; i < N; ++i) _mm_prefetch(reinterpret_cast<const char*>(blk + (N + i) * row_bytes), _MM_HINT_T0);
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define CB_VNNI 1
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
#define CB_VNNI 1
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
#define CB_VNNI 0
#endif

std::atomic<bool> g_vnni{CB_VNNI != 0};

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ8_0: return 2 + 32;
    case kQ4_0: return 2 + 16;
    case kQ4_1: return 4 + 16;
  }
  TORCH_CHECK(false, "quantized linear: type ", qtype, " is not Q8_0 (8), Q4_0 (2) or Q4_1 (3)");
}

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 32 unsigned bytes times 32 signed bytes, summed in pairs of pairs: 8 int32 lanes
template <bool VNNI>
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if CB_VNNI
  if constexpr (VNNI) return dpbusd(_mm256_setzero_si256(), u, s);
#endif
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// R rows of x (from row r0) against weight row `w` of type Q: R sums into out[0..R)
template <int64_t Q, bool VNNI, int R>
inline void dot_rows(const uint8_t* w, const QuantizedX& x, int64_t r0, float* out) {
  const int64_t blocks = x.k / kBlock, bb = kBlockBytes<Q>;
  __m256 acc[R];
  float extra[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), extra[r] = 0.0f;
  const __m128i low4 = _mm_set1_epi8(0x0f);
  // x in panels: rows r0.. (within one panel) side by side in each block, `step` indexes a block
  const int64_t first = x.at(r0, 0), step = std::min(x.panel, x.m - (r0 - r0 % x.panel));
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = w + b * bb;
    const float d = half(blk);
    __m256i wq;
    if constexpr (Q == kQ8_0) {
      wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    } else {
      const __m128i nib = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (Q == kQ4_1 ? 4 : 2)));
      wq = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(nib, 4), low4), _mm_and_si128(nib, low4));
    }
    const __m256i wu = Q == kQ8_0 ? _mm256_sign_epi8(wq, wq) : wq;  // |q|: unsigned for the product
    const float m = Q == kQ4_1 ? half(blk + 2) : 0.0f;
    for (int r = 0; r < R; ++r) {
      const int64_t i = first + b * step + r;
      __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + i * kBlock));
      if constexpr (Q == kQ8_0) xq = _mm256_sign_epi8(xq, wq);
      const __m256 p = _mm256_cvtepi32_ps(dot_u8s8<VNNI>(wu, xq));
      acc[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(d * x.d[i]), acc[r]);
      if constexpr (Q == kQ4_0) extra[r] -= 8.0f * d * x.s[i];
      if constexpr (Q == kQ4_1) extra[r] += m * x.s[i];
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum8(acc[r]) + extra[r];
}

// The same with x in float32: each weight block dequantized to 32 floats once (as the reference
// does: q * d + m, or (q - 8) * d) and multiplied into R rows of x with FMAs. The result is the
// product of x and the dequantized weight up to the order of the float sums.
template <int64_t Q, int R>
inline void dot_rows_float(const uint8_t* w, const float* x, int64_t k, int64_t r0, float* out) {
  const int64_t blocks = k / kBlock, bb = kBlockBytes<Q>;
  // two sums a row (the block's quarters 0, 2 and 1, 3): one would chain 4 dependent FMAs a block,
  // and with one row of x that chain's latency, not the unpacking, would set the pace
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = w + b * bb;
    if ((b & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(blk + 1024), _MM_HINT_T0);
    const __m256 d = _mm256_set1_ps(half(blk));
    __m256 wf[4];
    if constexpr (Q == kQ8_0) {
      for (int i = 0; i < 4; ++i)
        wf[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                  reinterpret_cast<const __m128i*>(blk + 2 + 8 * i)))), d);
    } else {  // bytes 0-7 and 8-15 widened to lanes (from memory): low nibbles masked, high ones shifted down
      const uint8_t* nib = blk + (Q == kQ4_1 ? 4 : 2);
      const __m256 m = Q == kQ4_1 ? _mm256_set1_ps(half(blk + 2)) : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
      const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(nib)));
      const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(nib + 8)));
      const __m256i low = _mm256_set1_epi32(0x0f);
      const __m256i parts[4] = {_mm256_and_si256(b0, low), _mm256_and_si256(b1, low), _mm256_srli_epi32(b0, 4),
                                _mm256_srli_epi32(b1, 4)};
      for (int i = 0; i < 4; ++i) wf[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(parts[i]), d, m);
    }
    for (int r = 0; r < R; ++r) {
      const float* xb = x + (r0 + r) * k + b * kBlock;
      for (int i = 0; i < 4; ++i) acc[r][i & 1] = _mm256_fmadd_ps(wf[i], _mm256_loadu_ps(xb + 8 * i), acc[r][i & 1]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1]));
}

#if defined(__AVX512F__)
constexpr int64_t kTileN = 4;  // weight rows per tile of the 512-bit float product

// one weight block as two 16-float vectors (elements 0-15, 16-31): the same values as the reference's.
// Q4: the 16 values a nibble can stand for, q * d + m, made once (exactly the reference's: q * d has
// at most 15 significant bits), then looked up with vpermps, which reads the low 4 bits of each
// 32-bit lane: the block's bytes widened to lanes are the low nibbles' indexes, shifted right by 4
// the high ones'. 7 vector instructions a block instead of 11 (widen, convert, fma, twice).
template <int64_t Q>
inline void dequantize_block16(const uint8_t* blk, __m512& lo, __m512& hi) {
  const __m512 d = _mm512_set1_ps(half(blk));
  if constexpr (Q == kQ8_0) {
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)))), d);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)))), d);
  } else {
    __m512 table;  // Q4_0: (q - 8) d, one exact product, the same value as the reference's q d - 8 d
    if constexpr (Q == kQ4_1) {
      table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), d,
                              _mm512_set1_ps(half(blk + 2)));
    } else {
      table = _mm512_mul_ps(_mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7), d);
    }
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (Q == kQ4_1 ? 4 : 2))));
    lo = _mm512_permutexvar_ps(q, table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
  }
}

// A tile of NJ weight rows (from `w`, `row_bytes` apart; or already dequantized, `wf` [NJ, k]) times
// R rows of x (from row r0): each weight block as 2 NJ vectors multiplied into the R rows' two
// vectors. Sums into out[r * NJ + j]. Each (row, weight row) sum takes the same steps whatever R and
// NJ are and wherever the weights come from, so a row's result does not depend on its batch.
template <int64_t Q, int R, int NJ>
inline void tile_float16(const uint8_t* w, int64_t row_bytes, const float* wf, const float* x, int64_t k, int64_t r0,
                         float* out) {
  const int64_t blocks = k / kBlock, bb = kBlockBytes<Q>;
  __m512 acc[R][NJ];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NJ; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 lo[NJ], hi[NJ];
    for (int j = 0; j < NJ; ++j) {
      if (wf) {
        lo[j] = _mm512_loadu_ps(wf + j * k + b * kBlock);
        hi[j] = _mm512_loadu_ps(wf + j * k + b * kBlock + 16);
      } else {
        const uint8_t* blk = w + j * row_bytes + b * bb;
        // the next tile's block (NJ rows further): a tile's rows are short streams (1-2 KiB) that
        // the hardware prefetcher barely starts on before they end
        _mm_prefetch(reinterpret_cast<const char*>(blk + NJ * row_bytes), _MM_HINT_T0);
        dequantize_block16<Q>(blk, lo[j], hi[j]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float* xb = x + (r0 + r) * k + b * kBlock;
      const __m512 xl = _mm512_loadu_ps(xb), xh = _mm512_loadu_ps(xb + 16);
      for (int j = 0; j < NJ; ++j) acc[r][j] = _mm512_fmadd_ps(hi[j], xh, _mm512_fmadd_ps(lo[j], xl, acc[r][j]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NJ; ++j) out[r * NJ + j] = _mm512_reduce_add_ps(acc[r][j]);
}

template <int64_t Q, int R>
void tile_float16_n(int64_t nj, const uint8_t* w, int64_t row_bytes, const float* wf, const float* x, int64_t k,
                    int64_t r0, float* out) {
  switch (nj) {
    case 1: return tile_float16<Q, R, 1>(w, row_bytes, wf, x, k, r0, out);
    case 2: return tile_float16<Q, R, 2>(w, row_bytes, wf, x, k, r0, out);
    case 3: return tile_float16<Q, R, 3>(w, row_bytes, wf, x, k, r0, out);
    default: return tile_float16<Q, R, 4>(w, row_bytes, wf, x, k, r0, out);
  }
}

template <int64_t Q>
void tile_float16_any(int64_t rows, int64_t nj, const uint8_t* w, int64_t row_bytes, const float* wf, const float* x,
                      int64_t k, int64_t r0, float* out) {
  switch (rows) {
    case 1: return tile_float16_n<Q, 1>(nj, w, row_bytes, wf, x, k, r0, out);
    case 2: return tile_float16_n<Q, 2>(nj, w, row_bytes, wf, x, k, r0, out);
    case 3: return tile_float16_n<Q, 3>(nj, w, row_bytes, wf, x, k, r0, out);
    default: return tile_float16_n<Q, 4>(nj, w, row_bytes, wf, x, k, r0, out);
  }
}

// the tile's nj weight rows dequantized into wf [nj, k], for batches of more than kRows rows of x
template <int64_t Q>
void dequantize_tile16(const uint8_t* w, int64_t row_bytes, int64_t nj, int64_t k, float* wf) {
  const int64_t bb = kBlockBytes<Q>;
  for (int64_t j = 0; j < nj; ++j)
    for (int64_t b = 0; b < k / kBlock; ++b) {
      __m512 lo, hi;
      dequantize_block16<Q>(w + j * row_bytes + b * bb, lo, hi);
      _mm512_storeu_ps(wf + j * k + b * kBlock, lo);
      _mm512_storeu_ps(wf + j * k + b * kBlock + 16, hi);
    }
}
#endif

template <int64_t Q>
void dot_rows_float_any(int64_t rows, const uint8_t* w, const float* x, int64_t k, int64_t r0, float* out) {
  switch (rows) {
    case 1: return dot_rows_float<Q, 1>(w, x, k, r0, out);
    case 2: return dot_rows_float<Q, 2>(w, x, k, r0, out);
    case 3: return dot_rows_float<Q, 3>(w, x, k, r0, out);
    default: return dot_rows_float<Q, 4>(w, x, k, r0, out);
  }
}

template <int64_t Q, bool VNNI>
void dot_rows_any(int64_t rows, const uint8_t* w, const QuantizedX& x, int64_t r0, float* out) {
  switch (rows) {
    case 1: return dot_rows<Q, VNNI, 1>(w, x, r0, out);
    case 2: return dot_rows<Q, VNNI, 2>(w, x, r0, out);
    case 3: return dot_rows<Q, VNNI, 3>(w, x, r0, out);
    default: return dot_rows<Q, VNNI, 4>(w, x, r0, out);
  }
}

#if defined(__AVX512F__) && CB_VNNI
// The int8 product on AVX512-VNNI, in tiles of 16 weight rows, one per 32-bit lane (llama.cpp's
// repacked layout, made per block in registers instead of at load): a block of the 16 rows is
// transposed so that register g holds, in lane j, row j's quants 4g..4g+3 (8 registers a block),
// and each row of x multiplies all 16 rows at once with 8 vpdpbusd of its own 4 bytes broadcast:
// one int32 block sum per lane, then one conversion and one FMA by the 16 rows' scales times the x
// block's. vpdpbusd multiplies unsigned weights by signed x: Q4's nibbles q go in as they are and
// the block sum starts at -8 sum(qx) (Q4_0), Q8_0's quants as q + 128 (q xor 0x80) from -128
// sum(qx). The integer sums are exact, so the result is the same as the 256-bit path's up to the
// order of the float sums.
constexpr int64_t kLaneRows = 16;  // weight rows per tile

// One block of the tile's 16 rows made ready for vpdpbusd: the quants (Q8_0's biased by 128, Q4's
// nibbles split), the rows' scales and Q4_1's minimums
struct LaneBlock {
  __m512i wq[8];
  __m512 d, m;
};

template <int64_t Q>
__attribute__((always_inline)) inline void unpack_lane_block(const uint8_t* blk, int64_t row_bytes, __m512i rows,
                                                             LaneBlock& o) {
  const __m512i low4 = _mm512_set1_epi8(0x0f), bias = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i head = _mm512_i32gather_epi32(rows, blk, 1);  // each row's scale (and Q4_1's minimum)
  o.d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
  if constexpr (Q == kQ8_0) {
    transpose16x16(blk + 2, row_bytes, o.wq);
    transpose16x16(blk + 18, row_bytes, o.wq + 4);
    for (int g = 0; g < 8; ++g) o.wq[g] = _mm512_xor_si512(o.wq[g], bias);
  } else {
    __m512i nib[4];
    transpose16x16(blk + (Q == kQ4_1 ? 4 : 2), row_bytes, nib);
    for (int g = 0; g < 4; ++g) {
      o.wq[g] = _mm512_and_si512(nib[g], low4);
      o.wq[4 + g] = _mm512_and_si512(_mm512_srli_epi16(nib[g], 4), low4);
    }
  }
  if constexpr (Q == kQ4_1) o.m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
}

// block b of the tile times the R rows of x from r0, added to acc
template <int64_t Q, int R>
__attribute__((always_inline)) inline void accumulate_lane_block(const LaneBlock& lb, const QuantizedX& x, int64_t r0,
                                                                 int64_t b, __m512* acc) {
  constexpr int G = R < 8 ? R : 8;  // rows of x a group
  // x in panels of kLaneX rows (a pass: these R rows from r0), block b of each side by side, 32 bytes
  // apart, and their scales and sums
  const int64_t i0 = r0 * (x.k / kBlock) + b * R;
  const int32_t* xq = reinterpret_cast<const int32_t*>(x.q + i0 * kBlock);
#pragma GCC unroll 2
  for (int r1 = 0; r1 < R; r1 += G) {
    __m512i sum[G];
#pragma GCC unroll 8
    for (int r = 0; r < G; ++r) {
      if (r1 + r >= R) break;
      const int64_t i = i0 + r1 + r;
      sum[r] = _mm512_set1_epi32(Q == kQ8_0 ? -128 * x.sq[i] : Q == kQ4_0 ? -8 * x.sq[i] : 0);
    }
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
#pragma GCC unroll 8
      for (int r = 0; r < G; ++r) {
        if (r1 + r >= R) break;
        sum[r] = _mm512_dpbusd_epi32(sum[r], lb.wq[g], _mm512_set1_epi32(xq[(r1 + r) * 8 + g]));
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < G; ++r) {
      if (r1 + r >= R) break;
      const int64_t i = i0 + r1 + r;
      acc[r1 + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), _mm512_mul_ps(lb.d, _mm512_set1_ps(x.d[i])), acc[r1 + r]);
      if constexpr (Q == kQ4_1) acc[r1 + r] = _mm512_fmadd_ps(lb.m, _mm512_set1_ps(x.s[i]), acc[r1 + r]);
    }
  }
}

inline __m512i lane_row_offsets(int64_t row_bytes) {
  return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                            _mm512_set1_epi32(static_cast<int32_t>(row_bytes)));
}

// 16 weight rows (from w) times R rows of x (from row r0): out[r * 16 + j]. The rows of x go in
// groups of up to 8 whose sums are built side by side, g by g: each sum's next vpdpbusd is 8
// instructions behind its last, not right behind it, and the group's x words and sums stay in
// registers.
template <int64_t Q, int R>
inline void tile_int8_lanes(const uint8_t* w, int64_t row_bytes, const QuantizedX& x, int64_t r0, float* out) {
  const int64_t blocks = x.k / kBlock, bb = kBlockBytes<Q>;
  const __m512i rows = lane_row_offsets(row_bytes);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = w + b * bb;
    prefetch_next_tile<kLaneRows>(blk, row_bytes);
    LaneBlock lb;
    unpack_lane_block<Q>(blk, row_bytes, rows, lb);
    accumulate_lane_block<Q, R>(lb, x, r0, b, acc);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kLaneRows, acc[r]);
}

// More than one pass of rows of x over a tile (a step with prompt tokens): the tile's blocks are
// unpacked once into `unpacked` (640 bytes a block, in L1 or L2) and every pass reads them there,
// instead of each pass gathering and transposing them again. The same products in the same order.
template <int64_t Q>
inline void unpack_tile_int8(const uint8_t* w, int64_t row_bytes, int64_t blocks, LaneBlock* unpacked) {
  const int64_t bb = kBlockBytes<Q>;
  const __m512i rows = lane_row_offsets(row_bytes);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = w + b * bb;
    prefetch_next_tile<kLaneRows>(blk, row_bytes);
    unpack_lane_block<Q>(blk, row_bytes, rows, unpacked[b]);
  }
}

template <int64_t Q, int R>
inline void tile_int8_unpacked(const LaneBlock* unpacked, const QuantizedX& x, int64_t r0, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.k / kBlock; ++b) accumulate_lane_block<Q, R>(unpacked[b], x, r0, b, acc);
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kLaneRows, acc[r]);
}

// The repacked layout (llama.cpp repacks its Q4_0 for its CPU tiles the same way, at load): a full
// tile of 16 weight rows keeps its 16 x row_bytes bytes, block after block, each block's 16 x (block
// bytes) holding the 16 rows' float16 scales, Q4_1's 16 minimums, then the quants as
// unpack_lane_block leaves them in registers (Q8_0: 8 x 64 bytes, biased by 128; Q4: 4 x 64 bytes of
// nibbles, split when loaded). One tile is then one stream read straight into the registers: no
// gather of the scales, no transpose. The rows after the last full tile stay as the file has them.
template <int64_t Q>
constexpr int64_t kLaneHead = repacked_head(kLaneRows, Q);

template <int64_t Q>
void repack_tile(const uint8_t* w, int64_t row_bytes, int64_t blocks, uint8_t* out) {
  const __m512i rows = lane_row_offsets(row_bytes);
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = w + b * kBlockBytes<Q>;
    uint8_t* tb = out + b * kLaneRows * kBlockBytes<Q>;
    const __m512i head = _mm512_i32gather_epi32(rows, blk, 1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(tb), _mm512_cvtepi32_epi16(head));
    if constexpr (Q == kQ4_1)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(tb + 32), _mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
    __m512i q[8];
    if constexpr (Q == kQ8_0) {
      transpose16x16(blk + 2, row_bytes, q);
      transpose16x16(blk + 18, row_bytes, q + 4);
      for (int g = 0; g < 8; ++g) _mm512_storeu_si512(tb + kLaneHead<Q> + 64 * g, _mm512_xor_si512(q[g], bias));
    } else {
      transpose16x16(blk + (Q == kQ4_1 ? 4 : 2), row_bytes, q);
      for (int g = 0; g < 4; ++g) _mm512_storeu_si512(tb + kLaneHead<Q> + 64 * g, q[g]);
    }
  }
}

// one block of a repacked tile (at tb) into registers: what unpack_lane_block makes from the file's rows
template <int64_t Q>
__attribute__((always_inline)) inline void load_lane_block(const uint8_t* tb, LaneBlock& o) {
  o.d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb)));
  if constexpr (Q == kQ4_1) o.m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb + 32)));
  const uint8_t* qb = tb + kLaneHead<Q>;
  if constexpr (Q == kQ8_0) {
    for (int g = 0; g < 8; ++g) o.wq[g] = _mm512_loadu_si512(qb + 64 * g);
  } else {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int g = 0; g < 4; ++g) {
      const __m512i nib = _mm512_loadu_si512(qb + 64 * g);
      o.wq[g] = _mm512_and_si512(nib, low4);
      o.wq[4 + g] = _mm512_and_si512(_mm512_srli_epi16(nib, 4), low4);
    }
  }
}

// a repacked tile (from `tile`) times R rows of x from r0: out[r * 16 + j], the same sums in the same
// order as tile_int8_lanes on the file's rows
template <int64_t Q, int R>
inline void tile_int8_repacked(const uint8_t* tile, const QuantizedX& x, int64_t r0, float* out) {
  constexpr int64_t step = kLaneRows * kBlockBytes<Q>;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.k / kBlock; ++b) {
    const uint8_t* tb = tile + b * step;
    // 16 blocks (4.5-8.5 KiB) ahead: 4 blocks ahead the 16-row product was 1.2-1.35x slower on a Zen 5; 32 the same
    for (int64_t at = 0; at < step; at += 64) _mm_prefetch(reinterpret_cast<const char*>(tb + 16 * step + at), _MM_HINT_T0);
    LaneBlock lb;
    load_lane_block<Q>(tb, lb);
    accumulate_lane_block<Q, R>(lb, x, r0, b, acc);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kLaneRows, acc[r]);
}
#endif

#if !defined(__AVX512F__)
// The int8 product of the AVX2 build in tiles of 8 weight rows, one per 32-bit lane, as the
// AVX-512 build's above but with vpmaddubsw + vpmaddwd (whether or not the CPU has AVX-VNNI): Q4's
// nibbles times x's bytes in pairs (at most 2 * 15 * 127 each, so four such sums add up in 16 bits)
// from -8 sum(qx) for Q4_0; Q8_0's as |q| times sign(qx, q). The integer sums are exact, so the
// result is the one-row path's up to the order of the float sums. Up to 16 rows of x a pass, each
// row's sum made whole and added to its accumulator in turn: 16 accumulators do not fit beside the
// block in the 16 ymm registers and live on the stack (a load and a store a row a block), which costs
// less than transposing each block again for every 4 rows (1.2-1.8x at 8 and 16 rows on a Zen 3).
constexpr int64_t kLaneRows = 8;

// the 8 rows' float16 at byte `at` of their block (the scale, or Q4_1's minimum) as floats
inline __m256 halves8(const uint8_t* blk, int64_t row_bytes, int64_t at) {
  alignas(16) uint16_t h[8];
  for (int i = 0; i < 8; ++i) std::memcpy(&h[i], blk + i * row_bytes + at, 2);
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h)));
}

// The repacked layout of this build (quant_repack; the AVX-512 build's, above, in 8 lanes): a tile's
// block is the 8 rows' float16 scales, Q4_1's 8 minimums, then the quants transposed as the tile
// takes them (Q8_0: 8 x 32 bytes, signed as in the file; Q4: 4 x 32 bytes of nibbles)
template <int64_t Q>
constexpr int64_t kLaneHead = repacked_head(kLaneRows, Q);

template <int64_t Q>
void repack_tile(const uint8_t* w, int64_t row_bytes, int64_t blocks, uint8_t* out) {
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = w + b * kBlockBytes<Q>;
    uint8_t* tb = out + b * kLaneRows * kBlockBytes<Q>;
    for (int i = 0; i < kLaneRows; ++i) {
      std::memcpy(tb + 2 * i, blk + i * row_bytes, 2);
      if constexpr (Q == kQ4_1) std::memcpy(tb + 2 * kLaneRows + 2 * i, blk + i * row_bytes + 2, 2);
    }
    __m256i q[8];
    if constexpr (Q == kQ8_0) {
      transpose8x16(blk + 2, row_bytes, q);
      transpose8x16(blk + 18, row_bytes, q + 4);
    } else {
      transpose8x16(blk + (Q == kQ4_1 ? 4 : 2), row_bytes, q);
    }
    for (int g = 0; g < (Q == kQ8_0 ? 8 : 4); ++g)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(tb + kLaneHead<Q> + 32 * g), q[g]);
  }
}

// 8 weight rows (from w: the file's rows, `row_bytes` apart, or with Repacked a repacked tile) times R
// rows of x (from row r0): out[r * 8 + j], the same sums either way
template <int64_t Q, int R, bool Repacked = false>
inline void tile_int8_lanes(const uint8_t* w, int64_t row_bytes, const QuantizedX& x, int64_t r0, float* out) {
  const int64_t blocks = x.k / kBlock, bb = kBlockBytes<Q>;
  const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 d, m;
    __m256i wq[8];
    if constexpr (Repacked) {
      constexpr int64_t step = kLaneRows * kBlockBytes<Q>;
      const uint8_t* tb = w + b * step;
      // 32 blocks (the AVX-512 tile's distance in bytes) ahead: 8 left one row of the 2048 x 8192 product 0.87x the file's
      for (int64_t at = 0; at < step; at += 64) _mm_prefetch(reinterpret_cast<const char*>(tb + 32 * step + at), _MM_HINT_T0);
      d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tb)));
      if constexpr (Q == kQ4_1) m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tb + 16)));
      const uint8_t* qb = tb + kLaneHead<Q>;
      if constexpr (Q == kQ8_0) {
        for (int g = 0; g < 8; ++g) wq[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 32 * g));
      } else {
        for (int g = 0; g < 4; ++g) {
          const __m256i nib = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 32 * g));
          wq[g] = _mm256_and_si256(nib, low4);
          wq[4 + g] = _mm256_and_si256(_mm256_srli_epi16(nib, 4), low4);
        }
      }
    } else {
      const uint8_t* blk = w + b * bb;
      prefetch_next_tile<kLaneRows>(blk, row_bytes);
      d = halves8(blk, row_bytes, 0);
      if constexpr (Q == kQ8_0) {
        transpose8x16(blk + 2, row_bytes, wq);
        transpose8x16(blk + 18, row_bytes, wq + 4);
      } else {
        __m256i nib[4];
        transpose8x16(blk + (Q == kQ4_1 ? 4 : 2), row_bytes, nib);
        for (int g = 0; g < 4; ++g) {
          wq[g] = _mm256_and_si256(nib[g], low4);
          wq[4 + g] = _mm256_and_si256(_mm256_srli_epi16(nib[g], 4), low4);
        }
      }
      if constexpr (Q == kQ4_1) m = halves8(blk, row_bytes, 2);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = r0 * blocks + b * R + r;  // x in panels of kLaneX rows, as in the AVX-512 tile
      const int32_t* xq = reinterpret_cast<const int32_t*>(x.q + i * kBlock);
      __m256i sum;
      if constexpr (Q == kQ8_0) {
        sum = _mm256_setzero_si256();
        for (int g = 0; g < 8; ++g) {
          const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(wq[g], wq[g]),
                                                 _mm256_sign_epi8(_mm256_set1_epi32(xq[g]), wq[g]));
          sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, ones));
        }
      } else {
        __m256i half16[2];
        for (int h = 0; h < 2; ++h) {
          half16[h] = _mm256_maddubs_epi16(wq[4 * h], _mm256_set1_epi32(xq[4 * h]));
          for (int g = 1; g < 4; ++g)
            half16[h] = _mm256_add_epi16(half16[h], _mm256_maddubs_epi16(wq[4 * h + g], _mm256_set1_epi32(xq[4 * h + g])));
        }
        sum = _mm256_add_epi32(_mm256_madd_epi16(half16[0], ones), _mm256_madd_epi16(half16[1], ones));
        if constexpr (Q == kQ4_0) sum = _mm256_add_epi32(sum, _mm256_set1_epi32(-8 * x.sq[i]));
      }
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(x.d[i])), acc[r]);
      if constexpr (Q == kQ4_1) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.s[i]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * kLaneRows, acc[r]);
}

template <int64_t Q, int R>
inline void tile_int8_repacked(const uint8_t* tile, const QuantizedX& x, int64_t r0, float* out) {
  tile_int8_lanes<Q, R, true>(tile, 0, x, r0, out);
}

#define CB_INT8_LANES 1
#elif CB_VNNI
#define CB_INT8_LANES 1
#else
#define CB_INT8_LANES 0
#endif
#if defined(__AVX512F__)
constexpr bool defined_avx512 = true;
#else
constexpr bool defined_avx512 = false;
#endif
#define CB_REPACKED CB_INT8_LANES  // the builds with int8 tiles multiply weights repacked for them
#if CB_REPACKED
constexpr int64_t kRepackRows = kLaneRows;  // rows a repacked tile: 16 (AVX512-VNNI) or 8 (AVX2)
constexpr uint8_t kRepackQ8Bias = defined_avx512 ? 0x80 : 0;  // Q8_0's quants stored as q + 128 (VNNI) or q
#else
constexpr int64_t kRepackRows = 16;  // none are made by this build
constexpr uint8_t kRepackQ8Bias = 0x80;
#endif

#if CB_INT8_LANES
constexpr int64_t kLaneX = kXPanel;  // rows of x per pass over a tile (a decode step of 16 users: one pass)

// a repacked tile for `rows` (1 to kLaneX) rows of x, whichever build's tile_int8_repacked above
template <int64_t Q, int R = 1>
void tile_int8_repacked_any(int64_t rows, const uint8_t* tile, const QuantizedX& x, int64_t r0, float* out) {
  if constexpr (R < kLaneX) {
    if (rows > R) return tile_int8_repacked_any<Q, R + 1>(rows, tile, x, r0, out);
  }
  tile_int8_repacked<Q, R>(tile, x, r0, out);
}

// the tile for `rows` (1 to kLaneX) rows of x, whichever build's tile_int8_lanes above
template <int64_t Q>
void tile_int8_lanes_any(int64_t rows, const uint8_t* w, int64_t row_bytes, const QuantizedX& x, int64_t r0, float* out) {
  switch (rows) {
    case 1: return tile_int8_lanes<Q, 1>(w, row_bytes, x, r0, out);
    case 2: return tile_int8_lanes<Q, 2>(w, row_bytes, x, r0, out);
    case 3: return tile_int8_lanes<Q, 3>(w, row_bytes, x, r0, out);
    case 4: return tile_int8_lanes<Q, 4>(w, row_bytes, x, r0, out);
    case 5: return tile_int8_lanes<Q, 5>(w, row_bytes, x, r0, out);
    case 6: return tile_int8_lanes<Q, 6>(w, row_bytes, x, r0, out);
    case 7: return tile_int8_lanes<Q, 7>(w, row_bytes, x, r0, out);
    case 8: return tile_int8_lanes<Q, 8>(w, row_bytes, x, r0, out);
    case 9: return tile_int8_lanes<Q, 9>(w, row_bytes, x, r0, out);
    case 10: return tile_int8_lanes<Q, 10>(w, row_bytes, x, r0, out);
    case 11: return tile_int8_lanes<Q, 11>(w, row_bytes, x, r0, out);
    case 12: return tile_int8_lanes<Q, 12>(w, row_bytes, x, r0, out);
    case 13: return tile_int8_lanes<Q, 13>(w, row_bytes, x, r0, out);
    case 14: return tile_int8_lanes<Q, 14>(w, row_bytes, x, r0, out);
    case 15: return tile_int8_lanes<Q, 15>(w, row_bytes, x, r0, out);
    default: return tile_int8_lanes<Q, 16>(w, row_bytes, x, r0, out);
  }
}

#if defined(__AVX512F__) && CB_VNNI
constexpr bool kUnpackTiles = true;  // more than kLaneX rows of x: each tile unpacked once for all passes
template <int64_t Q, int R = 1>
void tile_int8_unpacked_any(int64_t rows, const LaneBlock* unpacked, const QuantizedX& x, int64_t r0, float* out) {
  if constexpr (R < kLaneX) {
    if (rows > R) return tile_int8_unpacked_any<Q, R + 1>(rows, unpacked, x, r0, out);
  }
  tile_int8_unpacked<Q, R>(unpacked, x, r0, out);
}
#else
constexpr bool kUnpackTiles = false;
struct LaneBlock {};
template <int64_t Q>
void unpack_tile_int8(const uint8_t*, int64_t, int64_t, LaneBlock*) {}
template <int64_t Q>
void tile_int8_unpacked_any(int64_t, const LaneBlock*, const QuantizedX&, int64_t, float*) {}
#endif
#endif

// x (float rows `xf`, or int8 blocks `x` when xf is null) times the weight rows
template <int64_t Q, bool VNNI, typename T>
void product(const QuantizedX& x, const float* xf, const uint8_t* w, int64_t row_bytes, const T* bias, T* y,
             int64_t m, int64_t n, bool repacked) {
  // the int8 tiles: AVX-512 with VNNI on; AVX2 always
  TORCH_CHECK(!repacked || (CB_REPACKED && !xf && (VNNI || !defined_avx512)), "quant_linear: a weight repacked for "
              "the int8 tiles (quant_repack) is multiplied by int8 x with VNNI on, not ",
              xf ? "float x" : "with VNNI off");
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(64, n / (4 * threads)));
#if defined(__AVX512F__)
  if (xf) {  // 512-bit float product: tiles of kTileN weight rows by kRows rows of x
    at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
      float out[kRows * kTileN];
      // more than one group of rows: the tile's weights dequantized once, read by every group
      std::vector<float> buffer(m > kRows ? kTileN * x.k : 0);
      float* wf = m > kRows ? buffer.data() : nullptr;
      for (int64_t j0 = n0; j0 < n1; j0 += kTileN) {
        const int64_t nj = std::min(kTileN, n1 - j0);
        if (wf) dequantize_tile16<Q>(w + j0 * row_bytes, row_bytes, nj, x.k, wf);
        for (int64_t r0 = 0; r0 < m; r0 += kRows) {
          const int64_t rows = std::min(kRows, m - r0);
          tile_float16_any<Q>(rows, nj, w + j0 * row_bytes, row_bytes, wf, xf, x.k, r0, out);
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < nj; ++j)
              y[(r0 + r) * n + j0 + j] = static_cast<T>(out[r * nj + j] + (bias ? static_cast<float>(bias[j0 + j]) : 0.0f));
        }
      }
    });
    return;
  }
#endif
#if CB_INT8_LANES
  // AVX-512: with VNNI on; AVX2: always. Tiles of kLaneRows weight rows; the last rows one by one below
  if (!xf && (VNNI || !defined_avx512)) {
    const int64_t tiles = n / kLaneRows;
    at::parallel_for(0, tiles, std::max<int64_t>(1, grain / kLaneRows), [&](int64_t t0, int64_t t1) {
      float out[kLaneX * kLaneRows];
      std::vector<LaneBlock> unpacked(kUnpackTiles && m > kLaneX && !repacked ? x.k / kBlock : 0);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t j0 = t * kLaneRows;
        if (!unpacked.empty()) unpack_tile_int8<Q>(w + j0 * row_bytes, row_bytes, x.k / kBlock, unpacked.data());
        for (int64_t r0 = 0; r0 < m; r0 += kLaneX) {
          const int64_t rows = std::min(kLaneX, m - r0);
          if (repacked) tile_int8_repacked_any<Q>(rows, w + j0 * row_bytes, x, r0, out);
          else if (!unpacked.empty()) tile_int8_unpacked_any<Q>(rows, unpacked.data(), x, r0, out);
          else tile_int8_lanes_any<Q>(rows, w + j0 * row_bytes, row_bytes, x, r0, out);
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < kLaneRows; ++j)
              y[(r0 + r) * n + j0 + j] =
                  static_cast<T>(out[r * kLaneRows + j] + (bias ? static_cast<float>(bias[j0 + j]) : 0.0f));
        }
      }
    });
    if (tiles * kLaneRows == n) return;
    w += tiles * kLaneRows * row_bytes, y += tiles * kLaneRows, bias = bias ? bias + tiles * kLaneRows : nullptr;
    const int64_t n_all = n;
    n -= tiles * kLaneRows;
    for (int64_t j = 0; j < n; ++j) {
      float out[kRows];
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int64_t rows = std::min(kRows, m - r0);
        dot_rows_any<Q, VNNI>(rows, w + j * row_bytes, x, r0, out);
        for (int64_t r = 0; r < rows; ++r)
          y[(r0 + r) * n_all + j] = static_cast<T>(out[r] + (bias ? static_cast<float>(bias[j]) : 0.0f));
      }
    }
    return;
  }
#endif
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    float out[kRows];
    for (int64_t j = n0; j < n1; ++j) {
      const uint8_t* wr = w + j * row_bytes;
      const float b = bias ? static_cast<float>(bias[j]) : 0.0f;
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int64_t rows = std::min(kRows, m - r0);
        if (xf) dot_rows_float_any<Q>(rows, wr, xf, x.k, r0, out);
        else dot_rows_any<Q, VNNI>(rows, wr, x, r0, out);
        for (int64_t r = 0; r < rows; ++r) y[(r0 + r) * n + j] = static_cast<T>(out[r] + b);
      }
    }
  });
}

template <int64_t Q, typename T>
void product_isa(const QuantizedX& x, const float* xf, const uint8_t* w, int64_t row_bytes, const T* bias, T* y,
                 int64_t m, int64_t n, bool repacked) {
#if CB_VNNI
  if (!xf && g_vnni.load(std::memory_order_relaxed)) return product<Q, true>(x, xf, w, row_bytes, bias, y, m, n, repacked);
#endif
  product<Q, false>(x, xf, w, row_bytes, bias, y, m, n, repacked);
}

template <typename T>
void dequantize_row(const uint8_t* w, int64_t qtype, int64_t k, T* out) {
  const int64_t bb = block_bytes(qtype);
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const uint8_t* blk = w + b * bb;
    const float d = half(blk);
    T* o = out + b * kBlock;
    if (qtype == kQ8_0) {
      for (int64_t i = 0; i < kBlock; ++i) o[i] = static_cast<T>(d * static_cast<float>(static_cast<int8_t>(blk[2 + i])));
    } else {
      const uint8_t* nib = blk + (qtype == kQ4_1 ? 4 : 2);
      const float m = qtype == kQ4_1 ? half(blk + 2) : -8.0f * d;
      for (int64_t i = 0; i < 16; ++i) {
        o[i] = static_cast<T>(static_cast<float>(nib[i] & 0x0f) * d + m);
        o[i + 16] = static_cast<T>(static_cast<float>(nib[i] >> 4) * d + m);
      }
    }
  }
}

// the tile or the row that row j of a repacked weight (n rows) is in, and its lane there (-1: a row
// after the last full tile, as the file has it)
inline int64_t repacked_lane(int64_t j, int64_t n) { return j < n / kRepackRows * kRepackRows ? j % kRepackRows : -1; }

// row j of a repacked weight, as dequantize_row reads a row of the file
template <typename T>
void dequantize_repacked_row(const uint8_t* w, int64_t row_bytes, int64_t n, int64_t j, int64_t qtype, int64_t k,
                             T* out) {
  constexpr int64_t L = kRepackRows;
  const int64_t lane = repacked_lane(j, n), bb = block_bytes(qtype);
  const uint8_t* tile = w + (j - lane) * row_bytes;
  const int64_t head = repacked_head(L, qtype), nq = qtype == kQ8_0 ? 32 : 16;
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const uint8_t* tb = tile + b * L * bb;
    uint8_t blk[34];  // the file's block of row j: scale, Q4_1's minimum, quants (byte i: word i / 4, lane)
    std::memcpy(blk, tb + 2 * lane, 2);
    if (qtype == kQ4_1) std::memcpy(blk + 2, tb + 2 * L + 2 * lane, 2);
    uint8_t* q = blk + (qtype == kQ4_1 ? 4 : 2);
    for (int64_t i = 0; i < nq; ++i) {
      const uint8_t v = tb[head + 4 * L * (i / 4) + 4 * lane + i % 4];
      q[i] = qtype == kQ8_0 ? v ^ kRepackQ8Bias : v;
    }
    dequantize_row(blk, qtype, kBlock, out + b * kBlock);
  }
}

void check_weight(const at::Tensor& w, int64_t qtype, int64_t k) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.device().is_cpu() && w.is_contiguous(),
              "quantized linear: the weight must be a contiguous uint8 CPU tensor [rows, row bytes]");
  TORCH_CHECK(k % kBlock == 0 && w.size(1) == k / kBlock * block_bytes(qtype),
              "quantized linear: ", w.size(1), " bytes a row do not hold ", k, " weights of type ", qtype);
}

}  // namespace

// x [M, K] (float32, bfloat16 or float16) times the quantized weight w [N, row bytes] of ggml type
// `qtype`, plus `bias` (or None): [M, N] in x's dtype. `int8`: x quantized to int8 blocks and
// integer dot products; else x in float32 against the dequantized blocks
at::Tensor quant_linear(at::Tensor x, at::Tensor w, int64_t type, c10::optional<at::Tensor> bias, bool int8) {
  TORCH_CHECK(x.dim() == 2, "quant_linear: x [M, K] expected");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  bool repacked;
  const int64_t qtype = base_type(type, repacked);
  check_weight(w, qtype, k);
  auto xf = x.to(at::kFloat).contiguous();
  const QuantizedRows rows = quantize_rows(xf, int8, kXPanel);
  const QuantizedX& qx = rows.view;
  const float* xfp = int8 ? nullptr : xf.data_ptr<float>();
  auto y = at::empty({m, n}, x.options());
  at::Tensor b = bias.has_value() ? bias->to(x.scalar_type()).contiguous() : at::Tensor();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  for_each_float_type(x, "quant_linear", [&](auto zero) {
    using T = decltype(zero);
    const T* bp = b.defined() ? b.data_ptr<T>() : nullptr;
    T* yp = y.data_ptr<T>();
    switch (qtype) {
      case kQ8_0: return product_isa<kQ8_0, T>(qx, xfp, wp, row_bytes, bp, yp, m, n, repacked);
      case kQ4_0: return product_isa<kQ4_0, T>(qx, xfp, wp, row_bytes, bp, yp, m, n, repacked);
      case kQ4_1: return product_isa<kQ4_1, T>(qx, xfp, wp, row_bytes, bp, yp, m, n, repacked);
    }
  });
  return y;
}

// the rows `rows` (int64 [R], or all when None) of w [N, row bytes] as [R, k] in `like`'s dtype
at::Tensor quant_dequantize(at::Tensor w, int64_t type, int64_t k, c10::optional<at::Tensor> rows, at::Tensor like) {
  bool repacked;
  const int64_t qtype = base_type(type, repacked);
  check_weight(w, qtype, k);
  TORCH_CHECK(!repacked || CB_REPACKED, "quant_dequantize: this build makes no repacked weights (no int8 tiles)");
  at::Tensor idx = rows.has_value() ? rows->to(at::kLong).contiguous() : at::Tensor();
  const int64_t r = idx.defined() ? idx.numel() : w.size(0), n = w.size(0), row_bytes = w.size(1);
  if (idx.defined() && r > 0) {
    TORCH_CHECK(idx.min().item<int64_t>() >= 0 && idx.max().item<int64_t>() < n, "quant_dequantize: a row out of range");
  }
  auto out = at::empty({r, k}, like.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  for_each_float_type(out, "quant_dequantize", [&](auto zero) {
    using T = decltype(zero);
    T* op = out.data_ptr<T>();
    at::parallel_for(0, r, 8, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t j = idx.defined() ? idx.data_ptr<int64_t>()[i] : i;
        if (repacked && repacked_lane(j, n) >= 0) dequantize_repacked_row(wp, row_bytes, n, j, qtype, k, op + i * k);
        else dequantize_row(wp + j * row_bytes, qtype, k, op + i * k);
      }
    });
  });
  return out;
}

// whether this build has VNNI's byte dot products; `on` turns them on or off (off: vpmaddubsw),
// returning the previous state
bool quant_vnni_available() { return CB_VNNI != 0; }

// the rows of a tile this build's int8 tiles read repacked (quant_repack): 16 (AVX512-VNNI), 8 (AVX2),
// 0 (AVX-512 without VNNI: no tiles, no repacking)
int64_t quant_repack_rows() { return CB_REPACKED ? kRepackRows : 0; }

// w [N, row bytes] of ggml type `qtype` with its full tiles of rows repacked for this build's int8
// tiles (a new tensor of the same shape; multiply it as type qtype + 256 with int8 x)
at::Tensor kquant_repack(at::Tensor w, int64_t qtype, int64_t k);  // kquant_cpu.cpp: Q4_K, Q6_K

at::Tensor quant_repack(at::Tensor w, int64_t qtype, int64_t k) {
  if (qtype == 12 || qtype == 14) return kquant_repack(w, qtype, k);  // ggml's Q4_K, Q6_K
  check_weight(w, qtype, k);
  TORCH_CHECK(CB_REPACKED, "quant_repack: this build has no int8 tiles (AVX-512 without VNNI)");
  at::Tensor out = w.clone();
#if CB_REPACKED
  const int64_t row_bytes = w.size(1), tiles = w.size(0) / kLaneRows;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t at = t * kLaneRows * row_bytes;
      switch (qtype) {
        case kQ8_0: repack_tile<kQ8_0>(wp + at, row_bytes, k / kBlock, op + at); break;
        case kQ4_0: repack_tile<kQ4_0>(wp + at, row_bytes, k / kBlock, op + at); break;
        case kQ4_1: repack_tile<kQ4_1>(wp + at, row_bytes, k / kBlock, op + at); break;
      }
    }
  });
#endif
  return out;
}
bool cbserve::quant_vnni_on() { return g_vnni.load(std::memory_order_relaxed); }
bool set_quant_vnni(bool on) { return g_vnni.exchange(on && CB_VNNI != 0); }
