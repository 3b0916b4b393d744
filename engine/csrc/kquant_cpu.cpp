// Linear layers on GGUF K-quant weights, multiplied in their super-blocks: Q4_K and Q6_K.
//
// A weight row is the file's bytes, unchanged (but with int8 inputs: repacked, below at KX):
// super-blocks of 256 weights.
//   Q4_K (144 bytes, 4.5 bits a weight): float16 d and dmin, 12 bytes holding eight 6-bit scales
//     sc_j and eight 6-bit minimums m_j (one per sub-block of 32), then 128 bytes of nibbles. Each
//     64 weights share 32 bytes: the low nibbles are sub-block 2i, the high ones sub-block 2i+1.
//     w = d sc_j q - dmin m_j.
//   Q6_K (210 bytes, 6.56 bits a weight): 128 bytes of low nibbles, 64 bytes of high bit pairs,
//     sixteen int8 scales (one per 16 weights), float16 d. Each 128 weights take 64 low-nibble
//     bytes and 32 high-bit bytes: for l < 32 the four weights l, l+32, l+64, l+96 are ql[l] & 15,
//     ql[l+32] & 15, ql[l] >> 4, ql[l+32] >> 4, each with its own two bits of qh[l] on top.
//     w = d sc (q - 32).
// The layouts are ggml's (ggml-common.h); gguf-py's dequantize is the tests' reference.
//
// The product keeps x in float32 against the dequantized weights (the reference's values: the same
// float operations in the same order), so the result is x times the dequantized weight up to the
// order of the float sums. For up to four rows of x (decode steps) the weights are dequantized in
// registers, a vector at a time, straight into the FMAs; for more, the super-blocks of four weight
// rows at a time are dequantized into 256 floats each on the stack and multiplied into every row of
// x (each slice of x read once for the four). Both keep
// the same sums in the same order, so a row's result takes the same steps whatever the batch.
// Work is split over output rows. Prompt steps (many rows of x) dequantize the whole weight instead
// and run torch's product (engine/backends/cpu_quant.py decides).
//
// The other product (`int8`, llama.cpp's way, as quant_cpu.cpp's for Q8_0/Q4_0/Q4_1) quantizes each
// row of x to int8 blocks of 32 (int8_lanes.h) and takes exact integer dot products of the unsigned
// quants with them, a block (Q4_K: one sub-block; Q6_K: two groups of 16) at a time, then scales:
//   Q4_K, sub-block j:  d sc_j dx sum(q qx) - dmin m_j dx sum(qx)
//   Q6_K, group g of 16: d sc_g dx (sum(q qx) - 32 sum(qx))        (q = the 6-bit value, 0..63)
// Weight rows go in tiles of 16 (AVX-512 with VNNI: vpdpbusd) or 8 (vpmaddubsw + vpmaddwd: the AVX2
// build, and the AVX-512 one with VNNI off), one per 32-bit lane, the super-block's bytes transposed
// in registers (or, repacked at load, loaded as they lie) and its scales unpacked for all the tile's
// rows at once from transposed words; each row
// of x multiplies the whole tile with its 4-byte groups broadcast; a tile is compiled for each count of
// rows of x (1 to 16), so its accumulators and loops stay in registers (1.3x at one row of x against
// a run-time count, on a Zen 3; docs/engine.md). The last rows of a weight that
// are not a whole tile go through the same code on a copy padded to a tile, so a row's result is the
// same wherever it is. Its results differ from the float product by x's rounding to 8 bits.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include "int8_lanes.h"
#include "vec.h"

#include <immintrin.h>

#include <algorithm>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace cbserve;

constexpr int64_t kSuper = 256;
enum KType : int64_t { kQ4_K = 12, kQ6_K = 14 };  // ggml's type numbers

int64_t super_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_K: return 144;
    case kQ6_K: return 210;
  }
  TORCH_CHECK(false, "K-quant linear: type ", qtype, " is not Q4_K (12) or Q6_K (14)");
}

inline float half_at(const uint8_t* p) {  // F16C's conversion (x86-64-v3 and up): exact, as c10::Half's
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// sub-block j's 6-bit scale and minimum from Q4_K's 12 packed bytes
inline void scale_min(int j, const uint8_t* s, int32_t& sc, int32_t& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// A super-block's scales as floats: Q4_K d sc_j and dmin m_j for its eight sub-blocks of 32; Q6_K
// d sc for its sixteen groups of 16
struct Scales {
  float d[16];
  float m[8];
};

void prepare_q4_k(const uint8_t* b, Scales& s) {
  const float d = half_at(b), dmin = half_at(b + 2);
  for (int j = 0; j < 8; ++j) {
    int32_t sc, m;
    scale_min(j, b + 4, sc, m);
    s.d[j] = d * static_cast<float>(sc);
    s.m[j] = dmin * static_cast<float>(m);
  }
}

void prepare_q6_k(const uint8_t* b, Scales& s) {
  const float d = half_at(b + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  for (int g = 0; g < 16; ++g) s.d[g] = d * static_cast<float>(sc[g]);
}

// kLanes bytes, each widened to a lane (an intrinsic: GCC 12 widens a byte vector lane by lane)
inline vint load_bytes(const uint8_t* p) {
#if defined(__AVX512F__)
  return (vint)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return (vint)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#endif
}

// A super-block's weights dequantized in registers, kLanes at a time: f(o, w) for the vector w of
// the weights at offset o. Every path (the product's, the dequantization's) takes its weights from
// here, so they are the same floats everywhere. Q4_K's d sc q - dmin m rounds the product before
// the subtraction, as gguf-py's float32 arithmetic does (the empty asm keeps the compiler from fusing
// the two). Each accumulator (o / kLanes) % 4 sees its offsets in increasing order.
template <typename F>
inline void q4_k_chunks(const uint8_t* b, const Scales& s, F&& f) {
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // 64 weights: sub-block 2i in the low nibbles of 32 bytes, 2i + 1 in the high
#pragma GCC unroll 4
    for (int l = 0; l < 32; l += kLanes) {
      const vint bytes = load_bytes(b + 16 + 32 * i + l);
      vfloat lo = __builtin_convertvector(bytes & 15, vfloat) * s.d[2 * i];
      vfloat hi = __builtin_convertvector(bytes >> 4, vfloat) * s.d[2 * i + 1];
      CB_KEEP_IN_REGISTER(lo);
      CB_KEEP_IN_REGISTER(hi);
      f(64 * i + l, lo - s.m[2 * i]);
      f(64 * i + 32 + l, hi - s.m[2 * i + 1]);
    }
  }
}

// Q6_K: in each half of 128 weights, quarter c takes the low (c < 2) or high nibbles of ql[l] (c
// even) or ql[l + 32] (c odd), and bits 2c, 2c + 1 of qh[l] on top; one scale per 16 values of l
template <typename F>
inline void q6_k_chunks(const uint8_t* b, const Scales& s, F&& f) {
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 4
    for (int l = 0; l < 32; l += kLanes) {
      const vint low0 = load_bytes(b + 64 * h + l), low1 = load_bytes(b + 64 * h + 32 + l);
      const vint high = load_bytes(b + 128 + 32 * h + l);
      const float* sc = s.d + 8 * h + l / 16;
      f(128 * h + l, __builtin_convertvector(((low0 & 15) | ((high & 3) << 4)) - 32, vfloat) * sc[0]);
      f(128 * h + 32 + l, __builtin_convertvector(((low1 & 15) | (((high >> 2) & 3) << 4)) - 32, vfloat) * sc[2]);
      f(128 * h + 64 + l, __builtin_convertvector(((low0 >> 4) | (((high >> 4) & 3) << 4)) - 32, vfloat) * sc[4]);
      f(128 * h + 96 + l, __builtin_convertvector(((low1 >> 4) | (((high >> 6) & 3) << 4)) - 32, vfloat) * sc[6]);
    }
  }
}

template <int64_t Q>
inline void prepare(const uint8_t* b, Scales& s) {
  if constexpr (Q == kQ4_K) {
    prepare_q4_k(b, s);
  } else {
    prepare_q6_k(b, s);
  }
}

template <int64_t Q, typename F>
inline void chunks(const uint8_t* b, const Scales& s, F&& f) {
  if constexpr (Q == kQ4_K) {
    q4_k_chunks(b, s, f);
  } else {
    q6_k_chunks(b, s, f);
  }
}

template <int64_t Q>
void dequantize_super(const uint8_t* b, float* out) {
  Scales s;
  prepare<Q>(b, s);
  chunks<Q>(b, s, [&](int64_t o, vfloat w) { store(out + o, w); });
}

inline void dequantize_super(int64_t qtype, const uint8_t* b, float* out) {
  if (qtype == kQ4_K) {
    dequantize_super<kQ4_K>(b, out);
  } else {
    dequantize_super<kQ6_K>(b, out);
  }
}

// 256 weights against 256 floats of x, into four accumulators: the weights at offset o go to
// accumulator (o / kLanes) % 4, in increasing o (a fixed order: the same for a row alone and in a batch)
inline void dot_super(const float* w, const float* x, vfloat acc[4]) {
  for (int64_t i = 0; i < kSuper; i += 4 * kLanes) {
    for (int a = 0; a < 4; ++a) acc[a] += load(w + i + a * kLanes) * load(x + i + a * kLanes);
  }
}

constexpr int kTileRows = 4;

// dot_super for kTileRows weight rows at once against one slice of x: acc[4 u + a] is weight row u's
// accumulator a, with the same sums in the same order as dot_super's
inline void dot_tile(const float (*tile)[kSuper], const float* x, vfloat* acc) {
  vfloat a[4 * kTileRows];
  for (int e = 0; e < 4 * kTileRows; ++e) a[e] = acc[e];
  for (int64_t i = 0; i < kSuper; i += 4 * kLanes) {
    for (int c = 0; c < 4; ++c) {
      const vfloat xv = load(x + i + c * kLanes);
      for (int u = 0; u < kTileRows; ++u) a[4 * u + c] += load(tile[u] + i + c * kLanes) * xv;
    }
  }
  for (int e = 0; e < 4 * kTileRows; ++e) acc[e] = a[e];
}

// Weight rows [j0, j1) against R rows of x (R <= 4): each super-block's weights are dequantized in
// registers and multiplied into R x 4 accumulators that stay in registers, the same sums in the same
// order as dot_super's on a dequantized buffer
template <int64_t Q, int R>
void rows_in_registers(const uint8_t* wp, int64_t row_bytes, const float* xp, int64_t k, const float* bp,
                       float* yp, int64_t n, int64_t j0, int64_t j1) {
  constexpr int64_t sb = Q == kQ4_K ? 144 : 210;
  for (int64_t j = j0; j < j1; ++j) {
    vfloat acc[4 * R] = {};
    const uint8_t* row = wp + j * row_bytes;
    for (int64_t sup = 0; sup < k / kSuper; ++sup) {
      const uint8_t* b = row + sup * sb;
      Scales s;
      prepare<Q>(b, s);
      const float* x = xp + sup * kSuper;
      chunks<Q>(b, s, [&](int64_t o, vfloat w) {
        const int64_t a = (o / kLanes) % 4;
        for (int r = 0; r < R; ++r) acc[4 * r + a] += w * load(x + r * k + o);
      });
    }
    for (int r = 0; r < R; ++r) {
      const vfloat* a = &acc[4 * r];
      yp[r * n + j] = hsum((a[0] + a[1]) + (a[2] + a[3])) + (bp ? bp[j] : 0.0f);
    }
  }
}

template <int64_t Q>
void few_rows(int64_t m, const uint8_t* wp, int64_t row_bytes, const float* xp, int64_t k, const float* bp,
              float* yp, int64_t n, int64_t j0, int64_t j1) {
  switch (m) {
    case 1: rows_in_registers<Q, 1>(wp, row_bytes, xp, k, bp, yp, n, j0, j1); break;
    case 2: rows_in_registers<Q, 2>(wp, row_bytes, xp, k, bp, yp, n, j0, j1); break;
    case 3: rows_in_registers<Q, 3>(wp, row_bytes, xp, k, bp, yp, n, j0, j1); break;
    default: rows_in_registers<Q, 4>(wp, row_bytes, xp, k, bp, yp, n, j0, j1); break;
  }
}

// ---- int8 inputs: tiles of weight rows in lanes ----

// Every cache line of [p, p + bytes), from the line p starts in: a super-block (144 or 210 bytes) starts
// anywhere in a line, and steps of 64 from p miss the last line of a third of them, whose gathers and
// transposes then wait on memory for the whole tile (a counted loop from the aligned line measured
// faster than the same prefetches unrolled: 1B Q4_K_M decode step 22.5 -> 20.5 ms at 1 row, 63 -> 54
// at 16, Zen 5)
inline void prefetch_span(const uint8_t* p, int64_t bytes) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
  for (uintptr_t a = first; a < reinterpret_cast<uintptr_t>(p) + bytes; a += 64)
    _mm_prefetch(reinterpret_cast<const char*>(a), _MM_HINT_T0);
}

// The next tile's super-block of a row: every line for the 16-row tiles (AVX512-VNNI); the 8-row tiles
// keep steps of 64 from its start, which measured faster for them (Zen 5, avx2 build: the whole span
// took 15-18% longer at 16 rows of Q6_K)
template <class L>
inline void prefetch_super(const uint8_t* p, int64_t bytes) {
  if constexpr (L::n == 16) {
    prefetch_span(p, bytes);
  } else {
    for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(reinterpret_cast<const char*>(p + c), _MM_HINT_T0);
  }
}

constexpr int64_t kInt8X = 16;  // rows of x per pass over a tile (the tiles' accumulators hold 16)

// 8 weight rows a tile, 256-bit, vpmaddubsw + vpmaddwd (q <= 63 and |qx| <= 127: a pair's sum fits
// in 16 bits)
struct Lanes8 {
  using vi = __m256i;
  using vf = __m256;
  static constexpr int64_t n = 8;
  static constexpr int group = 4;  // rows of x whose sums are built side by side (16 ymm registers)
  static vi offsets(int64_t row_bytes) {
    return _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int32_t>(row_bytes)));
  }
  static vi gather(vi offs, const uint8_t* p) { return _mm256_i32gather_epi32(reinterpret_cast<const int*>(p), offs, 1); }
  static void transpose(const uint8_t* base, int64_t row_bytes, vi out[4]) { transpose8x16(base, row_bytes, out); }
  static vi load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static vf load_halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static vf halves(vi words) {  // the float16 in each lane's low 16 bits
    const vi low = _mm256_and_si256(words, _mm256_set1_epi32(0xffff));
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1)));
  }
  static vi dp(vi acc, vi w, int32_t x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_set1_epi32(x)), _mm256_set1_epi16(1)));
  }
  // acc plus C groups' products (w[0..C) against x's words x[0..C)) added in 16 bits first, then
  // widened once: the caller's C keeps C pair sums of q <= q_max against |qx| <= 127 within 16 bits
  template <int C>
  static vi dp_n(vi acc, const vi* w, const int32_t* x) {
    vi s = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(x[0]));
    for (int c = 1; c < C; ++c) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[c], _mm256_set1_epi32(x[c])));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(s, _mm256_set1_epi16(1)));
  }
  static vi set1(int32_t v) { return _mm256_set1_epi32(v); }
  static vi and_(vi a, int32_t m) { return _mm256_and_si256(a, _mm256_set1_epi32(m)); }
  static vi or_(vi a, vi b) { return _mm256_or_si256(a, b); }
  static vi bytes(vi a, uint8_t m) { return _mm256_and_si256(a, _mm256_set1_epi8(static_cast<char>(m))); }
  static vi srl16(vi a, int c) { return _mm256_srli_epi16(a, c); }
  static vi sll16(vi a, int c) { return _mm256_slli_epi16(a, c); }
  static vi srl32(vi a, int c) { return _mm256_srli_epi32(a, c); }
  static vi sll32(vi a, int c) { return _mm256_slli_epi32(a, c); }
  static vi sra32(vi a, int c) { return _mm256_srai_epi32(a, c); }
  static vf cvt(vi a) { return _mm256_cvtepi32_ps(a); }
  static vf set1f(float v) { return _mm256_set1_ps(v); }
  static vf zerof() { return _mm256_setzero_ps(); }
  static vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
  static vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
  static vf fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
  static void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
};

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define CB_KQUANT_VNNI 1
// 16 weight rows a tile, 512-bit, vpdpbusd
struct Lanes16 {
  using vi = __m512i;
  using vf = __m512;
  static constexpr int64_t n = 16;
  static constexpr int group = 8;
  static vi offsets(int64_t row_bytes) {
    return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                              _mm512_set1_epi32(static_cast<int32_t>(row_bytes)));
  }
  static vi gather(vi offs, const uint8_t* p) { return _mm512_i32gather_epi32(offs, p, 1); }
  static void transpose(const uint8_t* base, int64_t row_bytes, vi out[4]) { transpose16x16(base, row_bytes, out); }
  static vi load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static vf load_halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static vf halves(vi words) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words)); }
  static vi dp(vi acc, vi w, int32_t x) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x)); }
  template <int C>
  static vi dp_n(vi acc, const vi* w, const int32_t* x) {  // vpdpbusd sums in 32 bits: C does not matter
    for (int c = 0; c < C; ++c) acc = dp(acc, w[c], x[c]);
    return acc;
  }
  static vi set1(int32_t v) { return _mm512_set1_epi32(v); }
  static vi and_(vi a, int32_t m) { return _mm512_and_si512(a, _mm512_set1_epi32(m)); }
  static vi or_(vi a, vi b) { return _mm512_or_si512(a, b); }
  static vi bytes(vi a, uint8_t m) { return _mm512_and_si512(a, _mm512_set1_epi8(static_cast<char>(m))); }
  static vi srl16(vi a, int c) { return _mm512_srli_epi16(a, c); }
  static vi sll16(vi a, int c) { return _mm512_slli_epi16(a, c); }
  static vi srl32(vi a, int c) { return _mm512_srli_epi32(a, c); }
  static vi sll32(vi a, int c) { return _mm512_slli_epi32(a, c); }
  static vi sra32(vi a, int c) { return _mm512_srai_epi32(a, c); }
  static vf cvt(vi a) { return _mm512_cvtepi32_ps(a); }
  static vf set1f(float v) { return _mm512_set1_ps(v); }
  static vf zerof() { return _mm512_setzero_ps(); }
  static vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
  static vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
  static vf fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
  static void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
};
#else
#define CB_KQUANT_VNNI 0
#endif

// x's int8 rows in panels of kInt8X rows (int8_lanes.h: a pass's rows), and for Q6_K the sums of each
// half block of 16 in the same order (sq16 [m * k / 32, 2])
struct KX {
  QuantizedX x;
  const int32_t* sq16;
};

// A repacked weight (kquant_repack, made once at load for the int8 tiles, as quant_cpu.cpp's
// quant_repack does for Q8_0/Q4_0/Q4_1): each full tile of L::n rows keeps its bytes where they were,
// super-block by super-block, each super-block's 4-byte words in word-major order (word w of lane r at
// 4 (w L::n + r)) and Q6_K's last two bytes (its d) after them, 2 a lane: what the tiles otherwise make
// with a transpose per 16 bytes is a plain load, and a tile's bytes are one stream. Same size; the
// rows after the last full tile stay as the file has them.
inline int64_t repacked_words(int64_t sb) { return sb / 4; }

// The 16 bytes at `off` of each of the tile's rows, four words a lane (out[g]: bytes off + 4g..4g+3):
// transposed from the file's rows (`b` the first row's super-block, `row_bytes` apart), or with
// Repacked loaded as they lie (`b` the tile's super-block)
template <class L, bool Repacked>
inline void words(const uint8_t* b, int64_t off, int64_t row_bytes, typename L::vi out[4]) {
  if constexpr (Repacked) {
    for (int g = 0; g < 4; ++g) out[g] = L::load(b + (off + 4 * g) * L::n);
  } else {
    L::transpose(b + off, row_bytes, out);
  }
}

// The super-block a tile reads next: with Repacked 32 rows' super-blocks ahead in its one stream
// (4.5 KiB for Q4_K, 6.6 for Q6_K: two super-blocks of a 16-row tile, four of an 8-row one; the next
// tile's first ones after its last; with two of an 8-row tile its one-row products were 0.96-1.23x
// the file layout's, with four 1.02-1.41x over two runs, Zen 5), else the next tile's same super-block, row by row
template <class L, bool Repacked>
inline void prefetch_next(const uint8_t* b, int64_t row_bytes, int64_t sb) {
  if constexpr (Repacked) {
    prefetch_span(b + 32 * sb, sb * L::n);
  } else {
    for (int64_t i = 0; i < L::n; ++i) prefetch_super<L>(b + (L::n + i) * row_bytes, sb);
  }
}

// One block of 32 weights of the tile (their unsigned quants wq[8], register g holding values 4g..4g+3
// of each lane's row) against G rows of x (fewer when n_rows < G), their blocks side by side from x: the integer dot
// products are added to sums[i], values 0-15 into sums[i][0] and, with Halves, 16-31 into sums[i][1].
// C groups at a time: with vpmaddubsw their pair sums (at most 2 q_max 127 each) are added in 16 bits
// before one vpmaddwd, so C 2 q_max 127 must stay under 32768 (Q4_K, q <= 15: all 8; Q6_K, q <= 63: 2)
template <class L, int G, bool Halves, int C>
inline void block_sums(const typename L::vi wq[8], const int8_t* x, int n_rows, typename L::vi (*sums)[2]) {
  static_assert(8 % C == 0 && (!Halves || C <= 4), "C groups a sum: whole groups, within one half");
#pragma GCC unroll 8
  for (int g = 0; g < 8; g += C) {
#pragma GCC unroll 8
    for (int i = 0; i < G; ++i) {
      if (i >= n_rows) break;
      const int32_t* xq = reinterpret_cast<const int32_t*>(x + i * kQuantBlock);
      const int h = Halves && g >= 4 ? 1 : 0;
      sums[i][h] = L::template dp_n<C>(sums[i][h], wq + g, xq + g);
    }
  }
}

// A tile of L::n weight rows of Q4_K times R rows of x from r0 (R at most kInt8X, known when
// compiled, so the accumulators and the group loops stay in registers): out[r * L::n + lane]
template <class L, int R, bool Repacked>
void q4_k_tile(const uint8_t* w, int64_t row_bytes, const KX& kx, int64_t r0, float* out) {
  using vi = typename L::vi;
  using vf = typename L::vf;
  constexpr int G = L::group < R ? L::group : R;
  const int64_t supers = kx.x.k / kSuper, blocks = kx.x.k / kQuantBlock;
  vf acc[R];
  for (int r = 0; r < R; ++r) acc[r] = L::zerof();
  for (int64_t sup = 0; sup < supers; ++sup) {
    const uint8_t* b = w + sup * 144 * (Repacked ? L::n : 1);
    prefetch_next<L, Repacked>(b, row_bytes, 144);
    vi hdr[4];  // d and dmin, then the 12 bytes of scales and minimums, four bytes a word (a transpose:
    words<L, Repacked>(b, 0, row_bytes, hdr);  // cheaper than four gathers)
    const vi head = hdr[0], s0 = hdr[1], s1 = hdr[2], s2 = hdr[3];
    const vf d = L::halves(head), dmin = L::halves(L::srl32(head, 16));
    for (int pair = 0; pair < 4; ++pair) {  // sub-blocks 2 pair (low nibbles) and 2 pair + 1 (high)
      vi nib[8];
      words<L, Repacked>(b, 16 + 32 * pair, row_bytes, nib);
      words<L, Repacked>(b, 32 + 32 * pair, row_bytes, nib + 4);
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * pair + h;
        vi wq[8];
        for (int g = 0; g < 8; ++g) wq[g] = L::bytes(h ? L::srl16(nib[g], 4) : nib[g], 0x0f);
        vi sc, mn;  // the 6-bit scale and minimum of sub-block j, per lane (scale_min's unpacking)
        if (j < 4) {
          sc = L::and_(L::srl32(s0, 8 * j), 63);
          mn = L::and_(L::srl32(s1, 8 * j), 63);
        } else {
          const int t = 8 * (j - 4);
          sc = L::or_(L::and_(L::srl32(s2, t), 0x0f), L::sll32(L::and_(L::srl32(s0, t + 6), 3), 4));
          mn = L::or_(L::and_(L::srl32(s2, t + 4), 0x0f), L::sll32(L::and_(L::srl32(s1, t + 6), 3), 4));
        }
        const vf dsc = L::mul(d, L::cvt(sc)), dm = L::mul(dmin, L::cvt(mn));
        const int64_t i0 = r0 * blocks + (sup * 8 + j) * R;  // x's panel: this block of the R rows
#pragma GCC unroll 16
        for (int r1 = 0; r1 < R; r1 += G) {
          const int n_rows = R - r1 < G ? R - r1 : G;
          vi sums[G][2];
          for (int i = 0; i < n_rows; ++i) sums[i][0] = L::set1(0);
          block_sums<L, G, false, 8>(wq, kx.x.q + (i0 + r1) * kQuantBlock, n_rows, sums);  // 8 x 3,810
          for (int i = 0; i < n_rows; ++i) {
            const int64_t at = i0 + r1 + i;
            vf& a = acc[r1 + i];
            a = L::fmadd(L::cvt(sums[i][0]), L::mul(dsc, L::set1f(kx.x.d[at])), a);
            a = L::fnmadd(dm, L::set1f(kx.x.s[at]), a);
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) L::store(out + r * L::n, acc[r]);
}

// The same for Q6_K: in each half of 128 weights, quarter c (x block 4 half + c) takes the low
// (c < 2) or high nibbles of ql[l] (c even) or ql[l + 32] (c odd), with bits 2c, 2c + 1 of qh[l] on
// top, and scales 8 half + 2c (values 0-15) and 8 half + 2c + 1 (16-31)
template <class L, int R, bool Repacked>
void q6_k_tile(const uint8_t* w, int64_t row_bytes, const KX& kx, int64_t r0, float* out) {
  using vi = typename L::vi;
  using vf = typename L::vf;
  constexpr int G = L::group < R ? L::group : R;
  const int64_t supers = kx.x.k / kSuper, blocks = kx.x.k / kQuantBlock;
  const vi offs = L::offsets(row_bytes);
  vf acc[R];
  for (int r = 0; r < R; ++r) acc[r] = L::zerof();
  for (int64_t sup = 0; sup < supers; ++sup) {
    const uint8_t* b = w + sup * 210 * (Repacked ? L::n : 1);
    prefetch_next<L, Repacked>(b, row_bytes, 210);
    vf d;  // bytes 208-209 (206: no read past the end)
    if constexpr (Repacked) d = L::load_halves(b + 4 * repacked_words(210) * L::n);
    else d = L::halves(L::srl32(L::gather(offs, b + 206), 16));
    vi sw[4];  // the sixteen int8 scales, four a word
    words<L, Repacked>(b, 192, row_bytes, sw);
    for (int half = 0; half < 2; ++half) {
      vi l0[8], l1[8], hb[8];
      words<L, Repacked>(b, 64 * half, row_bytes, l0);
      words<L, Repacked>(b, 64 * half + 16, row_bytes, l0 + 4);
      words<L, Repacked>(b, 64 * half + 32, row_bytes, l1);
      words<L, Repacked>(b, 64 * half + 48, row_bytes, l1 + 4);
      words<L, Repacked>(b, 128 + 32 * half, row_bytes, hb);
      words<L, Repacked>(b, 128 + 32 * half + 16, row_bytes, hb + 4);
      for (int c = 0; c < 4; ++c) {
        vi wq[8];
        const vi* low = c & 1 ? l1 : l0;
        for (int g = 0; g < 8; ++g)
          wq[g] = L::or_(L::bytes(L::srl16(low[g], 4 * (c >> 1)), 0x0f), L::sll16(L::bytes(L::srl16(hb[g], 2 * c), 3), 4));
        vf ds[2];
        for (int e = 0; e < 2; ++e) {
          const int idx = 8 * half + 2 * c + e;  // a signed byte: shifted to the top, then down arithmetically
          ds[e] = L::mul(d, L::cvt(L::sra32(L::sll32(sw[idx / 4], 24 - 8 * (idx % 4)), 24)));
        }
        const int64_t i0 = r0 * blocks + (sup * 8 + 4 * half + c) * R;  // x's panel: this block of the R rows
#pragma GCC unroll 16
        for (int r1 = 0; r1 < R; r1 += G) {
          const int n_rows = R - r1 < G ? R - r1 : G;
          vi sums[G][2];
          for (int i = 0; i < n_rows; ++i) {
            const int32_t* s16 = kx.sq16 + (i0 + r1 + i) * 2;
            sums[i][0] = L::set1(-32 * s16[0]);
            sums[i][1] = L::set1(-32 * s16[1]);
          }
          block_sums<L, G, true, 2>(wq, kx.x.q + (i0 + r1) * kQuantBlock, n_rows, sums);  // 2 x 16,002
          for (int i = 0; i < n_rows; ++i) {
            const vf dx = L::set1f(kx.x.d[i0 + r1 + i]);
            vf& a = acc[r1 + i];
            a = L::fmadd(L::cvt(sums[i][0]), L::mul(ds[0], dx), a);
            a = L::fmadd(L::cvt(sums[i][1]), L::mul(ds[1], dx), a);
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) L::store(out + r * L::n, acc[r]);
}

// the tile for `rows` (1 to kInt8X) rows of x; `repacked`: the tile's bytes are a repacked tile's
template <class L, int R = 1>
void k_tile_any(int64_t qtype, int64_t rows, bool repacked, const uint8_t* w, int64_t row_bytes, const KX& kx,
                int64_t r0, float* out) {
  if constexpr (R < kInt8X) {
    if (rows > R) return k_tile_any<L, R + 1>(qtype, rows, repacked, w, row_bytes, kx, r0, out);
  }
  if (qtype == kQ4_K) {
    if (repacked) q4_k_tile<L, R, true>(w, row_bytes, kx, r0, out);
    else q4_k_tile<L, R, false>(w, row_bytes, kx, r0, out);
  } else {
    if (repacked) q6_k_tile<L, R, true>(w, row_bytes, kx, r0, out);
    else q6_k_tile<L, R, false>(w, row_bytes, kx, r0, out);
  }
}

// y [m, n] (float32) = x (int8 rows) times the weight, tiles of L::n weight rows over the threads
// (`repacked`: its full tiles repacked for L, kquant_repack)
template <class L>
void int8_product(int64_t qtype, const KX& kx, const uint8_t* w, int64_t row_bytes, const float* bias, float* y,
                  int64_t m, int64_t n, bool repacked) {
  const int64_t tiles = (n + L::n - 1) / L::n, full = n / L::n;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(4, tiles / (4 * threads)));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    float out[kInt8X * 16];
    std::vector<uint8_t> padded;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t j0 = t * L::n, nj = std::min<int64_t>(L::n, n - j0);
      const uint8_t* tile = w + j0 * row_bytes;
      if (t >= full) {  // the last rows, fewer than a tile: copied into one padded with zero rows
        padded.assign(L::n * row_bytes, 0);
        std::memcpy(padded.data(), tile, nj * row_bytes);
        tile = padded.data();
      }
      for (int64_t r0 = 0; r0 < m; r0 += kInt8X) {
        const int64_t rows = std::min(kInt8X, m - r0);
        k_tile_any<L>(qtype, rows, repacked && t < full, tile, row_bytes, kx, r0, out);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < nj; ++j) y[(r0 + r) * n + j0 + j] = out[r * L::n + j] + (bias ? bias[j0 + j] : 0.0f);
      }
    }
  });
}

constexpr int64_t kRegisterRows = 4;  // up to this many rows of x: weights dequantized in registers

// rows a repacked tile: the int8 tiles' lanes, 16 (AVX512-VNNI) or 8 (the AVX2 build); 0: this build
// repacks nothing (AVX-512 without VNNI), as quant_cpu.cpp's quant_repack_rows
#if CB_KQUANT_VNNI
constexpr int64_t kRepackRows = 16;
#elif defined(__AVX512F__)
constexpr int64_t kRepackRows = 0;
#else
constexpr int64_t kRepackRows = 8;
#endif

// Tile `t`'s super-blocks from the file's rows (`w` its first row) into the repacked layout at `out`
void repack_tile(const uint8_t* w, int64_t row_bytes, int64_t sb, uint8_t* out) {
  const int64_t n = kRepackRows, nw = repacked_words(sb), tail = sb - 4 * nw;
  for (int64_t s = 0; s < row_bytes / sb; ++s) {
    uint8_t* o = out + s * sb * n;
    for (int64_t r = 0; r < n; ++r) {
      const uint8_t* src = w + r * row_bytes + s * sb;
      for (int64_t v = 0; v < nw; ++v) std::memcpy(o + 4 * (v * n + r), src + 4 * v, 4);
      std::memcpy(o + 4 * nw * n + tail * r, src + 4 * nw, tail);
    }
  }
}

// super-block s of row j (of n) of a weight: where the file keeps it, or gathered back from its
// repacked tile into buf
const uint8_t* super_of(const uint8_t* w, int64_t row_bytes, int64_t n, int64_t j, int64_t s, int64_t sb,
                        bool repacked, uint8_t* buf) {
  const int64_t L = kRepackRows;
  if (!repacked || L == 0 || j >= n / L * L) return w + j * row_bytes + s * sb;
  const int64_t nw = repacked_words(sb), tail = sb - 4 * nw, r = j % L;
  const uint8_t* o = w + (j - r) * row_bytes + s * sb * L;
  for (int64_t v = 0; v < nw; ++v) std::memcpy(buf + 4 * v, o + 4 * (v * L + r), 4);
  std::memcpy(buf + 4 * nw, o + 4 * nw * L + tail * r, tail);
  return buf;
}

void check_weight(const at::Tensor& w, int64_t qtype, int64_t k) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.device().is_cpu() && w.is_contiguous(),
              "K-quant linear: the weight must be a contiguous uint8 CPU tensor [rows, row bytes]");
  TORCH_CHECK(k % kSuper == 0 && w.size(1) == k / kSuper * super_bytes(qtype), "K-quant linear: ", w.size(1),
              " bytes a row do not hold ", k, " weights of type ", qtype);
}

}  // namespace

// x [M, K] (float32, bfloat16 or float16) times the K-quant weight w [N, row bytes] of ggml type
// `qtype`, plus `bias` (or None): [M, N] in x's dtype. `int8`: x quantized to int8 blocks and integer
// dot products; else x in float32 against the dequantized blocks
at::Tensor kquant_linear(at::Tensor x, at::Tensor w, int64_t type, c10::optional<at::Tensor> bias, bool int8) {
  TORCH_CHECK(x.dim() == 2, "kquant_linear: x [M, K] expected");
  bool repacked;
  const int64_t qtype = base_type(type, repacked);
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0), supers = k / kSuper;
  check_weight(w, qtype, k);
  TORCH_CHECK(!repacked || (kRepackRows && int8 && (kRepackRows == 8 || quant_vnni_on())), "kquant_linear: a weight "
              "repacked for the int8 tiles (quant_repack) is multiplied by int8 x with VNNI on, not ",
              int8 ? "with VNNI off" : "float x");
  auto xf = x.to(at::kFloat).contiguous();
  auto y32 = at::empty({m, n}, x.options().dtype(at::kFloat));
  at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* xp = xf.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y32.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1), sb = super_bytes(qtype);
  if (int8) {
    const QuantizedRows rows = quantize_rows(xf, true, kInt8X);
    auto sq16 = at::empty({qtype == kQ6_K ? m : 0, k / 16}, x.options().dtype(at::kInt));
    int32_t* s16 = sq16.data_ptr<int32_t>();
    for (int64_t i = 0; i < sq16.numel(); ++i) {  // Q6_K's sums of x's halves of 16, in q's order
      int32_t t = 0;
      for (int e = 0; e < 16; ++e) t += rows.view.q[16 * i + e];
      s16[i] = t;
    }
    const KX kx{rows.view, s16};
#if CB_KQUANT_VNNI
    if (quant_vnni_on()) {
      int8_product<Lanes16>(qtype, kx, wp, row_bytes, bp, yp, m, n, repacked);
      return x.scalar_type() == at::kFloat ? y32 : y32.to(x.scalar_type());
    }
#endif
    int8_product<Lanes8>(qtype, kx, wp, row_bytes, bp, yp, m, n, repacked);
    return x.scalar_type() == at::kFloat ? y32 : y32.to(x.scalar_type());
  }
  at::parallel_for(0, n, 16, [&](int64_t j0, int64_t j1) {
    if (m > 0 && m <= kRegisterRows) {
      if (qtype == kQ4_K) {
        few_rows<kQ4_K>(m, wp, row_bytes, xp, k, bp, yp, n, j0, j1);
      } else {
        few_rows<kQ6_K>(m, wp, row_bytes, xp, k, bp, yp, n, j0, j1);
      }
      return;
    }
    int64_t j = j0;
    {  // tiles of kTileRows weight rows: each slice of x is read once for the tile's rows
      alignas(64) float tile[kTileRows][kSuper];
      std::vector<vfloat> acc(4 * kTileRows * m);  // [row of x][weight row of the tile][4]
      for (; j + kTileRows <= j1; j += kTileRows) {
        for (auto& a : acc) a = vfloat{};
        for (int64_t s = 0; s < supers; ++s) {
          for (int u = 0; u < kTileRows; ++u) dequantize_super(qtype, wp + (j + u) * row_bytes + s * sb, tile[u]);
          for (int64_t r = 0; r < m; ++r) dot_tile(tile, xp + r * k + s * kSuper, &acc[4 * kTileRows * r]);
        }
        for (int64_t r = 0; r < m; ++r) {
          for (int u = 0; u < kTileRows; ++u) {
            const vfloat* a = &acc[4 * (kTileRows * r + u)];
            yp[r * n + j + u] = hsum((a[0] + a[1]) + (a[2] + a[3])) + (bp ? bp[j + u] : 0.0f);
          }
        }
      }
    }
    alignas(64) float buf[kSuper];
    std::vector<vfloat> acc(4 * m);
    for (; j < j1; ++j) {  // the last j1 - j0 mod kTileRows weight rows, one at a time
      for (auto& a : acc) a = vfloat{};
      const uint8_t* row = wp + j * row_bytes;
      for (int64_t s = 0; s < supers; ++s) {
        dequantize_super(qtype, row + s * sb, buf);
        for (int64_t r = 0; r < m; ++r) dot_super(buf, xp + r * k + s * kSuper, &acc[4 * r]);
      }
      for (int64_t r = 0; r < m; ++r) {
        const vfloat* a = &acc[4 * r];
        yp[r * n + j] = hsum((a[0] + a[1]) + (a[2] + a[3])) + (bp ? bp[j] : 0.0f);
      }
    }
  });
  return x.scalar_type() == at::kFloat ? y32 : y32.to(x.scalar_type());
}

// the rows `rows` (int64 [R], or all when None) of w [N, row bytes] as [R, k] in `like`'s dtype
at::Tensor kquant_dequantize(at::Tensor w, int64_t type, int64_t k, c10::optional<at::Tensor> rows, at::Tensor like) {
  bool repacked;
  const int64_t qtype = base_type(type, repacked);
  check_weight(w, qtype, k);
  TORCH_CHECK(!repacked || kRepackRows, "kquant_dequantize: this build makes no repacked weights (no int8 tiles)");
  at::Tensor idx = rows.has_value() ? rows->to(at::kLong).contiguous() : at::Tensor();
  const int64_t r = idx.defined() ? idx.numel() : w.size(0), n = w.size(0), row_bytes = w.size(1);
  if (idx.defined() && r > 0) {
    TORCH_CHECK(idx.min().item<int64_t>() >= 0 && idx.max().item<int64_t>() < n, "kquant_dequantize: a row out of range");
  }
  auto out = at::empty({r, k}, like.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t sb = super_bytes(qtype);
  for_each_float_type(out, "kquant_dequantize", [&](auto zero) {
    using T = decltype(zero);
    T* op = out.data_ptr<T>();
    at::parallel_for(0, r, 8, [&](int64_t i0, int64_t i1) {
      alignas(64) float buf[kSuper];
      uint8_t gathered[210];
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t j = idx.defined() ? idx.data_ptr<int64_t>()[i] : i;
        for (int64_t s = 0; s < k / kSuper; ++s) {
          dequantize_super(qtype, super_of(wp, row_bytes, n, j, s, sb, repacked, gathered), buf);
          T* o = op + i * k + s * kSuper;
          for (int64_t e = 0; e < kSuper; ++e) o[e] = static_cast<T>(buf[e]);
        }
      }
    });
  });
  return out;
}

// w [N, row bytes] of Q4_K or Q6_K with its full tiles of rows repacked for this build's int8 tiles (a
// new tensor of the same shape; multiply it as type qtype + 256 with int8 x); quant_repack's K-quants
at::Tensor kquant_repack(at::Tensor w, int64_t qtype, int64_t k) {
  check_weight(w, qtype, k);
  TORCH_CHECK(kRepackRows, "quant_repack: this build has no int8 tiles (AVX-512 without VNNI)");
  at::Tensor out = w.clone();
  if (kRepackRows == 0) return out;
  const int64_t row_bytes = w.size(1), tiles = w.size(0) / kRepackRows, sb = super_bytes(qtype);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) repack_tile(wp + t * kRepackRows * row_bytes, row_bytes, sb, op + t * kRepackRows * row_bytes);
  });
  return out;
}
