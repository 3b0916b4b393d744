// Decode attention over the paged KV cache on the CPU: one query token per sequence, keys and
// values read in place through the block table (no gather, no padding to the longest sequence).
//
// Work is split over whole sequences (over (sequence, KV head) when there are few): an item walks its
// sequence's tokens in order and reads each cache row once per step, for all the query heads that
// share its KV heads. Scores, softmax and the weighted sum accumulate in float32 whatever the cache
// dtype (float32, bfloat16, float16). Every index is checked before any memory is read.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// 16 float lanes: one AVX-512 register, or two AVX2 ones (GCC vector extensions, -march=native).
typedef float vfloat __attribute__((vector_size(64)));
typedef uint16_t vu16 __attribute__((vector_size(32)));
typedef uint32_t vu32 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vfloat load(const c10::BFloat16* p) {
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
typedef float vfloat8 __attribute__((vector_size(32)));
typedef float vfloat4 __attribute__((vector_size(16)));
typedef int32_t vint __attribute__((vector_size(64)));

// horizontal sum by halving (16 -> 8 -> 4 -> 1 lanes)
inline float hsum(vfloat v) {
  vfloat8 lo, hi;
  std::memcpy(&lo, &v, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
  const vfloat8 s8 = lo + hi;
  vfloat4 a, b;
  std::memcpy(&a, &s8, sizeof(a));
  std::memcpy(&b, reinterpret_cast<const char*>(&s8) + sizeof(a), sizeof(b));
  const vfloat4 s4 = a + b;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// exp(x) for x <= 0 on 16 lanes: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, degree-6 polynomial
// (relative error ~1e-7, like std::exp in float); below -87 the result flushes to 0.
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

template <typename T>
const T* row(const T* cache, const int32_t* table, int64_t pos, int64_t block_size, int64_t row_stride) {
  return cache + (static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size) * row_stride;
}

// One work item: sequence `seq`, KV heads [h0, h1). Tokens are walked in order and all the item's
// heads of a cache row are read together, so a block is one sequential sweep of memory.
template <typename T>
struct Decode {
  T* out;
  const T *q, *k_cache, *v_cache;
  const int32_t* block_tables;
  const int64_t* seq_lens;
  int64_t num_heads, num_kv_heads, head_dim, v_dim, block_size, max_blocks, window;
  float scale;

  void run(int64_t seq, int64_t h0, int64_t h1, std::vector<vfloat>& qv, std::vector<vfloat>& acc,
           std::vector<float>& scores) const {
    const int64_t group = num_heads / num_kv_heads, heads = (h1 - h0) * group;
    const int64_t kc = head_dim / kLanes, vc = v_dim / kLanes;
    const int64_t k_row = num_kv_heads * head_dim, v_row = num_kv_heads * v_dim;
    const int64_t len = seq_lens[seq];
    const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int64_t n = len - first;
    const int32_t* table = block_tables + seq * max_blocks;
    qv.resize(heads * kc);
    acc.assign(heads * vc, vfloat{});
    scores.resize(heads * n);
    const T* qs = q + (seq * num_heads + h0 * group) * head_dim;  // the item's query heads are contiguous
    for (int64_t c = 0; c < heads * kc; ++c) qv[c] = load(qs + c * kLanes) * scale;
    // scores[h, t] = q_h . k_t
    for (int64_t t = 0; t < n; ++t) {
      const T* kr = row(k_cache, table, first + t, block_size, k_row);
      for (int64_t kvh = h0; kvh < h1; ++kvh) {
        const T* kh = kr + kvh * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = (kvh - h0) * group + g;
          const vfloat* qh = qv.data() + h * kc;
          vfloat s = qh[0] * load(kh);
          for (int64_t c = 1; c < kc; ++c) s += qh[c] * load(kh + c * kLanes);
          scores[h * n + t] = hsum(s);
        }
      }
    }
    // softmax numerators; the division happens once at the end
    float total[256];
    for (int64_t h = 0; h < heads; ++h) {
      float* sh = scores.data() + h * n;
      float m = -INFINITY;
      for (int64_t t = 0; t < n; ++t) m = std::max(m, sh[t]);
      vfloat vsum{};
      int64_t t = 0;
      for (; t + kLanes <= n; t += kLanes) {
        vfloat e = exp_neg(load(sh + t) - m);
        std::memcpy(sh + t, &e, sizeof(e));
        vsum += e;
      }
      float sum = hsum(vsum);
      for (; t < n; ++t) {
        sh[t] = std::exp(sh[t] - m);
        sum += sh[t];
      }
      total[h] = sum;
    }
    // acc[h] = sum_t p[h, t] v_t
    for (int64_t t = 0; t < n; ++t) {
      const T* vr = row(v_cache, table, first + t, block_size, v_row);
      for (int64_t kvh = h0; kvh < h1; ++kvh) {
        const T* vh = vr + kvh * v_dim;
        for (int64_t c = 0; c < vc; ++c) {
          const vfloat v = load(vh + c * kLanes);
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = (kvh - h0) * group + g;
            acc[h * vc + c] += scores[h * n + t] * v;
          }
        }
      }
    }
    T* os = out + (seq * num_heads + h0 * group) * v_dim;
    for (int64_t h = 0; h < heads; ++h) {
      const float inv = 1.0f / total[h];
      for (int64_t c = 0; c < vc; ++c)
        for (int i = 0; i < kLanes; ++i) os[(h * vc + c) * kLanes + i] = static_cast<T>(acc[h * vc + c][i] * inv);
    }
  }
};

template <typename T>
void decode_kernel(const Decode<T>& d, int64_t num_seqs) {
  // whole sequences per item when there are enough of them; otherwise one KV head per item
  const int64_t split = num_seqs >= 4 * at::get_num_threads() ? 1 : d.num_kv_heads;
  const int64_t per_item = d.num_kv_heads / split;
  at::parallel_for(0, num_seqs * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<vfloat> qv, acc;
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h0 = (item % split) * per_item;
      d.run(item / split, h0, h0 + per_item, qv, acc, scores);
    }
  });
}

}  // namespace

// out [B, H, Dv], q [B, H, D], k_cache [N, bs, Hkv, D], v_cache [N, bs, Hkv, Dv],
// block_tables int32 [B, max_blocks], seq_lens int64 [B]; window <= 0 means no sliding window.
void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(out.is_contiguous() && q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention: tensors must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.is_contiguous(),
              "paged_decode_attention: block_tables must be contiguous int32");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt64, "paged_decode_attention: seq_lens must be int64");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
              "paged_decode_attention: dtypes differ");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2), v_dim = v_cache.size(3);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && num_heads <= 256,
              "paged_decode_attention: at most 256 query heads, a whole multiple of the KV heads");
  TORCH_CHECK(head_dim % 16 == 0 && v_dim % 16 == 0, "paged_decode_attention: head dims must be multiples of 16");
  TORCH_CHECK(v_cache.scalar_type() == q.scalar_type() && v_cache.size(0) == k_cache.size(0) &&
                  v_cache.size(1) == block_size && v_cache.size(2) == num_kv_heads,
              "paged_decode_attention: the V cache does not match the K cache");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs && seq_lens.numel() == num_seqs &&
                  out.size(0) == num_seqs && out.size(1) == num_heads && out.size(2) == v_dim,
              "paged_decode_attention: one block-table row, one length and one output row per sequence");
  const int64_t max_blocks = block_tables.size(1), num_blocks = k_cache.size(0);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t b = 0; b < num_seqs; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * block_size,
                "paged_decode_attention: sequence length outside its block table");
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tables[b * max_blocks + i] >= 0 && tables[b * max_blocks + i] < num_blocks,
                  "paged_decode_attention: block id outside the cache");
  }
  auto run = [&](auto zero) {
    using T = decltype(zero);
    const Decode<T> d{out.data_ptr<T>(), q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), tables,
                      lens, num_heads, num_kv_heads, head_dim, v_dim, block_size, max_blocks, window,
                      static_cast<float>(scale)};
    decode_kernel(d, num_seqs);
  };
  switch (q.scalar_type()) {
    case torch::kFloat: run(float{}); break;
    case torch::kBFloat16: run(c10::BFloat16{}); break;
    case torch::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "paged_decode_attention: float32, bfloat16 or float16 expected");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Decode attention over the paged KV cache (CPU)");
}
