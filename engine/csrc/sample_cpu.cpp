// A step's sampled tokens on the CPU in one pass over each row's logits: the exponential race.
//
// Drawing token i with probability softmax(l / T)_i is the same as taking the i with the largest
// p_i / E_i for independent E_i ~ Exp(1), or, in logs, the largest l_i / T - log(E_i), with
// E_i = -log(u_i) and u_i uniform in [0, 1) (the Gumbel-max form). Here that is one pass: no
// softmax, no float32 copy of bfloat16 logits, no [rows, vocab] noise tensor, the row split over
// the threads in chunks. A row with T <= 0 takes its first largest logit (greedy).
//
// Top-p and min-p are a cut on the scaled logit s = l / T, found per row before the race (`row_cut`):
// min-p keeps s >= max s + log(min_p) (a probability at least min_p times the largest); top-p keeps
// the tokens ranked (by s, ties by index) before the cumulative probability reaches top_p, the one
// that reaches it included, as a sort of the row would. The boundary is found without sorting: the
// probability mass of the row is bucketed by the bits of s (12, 12 and 8 bits, one pass over the
// row and two over the boundary bucket's tokens), then the tokens tied at the boundary value are kept
// in index order. The mass is summed in double, so at a boundary a few ulps wide it may cut where
// torch's float32 cumsum does not.
//
// The uniforms come from Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
// 3", SC 2011; the generator torch's CUDA and cuRAND use), a counter-based generator: u_i is a
// function of the row's (key, counter) and i alone: token i of a row reads block i / 4 of the
// stream, counter words {i / 4, 0, counter low, counter high}, key words {key low, key high}, and
// takes word i % 4, its top 24 bits over 2^24. So a draw does not depend on the other rows, on
// the threads or on the build (integer arithmetic, and the two logs below are the same
// polynomial in every build).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace cbserve;

typedef uint64_t vu64 __attribute__((vector_size(8 * kLanes)));

constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
constexpr int64_t kChunk = 4096;  // tokens a work item: a multiple of 4 * kLanes

struct Words {
  vu32 x0, x1, x2, x3;
};

// Philox4x32-10 on kLanes counters at once (their first words `block`, the others shared)
inline Words philox(vu32 block, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  Words w{block, vu32{}, vu32{} + c2, vu32{} + c3};
  for (int round = 0; round < 10; ++round) {
    if (round) k0 += kW0, k1 += kW1;
    const vu64 p0 = __builtin_convertvector(w.x0, vu64) * kM0;
    const vu64 p1 = __builtin_convertvector(w.x2, vu64) * kM1;
    const vu32 hi0 = __builtin_convertvector(p0 >> 32, vu32), lo0 = __builtin_convertvector(p0, vu32);
    const vu32 hi1 = __builtin_convertvector(p1 >> 32, vu32), lo1 = __builtin_convertvector(p1, vu32);
    w = Words{hi1 ^ w.x1 ^ k0, lo1, hi0 ^ w.x3 ^ k1, lo0};
  }
  return w;
}

// The 4 * n uniforms' bits of blocks [block0, block0 + n), in token order
void uniform_bits(int64_t block0, int64_t n, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1, uint32_t* out) {
  vu32 lane;
  for (int j = 0; j < kLanes; ++j) lane[j] = static_cast<uint32_t>(j);
  for (int64_t b = 0; b < n; b += kLanes) {
    const Words w = philox(lane + static_cast<uint32_t>(block0 + b), c2, c3, k0, k1);
    const int64_t m = std::min<int64_t>(kLanes, n - b);
    for (int64_t j = 0; j < m; ++j) {
      uint32_t* o = out + 4 * (b + j);
      o[0] = w.x0[j], o[1] = w.x1[j], o[2] = w.x2[j], o[3] = w.x3[j];
    }
  }
}

// log(x) for x >= 0 (0 -> -inf, +inf -> +inf): x = m 2^e with m in [sqrt(1/2), sqrt(2)), a degree-9
// polynomial in m - 1 (Cephes' logf; relative error about 1e-7), ln 2 in two parts
inline vfloat log_pos(vfloat x) {
  vint bits;
  std::memcpy(&bits, &x, sizeof(bits));
  vint e = (bits >> 23) - 127;
  vint mbits = (bits & 0x007fffff) | 0x3f800000;  // m in [1, 2)
  vfloat m;
  std::memcpy(&m, &mbits, sizeof(m));
  const vint big = m > 1.41421356f;
  m = big ? m * 0.5f : m;
  e = big ? e + 1 : e;
  const vfloat f = m - 1.0f, z = f * f;
  vfloat p = vfloat{} + 7.0376836292e-2f;
  p = p * f - 1.1514610310e-1f;
  p = p * f + 1.1676998740e-1f;
  p = p * f - 1.2420140846e-1f;
  p = p * f + 1.4249322787e-1f;
  p = p * f - 1.6668057665e-1f;
  p = p * f + 2.0000714765e-1f;
  p = p * f - 2.4999993993e-1f;
  p = p * f + 3.3333331174e-1f;
  const vfloat ef = __builtin_convertvector(e, vfloat);
  vfloat y = p * f * z + ef * -2.12194440e-4f - z * 0.5f;
  y = f + y + ef * 0.693359375f;
  const vfloat inf = vfloat{} + std::numeric_limits<float>::infinity();
  y = x == 0.0f ? -inf : y;
  return x == inf ? inf : y;
}

struct Best {
  float score;
  int64_t index;
};

// The tokens a row keeps: s > floor, or s == floor at an index up to last_tied
struct Cut {
  float floor = -std::numeric_limits<float>::infinity();
  int64_t last_tied = std::numeric_limits<int64_t>::max();
};

// s's float order as unsigned order (-0 as +0: they compare equal)
inline uint32_t order_key(float s) {
  uint32_t b;
  std::memcpy(&b, &s, sizeof(b));
  if (b == 0x80000000u) b = 0;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

inline float from_order_key(uint32_t k) {
  const uint32_t b = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
  float s;
  std::memcpy(&s, &b, sizeof(s));
  return s;
}

template <typename T>
inline float scaled(const T* row, int64_t i, float inv_t) {
  return static_cast<float>(row[i]) * inv_t;  // the race's s, the same float product
}

// order_key of each lane
inline vu32 order_keys(vfloat s) {
  vu32 b;
  std::memcpy(&b, &s, sizeof(b));
  b = b == 0x80000000u ? vu32{} : b;
  return (b & 0x80000000u) != 0u ? ~b : (b | 0x80000000u);
}

// The cut of one row for top_p (< 1: on) and min_p (> 0: on)
template <typename T>
Cut row_cut(const T* row, int64_t n, float inv_t, float top_p, float min_p) {
  const float lowest = -std::numeric_limits<float>::infinity();
  const int64_t whole = n / kLanes * kLanes;
  std::vector<float> e(n + kLanes);
  vfloat vm = vfloat{} + lowest;
  for (int64_t i = 0; i < whole; i += kLanes) {  // the race's s, the same float product
    const vfloat v = load(row + i) * inv_t;
    store(e.data() + i, v);
    vm = v > vm ? v : vm;
  }
  float m = lowest;
  for (int i = 0; i < kLanes; ++i) m = std::max(m, vm[i]);
  for (int64_t i = whole; i < n; ++i) e[i] = scaled(row, i, inv_t), m = std::max(m, e[i]);
  Cut cut;
  if (!(m > lowest)) return cut;  // nothing finite: the race's own choice
  if (min_p > 0.0f) cut.floor = m + std::log(min_p);
  if (!(top_p < 1.0f)) return cut;
  std::vector<uint32_t> keys(n + kLanes);
  for (int64_t i = 0; i < whole; i += kLanes) {
    const vu32 k = order_keys(load(e.data() + i));
    std::memcpy(keys.data() + i, &k, sizeof(k));
  }
  for (int64_t i = whole; i < n; ++i) keys[i] = order_key(e[i]);
  for (int64_t i = 0; i < n; i += kLanes) {  // each token's probability times the row's sum
    const vfloat s = load(e.data() + i);
    store(e.data() + i, s == lowest ? vfloat{} : exp_neg(s - m));
  }
  // the mass of the buckets of the next bits of the key: over the row, then over the tokens whose
  // key starts with the boundary bucket's bits (listed once, in index order, so every sum adds the
  // same terms in the same order as a scan of the row would)
  std::vector<double> mass(4096);
  std::vector<uint32_t> count(4096);
  std::vector<int64_t> inside;
  uint32_t prefix = 0;
  int known = 0;  // bits of the boundary key found
  double above = 0.0, target = 0.0;
  for (const int bits : {12, 12, 8}) {
    std::fill(mass.begin(), mass.end(), 0.0);
    std::fill(count.begin(), count.end(), 0u);
    const int shift = 32 - known - bits;
    auto add = [&](int64_t i) {
      const uint32_t b = (keys[i] >> shift) & ((1u << bits) - 1);
      mass[b] += e[i];
      ++count[b];
    };
    if (!known) {
      for (int64_t i = 0; i < n; ++i) add(i);
      double total = 0.0;
      for (int b = 0; b < 4096; ++b) total += mass[b];
      target = static_cast<double>(top_p) * total;
    } else {
      for (const int64_t i : inside) add(i);
    }
    int b = (1 << bits) - 1;
    for (; b > 0; --b) {  // from the largest s down: the bucket where the mass reaches the target
      if (count[b] && above + mass[b] >= target) break;
      above += mass[b];
    }
    prefix = (prefix << bits) | static_cast<uint32_t>(b);
    known += bits;
    if (known == 12) {
      for (int64_t i = 0; i < n; ++i)
        if ((keys[i] >> 20) == prefix) inside.push_back(i);
    } else {
      inside.erase(std::remove_if(inside.begin(), inside.end(), [&](int64_t i) { return (keys[i] >> (32 - known)) != prefix; }),
                   inside.end());
    }
  }
  // `prefix` is the boundary value's key and `above` the mass of the larger tokens: the tied ones
  // are kept in index order while the mass before them is short of the target
  int64_t last = -1;
  for (const int64_t i : inside) {
    if (!(above < target)) break;
    above += e[i], last = i;
  }
  const float v = from_order_key(prefix);
  if (v >= cut.floor) cut = Cut{v, last};  // the tighter of the two cuts
  return cut;
}

// The largest score of tokens [begin, end) of one row among those `cut` keeps, ties to the first
template <typename T>
Best race_chunk(const T* row, int64_t begin, int64_t end, float inv_t, bool greedy, const Cut& cut, uint32_t c2,
                uint32_t c3, uint32_t k0, uint32_t k1) {
  alignas(64) uint32_t bits[kChunk];
  // whole registers of blocks: a chunk's tokens are a multiple of 4 * kLanes but for a row's last
  if (!greedy) uniform_bits(begin / 4, (end - begin + 4 * kLanes - 1) / (4 * kLanes) * kLanes, c2, c3, k0, k1, bits);
  const vfloat ninf = vfloat{} - std::numeric_limits<float>::infinity();
  const int32_t last_tied = static_cast<int32_t>(std::min<int64_t>(cut.last_tied, std::numeric_limits<int32_t>::max()));
  vfloat top = ninf;
  vint at{};
  vint lane;
  for (int j = 0; j < kLanes; ++j) lane[j] = j;
  for (int64_t i = begin; i < end; i += kLanes) {
    vfloat l;
    if (end - i >= kLanes) {
      l = load(row + i);
    } else {  // the row's last tokens: the rest of the register at -inf, which never wins
      l = ninf;
      for (int64_t j = 0; j < end - i; ++j) l[j] = static_cast<float>(row[i + j]);
    }
    vfloat score = l;
    if (!greedy) {
      vu32 u;
      std::memcpy(&u, bits + (i - begin), sizeof(u));
      const vfloat uniform = __builtin_convertvector(vint(u >> 8), vfloat) * (1.0f / 16777216.0f);
      const vfloat s = l * inv_t;
      score = s - log_pos(vfloat{} - log_pos(uniform));  // a u of 0: E = inf, a score of -inf
      if (cut.floor > -std::numeric_limits<float>::infinity()) {
        const vint kept = (s > cut.floor) | ((s == cut.floor) & (lane + static_cast<int32_t>(i) <= last_tied));
        score = kept ? score : ninf;
      }
    }
    const vint index = lane + static_cast<int32_t>(i);
    const vint better = score > top;
    top = better ? score : top;
    at = better ? index : at;
  }
  const float lowest = -std::numeric_limits<float>::infinity();
  Best best{lowest, begin};
  for (int j = 0; j < kLanes; ++j)  // (a lane that never beat -inf holds no index of this chunk)
    if (top[j] > best.score || (top[j] == best.score && top[j] != lowest && at[j] < best.index)) best = Best{top[j], at[j]};
  return best;
}

}  // namespace

// tokens [rows] (int64): each row's winner of the race at temperature[r] (<= 0: greedy) among the
// tokens top_p[r] (1: off) and min_p[r] (0: off) keep, its uniforms from Philox with key keys[r]
// and counter counters[r]
at::Tensor sample_race(at::Tensor logits, at::Tensor temperature, at::Tensor top_p, at::Tensor min_p, at::Tensor keys,
                       at::Tensor counters) {
  check_logits(logits, "sample_race");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(vocab < (int64_t{1} << 31), "sample_race: a vocabulary under 2^31 tokens");
  for (const at::Tensor* t : {&temperature, &top_p, &min_p, &keys, &counters})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows && t->is_contiguous(),
                "sample_race: one temperature, top_p, min_p, key and counter a row");
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && top_p.scalar_type() == at::kFloat &&
                  min_p.scalar_type() == at::kFloat && keys.scalar_type() == at::kLong &&
                  counters.scalar_type() == at::kLong,
              "sample_race: temperature, top_p and min_p float32, keys and counters int64");
  const float* temp = temperature.data_ptr<float>();
  const float* tp = top_p.data_ptr<float>();
  const float* mp = min_p.data_ptr<float>();
  const int64_t* key = keys.data_ptr<int64_t>();
  const int64_t* counter = counters.data_ptr<int64_t>();
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  std::vector<Best> partial(rows * chunks);
  std::vector<Cut> cuts(rows);
  std::vector<int64_t> cut_rows;  // sampled rows with a top-p or min-p
  for (int64_t r = 0; r < rows; ++r)
    if (temp[r] > 0.0f && (tp[r] < 1.0f || mp[r] > 0.0f)) cut_rows.push_back(r);
  auto run = [&](auto zero) {
    using T = decltype(zero);
    const T* src = logits.data_ptr<T>();
    at::parallel_for(0, static_cast<int64_t>(cut_rows.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) {
        const int64_t r = cut_rows[j];
        cuts[r] = row_cut(src + r * stride, vocab, 1.0f / temp[r], tp[r], mp[r]);
      }
    });
    at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t r = item / chunks, c = item % chunks;
        const bool greedy = !(temp[r] > 0.0f);
        const uint64_t k = static_cast<uint64_t>(key[r]), n = static_cast<uint64_t>(counter[r]);
        partial[item] = race_chunk(src + r * stride, c * kChunk, std::min(vocab, (c + 1) * kChunk),
                                   greedy ? 1.0f : 1.0f / temp[r], greedy, cuts[r], static_cast<uint32_t>(n),
                                   static_cast<uint32_t>(n >> 32), static_cast<uint32_t>(k), static_cast<uint32_t>(k >> 32));
      }
    });
  };
  for_each_float_type(logits, "sample_race", run);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* dst = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    Best best = partial[r * chunks];
    for (int64_t c = 1; c < chunks; ++c)
      if (partial[r * chunks + c].score > best.score) best = partial[r * chunks + c];
    dst[r] = best.index;
  }
  return out;
}

// log(sum(exp(row))) of each row [rows] (float32), read in the logits' own dtype: the normaliser of
// the raw logprobs, without a float32 copy of the logits or a temporary of their size. A row of -inf
// only: -inf.
at::Tensor logsumexp_rows(at::Tensor logits) {
  check_logits(logits, "logsumexp_rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  const float lowest = -std::numeric_limits<float>::infinity();
  auto run = [&](auto zero) {
    using T = decltype(zero);
    const T* src = logits.data_ptr<T>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* row = src + r * stride;
        const int64_t body = vocab / kLanes * kLanes;
        vfloat top = vfloat{} + lowest;
        for (int64_t i = 0; i < body; i += kLanes) {
          const vfloat v = load(row + i);
          top = v > top ? v : top;
        }
        float m = lowest;
        for (int j = 0; j < kLanes; ++j) m = std::max(m, top[j]);
        for (int64_t i = body; i < vocab; ++i) m = std::max(m, static_cast<float>(row[i]));
        if (!(m > lowest) || std::isinf(m)) {  // all -inf (or a +inf): what torch's logsumexp gives
          dst[r] = m;
          continue;
        }
        vfloat sum{};
        for (int64_t i = 0; i < body; i += kLanes) sum += exp_neg(load(row + i) - m);
        double total = 0.0;
        for (int j = 0; j < kLanes; ++j) total += sum[j];
        for (int64_t i = body; i < vocab; ++i) total += std::exp(static_cast<double>(static_cast<float>(row[i])) - m);
        dst[r] = m + static_cast<float>(std::log(total));
      }
    });
  };
  for_each_float_type(logits, "logsumexp_rows", run);
  return out;
}

// The race's uniforms of one (key, counter): n float32 draws in [0, 1), as sample_race reads them
at::Tensor race_uniforms(int64_t key, int64_t counter, int64_t n) {
  TORCH_CHECK(n >= 0 && n < (int64_t{1} << 31), "race_uniforms: 0 <= n < 2^31");
  at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kFloat));
  std::vector<uint32_t> bits((n + 4 * kLanes - 1) / (4 * kLanes) * (4 * kLanes));
  const uint64_t k = static_cast<uint64_t>(key), c = static_cast<uint64_t>(counter);
  uniform_bits(0, bits.size() / 4, static_cast<uint32_t>(c), static_cast<uint32_t>(c >> 32), static_cast<uint32_t>(k),
               static_cast<uint32_t>(k >> 32), bits.data());
  float* dst = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(bits[i] >> 8) * (1.0f / 16777216.0f);
  return out;
}
