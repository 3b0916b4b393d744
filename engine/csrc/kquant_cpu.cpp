// Linear layers on GGUF K-quant weights, multiplied in their super-blocks: Q4_K and Q6_K.
//
// A weight row is the file's bytes, unchanged: super-blocks of 256 weights.
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
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include "vec.h"

#include <immintrin.h>

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

constexpr int64_t kRegisterRows = 4;  // up to this many rows of x: weights dequantized in registers

void check_weight(const at::Tensor& w, int64_t qtype, int64_t k) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.device().is_cpu() && w.is_contiguous(),
              "K-quant linear: the weight must be a contiguous uint8 CPU tensor [rows, row bytes]");
  TORCH_CHECK(k % kSuper == 0 && w.size(1) == k / kSuper * super_bytes(qtype), "K-quant linear: ", w.size(1),
              " bytes a row do not hold ", k, " weights of type ", qtype);
}

}  // namespace

// x [M, K] (float32, bfloat16 or float16) times the K-quant weight w [N, row bytes] of ggml type
// `qtype`, plus `bias` (or None): [M, N] in x's dtype, x in float32 against the dequantized blocks
at::Tensor kquant_linear(at::Tensor x, at::Tensor w, int64_t qtype, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2, "kquant_linear: x [M, K] expected");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0), supers = k / kSuper;
  check_weight(w, qtype, k);
  auto xf = x.to(at::kFloat).contiguous();
  auto y32 = at::empty({m, n}, x.options().dtype(at::kFloat));
  at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* xp = xf.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y32.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1), sb = super_bytes(qtype);
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
at::Tensor kquant_dequantize(at::Tensor w, int64_t qtype, int64_t k, c10::optional<at::Tensor> rows, at::Tensor like) {
  check_weight(w, qtype, k);
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
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t j = idx.defined() ? idx.data_ptr<int64_t>()[i] : i;
        for (int64_t s = 0; s < k / kSuper; ++s) {
          dequantize_super(qtype, wp + j * row_bytes + s * sb, buf);
          T* o = op + i * k + s * kSuper;
          for (int64_t e = 0; e < kSuper; ++e) o[e] = static_cast<T>(buf[e]);
        }
      }
    });
  });
  return out;
}
