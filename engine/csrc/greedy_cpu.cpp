// Greedy token choice on the CPU: the index of each row's largest logit, read in the model's own
// dtype (no float32 copy of a [rows, vocab] tensor first). Ties and NaNs resolve as torch.argmax
// does: the first largest index, a NaN counting as larger than any number.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include "vec.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

using namespace cbserve;

template <typename T>
int64_t scalar_argmax(const T* row, int64_t n) {
  int64_t best = 0;
  float top = static_cast<float>(row[0]);
  if (std::isnan(top)) return 0;
  for (int64_t i = 1; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    if (v > top) top = v, best = i;
    else if (std::isnan(v)) return i;
  }
  return best;
}

// one pass for the largest value (16 lanes), one for its first index; a NaN anywhere: the scalar loop
template <typename T>
int64_t row_argmax(const T* row, int64_t n) {
  const int64_t body = n / kLanes * kLanes;
  if (body == 0) return scalar_argmax(row, n);
  vfloat top = load(row);
  vint nan{};
  for (int64_t i = 0; i < body; i += kLanes) {
    const vfloat v = load(row + i);
    top = v > top ? v : top;
    nan |= v != v;
  }
  float best = top[0];
  for (int i = 1; i < kLanes; ++i) best = std::max(best, top[i]);
  for (int64_t i = body; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    if (std::isnan(v)) return scalar_argmax(row, n);
    best = std::max(best, v);
  }
  for (int i = 0; i < kLanes; ++i)
    if (nan[i]) return scalar_argmax(row, n);
  for (int64_t i = 0; i < body; i += kLanes) {
    const vint hit = load(row + i) == best;
    for (int j = 0; j < kLanes; ++j)
      if (hit[j]) return i + j;
  }
  for (int64_t i = body; i < n; ++i)
    if (static_cast<float>(row[i]) == best) return i;
  return 0;  // not reached: best is one of the values
}

}  // namespace

at::Tensor argmax_rows(at::Tensor logits) {
  check_logits(logits, "argmax_rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* dst = out.data_ptr<int64_t>();
  auto run = [&](auto zero) {
    using T = decltype(zero);
    const T* src = logits.data_ptr<T>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) dst[r] = row_argmax(src + r * stride, vocab);
    });
  };
  for_each_float_type(logits, "argmax_rows", run);
  return out;
}
