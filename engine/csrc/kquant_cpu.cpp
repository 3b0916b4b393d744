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
// The product keeps x in float32: each super-block of a weight row is dequantized once into 256
// floats on the stack (the values of the reference's dequantization up to float rounding of the
// scale products) and multiplied into every row of x with FMAs, so the result is x times the
// dequantized weight up to the order of the float sums, and a row's result takes the same steps
// whatever the batch. Work is split over output rows. Prompt steps (many rows of x) dequantize the
// whole weight instead and run torch's product (engine/backends/cpu_quant.py decides).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include "vec.h"

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

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// sub-block j's 6-bit scale and minimum from Q4_K's 12 packed bytes
inline void scale_min(int j, const uint8_t* s, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void dequantize_q4_k(const uint8_t* b, float* out) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* s = b + 4;
  const uint8_t* qs = b + 16;
  for (int i = 0; i < 4; ++i) {
    int sc, m;
    scale_min(2 * i, s, sc, m);
    const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(m);
    scale_min(2 * i + 1, s, sc, m);
    const float d2 = d * static_cast<float>(sc), m2 = dmin * static_cast<float>(m);
    const uint8_t* q = qs + 32 * i;
    float* y = out + 64 * i;
    for (int l = 0; l < 32; ++l) {
      y[l] = d1 * static_cast<float>(q[l] & 0x0f) - m1;
      y[l + 32] = d2 * static_cast<float>(q[l] >> 4) - m2;
    }
  }
}

void dequantize_q6_k(const uint8_t* b, float* out) {
  const float d = half_at(b + 208);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = b + 64 * h;
    const uint8_t* qh = b + 128 + 32 * h;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * h;
    float* y = out + 128 * h;
    for (int t = 0; t < 2; ++t) {  // l in [16 t, 16 t + 16): one scale per group of 32 there
      const float s1 = d * static_cast<float>(sc[t]), s2 = d * static_cast<float>(sc[t + 2]);
      const float s3 = d * static_cast<float>(sc[t + 4]), s4 = d * static_cast<float>(sc[t + 6]);
      for (int i = 0; i < 16; ++i) {  // plain loops over bytes: the compiler vectorizes them
        const int l = 16 * t + i;
        const int q1 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = s1 * static_cast<float>(q1);
        y[l + 32] = s2 * static_cast<float>(q2);
        y[l + 64] = s3 * static_cast<float>(q3);
        y[l + 96] = s4 * static_cast<float>(q4);
      }
    }
  }
}

inline void dequantize_super(int64_t qtype, const uint8_t* b, float* out) {
  if (qtype == kQ4_K) {
    dequantize_q4_k(b, out);
  } else {
    dequantize_q6_k(b, out);
  }
}

// 256 weights against 256 floats of x, into four accumulators (a fixed order: the same for a row
// alone and in a batch)
inline void dot_super(const float* w, const float* x, vfloat acc[4]) {
  for (int64_t i = 0; i < kSuper; i += 4 * kLanes) {
    for (int a = 0; a < 4; ++a) acc[a] += load(w + i + a * kLanes) * load(x + i + a * kLanes);
  }
}

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
    alignas(64) float buf[kSuper];
    std::vector<vfloat> acc(4 * m);
    for (int64_t j = j0; j < j1; ++j) {
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
