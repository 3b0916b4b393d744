// Linear layers for the few rows of a decode step: y = x W^T + b on weights packed once into
// panels of kNR output columns (two vectors), K-major inside a panel, so that one product streams
// each weight once from memory and spends it on every row of x while it sits in L1.
//
// oneDNN's packed product, which serves prompt steps, reaches 50-85 GFLOP/s here for 16 rows of
// SmolLM2's shapes on AVX2 (a quarter to a half of two cores' peak); this one keeps a block of
// kMR rows x kNR columns of sums in registers (12 of 16 AVX2 registers, 24 of 32 AVX-512 ones) and
// runs kc = 256 steps of k on it at a time, so the panel's chunk (16 KiB in float32) stays in L1
// for the next block of rows. The panels hold the weight's own dtype (float32, bfloat16 or float16,
// widened on load), so a bfloat16 model reads half the bytes a float32 one does; sums are float32.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using namespace cbserve;

constexpr int64_t kNR = 2 * kLanes;           // output columns of a panel: two vectors
constexpr int64_t kMR = kLanes == 16 ? 12 : 6;  // rows of x per register block
constexpr int64_t kKC = 256;                  // steps of k per pass over a block
constexpr int64_t kMC = 16 * kMR;             // rows of x per pass over the panels (L2-sized)

template <typename W>
void pack_into(const W* w, W* out, int64_t n, int64_t k) {
  const int64_t panels = (n + kNR - 1) / kNR;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      W* dst = out + p * k * kNR;
      for (int64_t j = 0; j < kNR; ++j) {
        const int64_t col = p * kNR + j;
        for (int64_t i = 0; i < k; ++i) dst[i * kNR + j] = col < n ? w[col * k + i] : W(0.0f);
      }
    }
  });
}

// acc[R rows][kNR] += x[R rows][k0:k0+kc] * panel[k0:k0+kc][kNR]; x rows `ldx` floats apart. With
// `ahead`, steps of weights from there on are prefetched as it goes, one every `every` steps (a
// share of the next chunk: its first block of rows then finds it in cache instead of waiting for
// memory)
template <int R, typename W>
inline void block(const float* x, int64_t ldx, const W* panel, int64_t kc, float* acc, const W* ahead,
                  int64_t every) {
  vfloat lo[R], hi[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    lo[r] = load(acc + r * kNR);
    hi[r] = load(acc + r * kNR + kLanes);
  }
  for (int64_t i = 0, j = 0, due = 0; i < kc; ++i) {
    if (ahead && i == due) {  // one step of the next chunk every `every` steps
      __builtin_prefetch(ahead + j * kNR);
      if (kNR * sizeof(W) > 64) __builtin_prefetch(ahead + j * kNR + 64 / sizeof(W));
      ++j;
      due += every;
    }
    const vfloat b0 = load(panel + i * kNR);
    const vfloat b1 = load(panel + i * kNR + kLanes);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const float a = x[r * ldx + i];
      lo[r] += a * b0;
      hi[r] += a * b1;
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    store(acc + r * kNR, lo[r]);
    store(acc + r * kNR + kLanes, hi[r]);
  }
}

template <typename W>
inline void block_rows(int64_t rows, const float* x, int64_t ldx, const W* panel, int64_t kc, float* acc,
                       const W* ahead, int64_t every) {
  switch (rows) {
#define CB_ROWS(R) \
  case R: return block<R>(x, ldx, panel, kc, acc, ahead, every);
    CB_ROWS(1) CB_ROWS(2) CB_ROWS(3) CB_ROWS(4) CB_ROWS(5) CB_ROWS(6)
#if defined(__AVX512F__)
    CB_ROWS(7) CB_ROWS(8) CB_ROWS(9) CB_ROWS(10) CB_ROWS(11) CB_ROWS(12)
#endif
#undef CB_ROWS
  }
}

template <typename W, typename T>
void linear_impl(const float* x, const W* panels, const T* bias, T* y, int64_t m, int64_t n, int64_t k) {
  const int64_t num_panels = (n + kNR - 1) / kNR;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t grain = std::max<int64_t>(1, num_panels / threads);
  at::parallel_for(0, num_panels, grain, [&](int64_t p0, int64_t p1) {
    std::vector<float> acc(std::min(m, kMC) * kNR);
    // a half-precision panel read by more than one block of rows: widened once per chunk instead
    const bool widen = !std::is_same<W, float>::value && m > kMR;
    std::vector<float> wide(widen ? kKC * kNR : 0);
    for (int64_t mc0 = 0; mc0 < m; mc0 += kMC) {  // rows of x that stay in L2 while every panel passes
      const int64_t mc = std::min(kMC, m - mc0);
      const float* xc = x + mc0 * k;
      // the rows in blocks of nearly equal size (16 rows: 8 + 8, not 12 + 4): a block of few rows
      // spends each weight it loads on few sums
      const int64_t blocks = (mc + kMR - 1) / kMR;
      const auto rows_of = [&](int64_t b) { return mc / blocks + (b < mc % blocks ? 1 : 0); };
      for (int64_t p = p0; p < p1; ++p) {
        const W* panel = panels + p * k * kNR;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t k0 = 0; k0 < k; k0 += kKC) {
          const int64_t kc = std::min(kKC, k - k0);
          const W* chunk = panel + k0 * kNR;
          const W* next = chunk + kc * kNR;  // the next chunk, of this panel or the next one
          if (widen) {
            for (int64_t i = 0; i < kc * kNR; i += kLanes) store(wide.data() + i, load(chunk + i));
            for (int64_t b = 0, m0 = 0; b < blocks; m0 += rows_of(b), ++b)
              block_rows<float>(rows_of(b), xc + m0 * k + k0, k, wide.data(), kc, acc.data() + m0 * kNR, nullptr, 1);
          } else {
            // the next chunk's steps prefetched evenly over every block of rows (a share each, one
            // step every `blocks` steps): its memory traffic then runs beside all of the chunk's sums
            // instead of in a burst beside the first block's
            const int64_t share = (kKC + blocks - 1) / blocks;
            for (int64_t b = 0, m0 = 0; b < blocks; m0 += rows_of(b), ++b)
              block_rows(rows_of(b), xc + m0 * k + k0, k, chunk, kc, acc.data() + m0 * kNR, next + b * share * kNR,
                         blocks);
          }
        }
        const int64_t c0 = p * kNR, width = std::min(kNR, n - c0);
        for (int64_t r = 0; r < mc; ++r)
          for (int64_t j = 0; j < width; ++j) {
            const float b = bias ? static_cast<float>(bias[c0 + j]) : 0.0f;
            y[(mc0 + r) * n + c0 + j] = static_cast<T>(acc[r * kNR + j] + b);
          }
      }
    }
  });
}

}  // namespace

// weight [N, K] -> panels [ceil(N / kNR), K, kNR] in the weight's dtype, zero past column N
at::Tensor pack_linear_weight(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu(), "pack_linear_weight: a 2-d CPU weight expected");
  weight = weight.contiguous();
  const int64_t n = weight.size(0), k = weight.size(1);
  auto out = at::empty({(n + kNR - 1) / kNR, k, kNR}, weight.options());
  for_each_float_type(weight, "pack_linear_weight", [&](auto zero) {
    using W = decltype(zero);
    pack_into(weight.data_ptr<W>(), out.data_ptr<W>(), n, k);
  });
  return out;
}

// x [M, K] (float32, bfloat16 or float16) times the packed weight of `n` outputs, plus `bias`
// (or None): [M, n] in x's dtype, summed in float32
at::Tensor packed_linear(at::Tensor x, at::Tensor panels, c10::optional<at::Tensor> bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == kNR, "packed_linear: x [M, K] and panels from pack_linear_weight expected");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(panels.size(1) == k && panels.size(0) == (n + kNR - 1) / kNR, "packed_linear: panels do not match x and n");
  auto xf = x.to(at::kFloat).contiguous();
  auto y = at::empty({m, n}, x.options());
  at::Tensor b = bias.has_value() ? bias->to(x.scalar_type()).contiguous() : at::Tensor();
  for_each_float_type(panels, "packed_linear", [&](auto wzero) {
    using W = decltype(wzero);
    for_each_float_type(x, "packed_linear", [&](auto xzero) {
      using T = decltype(xzero);
      linear_impl<W, T>(xf.data_ptr<float>(), panels.data_ptr<W>(), b.defined() ? b.data_ptr<T>() : nullptr,
                        y.data_ptr<T>(), m, n, k);
    });
  });
  return y;
}

int64_t linear_panel_width() { return kNR; }
