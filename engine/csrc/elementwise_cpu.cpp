// Element-wise passes of a decoder layer, fused on the CPU: RMSNorm, rotary position embedding and
// the SiLU-gated product of an MLP. Each is one pass where transformers' code runs three to twelve
// torch ops (float32 copies, pow, mean, rsqrt, products, a concatenation, casts), with the same
// roundings in the same places: the rotary pass is bit for bit torch's, the others differ only in
// the order of a sum (RMSNorm's squares) or in exp's last bit (SiLU).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include "vec.h"

#include <cmath>
#include <cstdint>

// each product rounded on its own, as torch's separate ops round it: no fused multiply-adds here
#pragma GCC optimize("fp-contract=off")

namespace {

using namespace cbserve;

// float -> the model dtype -> float, as a cast to the model dtype and back rounds
template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}
template <typename T>
inline vfloat round_to(vfloat v) {
  T tmp[kLanes];
  store(tmp, v);
  return load(tmp);
}
template <>
inline vfloat round_to<float>(vfloat v) {
  return v;
}
template <>
inline vfloat round_to<c10::BFloat16>(vfloat v) {
  return round_bf16(v);
}

// transformers' RMSNorm: h = float(x) * rsqrt(mean(float(x)^2) + eps); out = weight * h.to(dtype)
template <typename T>
void rms_norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  const int64_t body = n / kLanes * kLanes;
  vfloat acc{};
  for (int64_t i = 0; i < body; i += kLanes) {
    const vfloat v = load(x + i);
    acc += v * v;
  }
  float sum = hsum(acc);
  for (int64_t i = body; i < n; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < body; i += kLanes) store(out + i, load(w + i) * round_to<T>(load(x + i) * inv));
  for (int64_t i = body; i < n; ++i)
    out[i] = static_cast<T>(static_cast<float>(w[i]) * round_to<T>(static_cast<float>(x[i]) * inv));
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// silu(g) = g / (1 + exp(-g)), computed from exp(-|g|) so nothing overflows. Below -87, where
// exp_neg stops, the result is 0: torch's is too from -88.8 (exp(-g) overflows), and under 1e-36
// in between.
inline vfloat silu(vfloat g) {
  const vfloat neg = g < 0 ? g : -g;
  const vfloat e = exp_neg(neg);
  const vfloat out = (g < 0 ? g * e : g) / (1.0f + e);
  return g < -87.0f ? g * 0.0f : out;
}

// transformers' act_fn(gate) * up in the model dtype: the activation is rounded before the product
template <typename T>
void silu_mul_row(const T* g, const T* u, T* out, int64_t n) {
  const int64_t body = n / kLanes * kLanes;
  for (int64_t i = 0; i < body; i += kLanes) store(out + i, round_to<T>(silu(load(g + i))) * load(u + i));
  for (int64_t i = body; i < n; ++i) {
    out[i] = static_cast<T>(round_to<T>(silu(static_cast<float>(g[i]))) * static_cast<float>(u[i]));
  }
}

// transformers' q * cos + rotate_half(q) * sin for one row of head_dim values, rotate_half(q) being
// (-q[half:], q[:half]); each product and the sum rounded to the model dtype, as torch's ops do
template <typename T>
void rotary_row(const T* x, const T* c, const T* s, T* out, int64_t half) {
  const int64_t body = half / kLanes * kLanes;
  for (int64_t i = 0; i < body; i += kLanes) {
    const vfloat x1 = load(x + i), x2 = load(x + half + i);
    store(out + i, round_to<T>(x1 * load(c + i)) + round_to<T>(-x2 * load(s + i)));
    store(out + half + i, round_to<T>(x2 * load(c + half + i)) + round_to<T>(x1 * load(s + half + i)));
  }
  for (int64_t i = body; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[half + i]);
    out[i] = static_cast<T>(round_to<T>(x1 * static_cast<float>(c[i])) + round_to<T>(-x2 * static_cast<float>(s[i])));
    out[half + i] = static_cast<T>(round_to<T>(x2 * static_cast<float>(c[half + i])) +
                                   round_to<T>(x1 * static_cast<float>(s[half + i])));
  }
}

int64_t grain(int64_t n) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1)); }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() >= 1 && t.size(-1) > 0 && t.is_contiguous(), name,
              ": a contiguous CPU tensor with a non-empty last dimension expected");
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be [", x.size(-1), "] in the input's dtype");
  const int64_t n = x.size(-1), rows = x.numel() / n;
  at::Tensor out = at::empty_like(x);
  for_each_float_type(x, "rms_norm", [&](auto zero) {
    using T = decltype(zero);
    const T *src = x.data_ptr<T>(), *w = weight.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) rms_norm_row(src + r * n, w, dst + r * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

// gate and up [rows, n] with contiguous rows, any row stride (the two halves of one gate/up
// product would be two such views): silu(gate) * up, [rows, n] contiguous
at::Tensor silu_mul(at::Tensor gate, at::Tensor up) {
  for (const at::Tensor* t : {&gate, &up})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 2 && t->size(1) > 0 && t->stride(1) == 1,
                "silu_mul: gate and up must be CPU [rows, n] tensors with contiguous rows");
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(),
              "silu_mul: gate and up must have the same shape and dtype");
  const int64_t rows = gate.size(0), n = gate.size(1), gs = gate.stride(0), us = up.stride(0);
  at::Tensor out = at::empty({rows, n}, gate.options());
  for_each_float_type(gate, "silu_mul", [&](auto zero) {
    using T = decltype(zero);
    const T *g = gate.data_ptr<T>(), *u = up.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_mul_row(g + r * gs, u + r * us, dst + r * n, n);
    });
  });
  return out;
}

// q or k [batch, heads, tokens, head_dim] (any strides, the last one 1), cos and sin [batch, tokens,
// head_dim] contiguous: the rotated tensor
at::Tensor rotary(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 4 && x.stride(3) == 1 && x.size(3) % 2 == 0,
              "rotary: x must be a CPU [batch, heads, tokens, head_dim] tensor with an even, contiguous head_dim");
  const int64_t B = x.size(0), H = x.size(1), L = x.size(2), D = x.size(3);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == B && t->size(1) == L && t->size(2) == D && t->is_contiguous() &&
                    t->scalar_type() == x.scalar_type(),
                "rotary: cos and sin must be contiguous [", B, ", ", L, ", ", D, "] in x's dtype");
  // laid out [batch, tokens, heads, head_dim], as a projection viewed per head and transposed is
  at::Tensor out = at::empty({B, L, H, D}, x.options()).transpose(1, 2);
  const int64_t sb = x.stride(0), sh = x.stride(1), sl = x.stride(2);
  const int64_t ob = out.stride(0), oh = out.stride(1), ol = out.stride(2);
  for_each_float_type(x, "rotary", [&](auto zero) {
    using T = decltype(zero);
    const T *src = x.data_ptr<T>(), *c = cos.data_ptr<T>(), *s = sin.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    at::parallel_for(0, B * L, grain(H * D), [&](int64_t begin, int64_t end) {
      for (int64_t bl = begin; bl < end; ++bl) {
        const int64_t b = bl / L, l = bl % L;
        for (int64_t h = 0; h < H; ++h) {
          rotary_row(src + b * sb + h * sh + l * sl, c + bl * D, s + bl * D, dst + b * ob + h * oh + l * ol, D / 2);
        }
      }
    });
  });
  return out;
}
