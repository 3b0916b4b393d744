// One register of float lanes with GCC vector extensions: 16 under AVX-512, 8 under AVX2 (the
// build's -march decides, see engine/backends/cpu_kernels.py); loads that widen float32/bfloat16/
// float16 to float32, stores that round back as torch does, exp for x <= 0, and the float-type
// dispatch. Shared by the CPU kernels in this folder; none of them assumes a lane count.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>

namespace cbserve {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
typedef float vfloat __attribute__((vector_size(4 * kLanes)));
typedef uint16_t vu16 __attribute__((vector_size(2 * kLanes)));
typedef uint32_t vu32 __attribute__((vector_size(4 * kLanes)));
typedef int32_t vint __attribute__((vector_size(4 * kLanes)));

// keeps v in a register: stops the compiler from folding its load into every use
#if defined(__AVX512F__)
#define CB_KEEP_IN_REGISTER(v) asm("" : "+v"(v))
#else
#define CB_KEEP_IN_REGISTER(v) asm("" : "+x"(v))
#endif

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vfloat load(const c10::BFloat16* p) {  // exact: a bfloat16 is the top half of a float32
  vu16 h;
  std::memcpy(&h, p, sizeof(h));
  vu32 w = __builtin_convertvector(h, vu32) << 16;
  vfloat v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}
inline vfloat load(const c10::Half* p) {
  vfloat v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}

inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }
// float32 -> bfloat16 bits (in the high half, low half zero): round to nearest even, NaN to the
// quiet NaN, as c10::BFloat16's own conversion does
inline vu32 bf16_bits(vfloat v) {
  vu32 u;
  std::memcpy(&u, &v, sizeof(u));
  const vu32 r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  return v != v ? vu32{} + 0x7fc00000u : r;
}
inline vfloat round_bf16(vfloat v) {
  const vu32 r = bf16_bits(v);
  vfloat out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
}
inline void store(c10::BFloat16* p, vfloat v) {
  const vu16 h = __builtin_convertvector(bf16_bits(v) >> 16, vu16);
  std::memcpy(p, &h, sizeof(h));
}
inline void store(c10::Half* p, vfloat v) {
  for (int i = 0; i < kLanes; ++i) p[i] = c10::Half(v[i]);
}

// exp(x) for x <= 0: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, degree-6 polynomial (relative
// error ~1e-7, like std::exp in float); below -87 the result is tiny, not 0.
inline vfloat exp_neg(vfloat x) {
  const vfloat lo = vfloat{} - 87.0f;
  x = x < lo ? lo : x;
  const vfloat n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f + (vfloat{} - 0.5f), vint), vfloat);
  vfloat r = x - n * 0.693359375f;  // ln2 in two parts, so r stays exact
  r = r + n * 2.12194440e-4f;
  vfloat p = vfloat{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// f(zero of the element type) for a float32, bfloat16 or float16 tensor; an error naming `name` otherwise
template <typename F>
void for_each_float_type(const at::Tensor& t, const char* name, F f) {
  switch (t.scalar_type()) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, name, ": float32, bfloat16 or float16 expected");
  }
}

// logits [rows, vocab] with vocab > 0 and contiguous rows, or an error naming the kernel
inline void check_logits(const at::Tensor& logits, const char* name) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1, name,
              ": logits must be [rows, vocab] with vocab > 0 and contiguous rows");
}

inline float hsum(vfloat v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

}  // namespace cbserve
