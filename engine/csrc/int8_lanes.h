// Int8 inputs and weight rows in lanes, shared by the GGUF block kernels (quant_cpu.cpp) and the
// K-quant ones (kquant_cpu.cpp): rows of x quantized to int8 blocks of 32 (llama.cpp's way: a float
// scale dx per block, qx = round(x / dx)), and the transposes that put a tile's weight rows one per
// 32-bit lane.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace cbserve {

constexpr int64_t kQuantBlock = 32;  // values of x per int8 block

// Rows of x as int8 blocks in panels of `panel` rows, each panel by block: block b of the panel's
// rows side by side (q [m / panel][k / 32][panel rows][32], d/s/sq [m / panel][k / 32][panel rows];
// the last panel may have fewer rows). The int8 tiles take up to a panel of rows a pass: its rows of
// one block are then one pointer and offsets known when compiled, and the next block is a fixed step
// on. By row, each row of a pass was its own pointer (16 of them spill out of the registers): a
// standalone probe (benchmarks/probes/int8_tile_layouts.c) measured the 16-row Q4_0 tile 1.17x faster
// by block.
struct QuantizedX {
  const int8_t* q;
  const float* d;    // scales dx
  const float* s;    // dx * sum(qx)
  const int32_t* sq; // sum(qx)
  int64_t k, m;
  int64_t panel;     // rows a panel
  // the index of row r's block b (its scale and sums; its bytes at q + 32 at(r, b))
  int64_t at(int64_t r, int64_t b) const {
    const int64_t p0 = r - r % panel;
    return p0 * (k / kQuantBlock) + b * std::min(panel, m - p0) + (r - p0);
  }
};

// x row -> int8 blocks: dx = max|x| / 127, qx = round(x / dx) (to nearest even, as nearbyint in the
// default rounding mode), 8 floats at a time: the same products and roundings as one at a time.
// Block b goes to q + b * q_step, its scale and sums to d/s/sq[b * step]
inline void quantize_row(const float* x, int64_t k, int8_t* q, float* d, float* s, int32_t* sq, int64_t q_step = 32,
                         int64_t step = 1) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < k / kQuantBlock; ++b) {
    const float* xb = x + b * kQuantBlock;
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float top = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float dx = top / 127.0f, inv = top > 0.0f ? 127.0f / top : 0.0f;
    __m256i qi[4], sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));  // |q| <= 127: packs exactly
      sum = _mm256_add_epi32(sum, qi[i]);
    }
    // int32 -> int16 -> int8 packs interleave the 128-bit lanes; the permute puts the bytes back in order
    const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * q_step),
                        _mm256_permutevar8x32_epi32(p16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    const int32_t total = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1)));
    d[b * step] = dx;
    s[b * step] = dx * static_cast<float>(total);
    sq[b * step] = total;
  }
}

// Every row of xf (float32 [m, k], contiguous) as int8 blocks in panels (above), rows split
// over the threads in chunks of at least 32k inputs (fewer: one thread, no wake-up). With `on` false,
// nothing is quantized (the view has its k and no rows).
struct QuantizedRows {
  at::Tensor q, d, s, sq;
  QuantizedX view;
};

inline QuantizedRows quantize_rows(const at::Tensor& xf, bool on, int64_t panel) {
  const int64_t m = on ? xf.size(0) : 0, k = xf.size(1), blocks = k / kQuantBlock;
  QuantizedRows out;
  out.q = at::empty({m, k}, xf.options().dtype(at::kChar));
  out.d = at::empty({m, blocks}, xf.options().dtype(at::kFloat));
  out.s = at::empty({m, blocks}, xf.options().dtype(at::kFloat));
  out.sq = at::empty({m, blocks}, xf.options().dtype(at::kInt));
  out.view = {out.q.data_ptr<int8_t>(), out.d.data_ptr<float>(), out.s.data_ptr<float>(), out.sq.data_ptr<int32_t>(),
              k, m, panel};
  const QuantizedX& v = out.view;
  at::parallel_for(0, m, std::max<int64_t>(1, 32768 / std::max<int64_t>(k, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t i = v.at(r, 0), step = v.at(r, std::min<int64_t>(1, blocks - 1)) - i;  // from one block to the next
      quantize_row(xf.data_ptr<float>() + r * k, k, out.q.data_ptr<int8_t>() + i * kQuantBlock, out.d.data_ptr<float>() + i,
                   out.s.data_ptr<float>() + i, out.sq.data_ptr<int32_t>() + i, step * kQuantBlock, step);
    }
  });
  return out;
}

#if defined(__AVX512F__)
// 16 rows of 16 bytes (row i at base + i * row_bytes) transposed by 32-bit words: out[g] lane j =
// bytes 4g..4g+3 of row j
inline void transpose16x16(const uint8_t* base, int64_t row_bytes, __m512i out[4]) {
  __m512i z[4];
  for (int a = 0; a < 4; ++a) {  // z[a] = rows a, a+4, a+8, a+12 in its four 128-bit lanes
    z[a] = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + a * row_bytes)));
    for (int l = 1; l < 4; ++l)
      z[a] = _mm512_inserti32x4(z[a], _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + (a + 4 * l) * row_bytes)), l);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  out[0] = _mm512_unpacklo_epi64(t0, t2);
  out[1] = _mm512_unpackhi_epi64(t0, t2);
  out[2] = _mm512_unpacklo_epi64(t1, t3);
  out[3] = _mm512_unpackhi_epi64(t1, t3);
}

#endif

// 8 rows of 16 bytes (row i at base + i * row_bytes) transposed by 32-bit words: out[g] lane j =
// bytes 4g..4g+3 of row j
inline void transpose8x16(const uint8_t* base, int64_t row_bytes, __m256i out[4]) {
  __m256i z[4];
  for (int a = 0; a < 4; ++a)  // z[a] = rows a and a + 4 in its two 128-bit lanes
    z[a] = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + (a + 4) * row_bytes)),
                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + a * row_bytes)));
  const __m256i t0 = _mm256_unpacklo_epi32(z[0], z[1]), t1 = _mm256_unpackhi_epi32(z[0], z[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(z[2], z[3]), t3 = _mm256_unpackhi_epi32(z[2], z[3]);
  out[0] = _mm256_unpacklo_epi64(t0, t2);
  out[1] = _mm256_unpackhi_epi64(t0, t2);
  out[2] = _mm256_unpacklo_epi64(t1, t3);
  out[3] = _mm256_unpackhi_epi64(t1, t3);
}

// whether the int8 products use VNNI now: the build has it and set_quant_vnni has not turned it off
// (quant_cpu.cpp)
bool quant_vnni_on();

// added to a ggml type: the weight's full tiles of rows repacked at load for the build's int8 tiles
// (quant_cpu.cpp's quant_repack; kquant_cpu.cpp's for Q4_K/Q6_K)
constexpr int64_t kRepacked = 256;

// the type without kRepacked; whether it was there
inline int64_t base_type(int64_t qtype, bool& repacked) {
  repacked = (qtype & kRepacked) != 0;
  return qtype & ~kRepacked;
}

}  // namespace cbserve
