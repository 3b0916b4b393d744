// Attention over the paged KV cache on the CPU, for every sequence of a step at once: decode tokens
// (one query), prefill chunks (many queries, causal) and chunks whose history is already cached.
// Keys and values are read in place through the block table (no gather, no padding); the step's own
// keys and values must be in the cache before the call.
//
// A work item is (sequence, KV heads, tile of queries); its rows are the tile's queries times the
// query heads that share each KV head, so each cached row is read once per item (a decode token with
// many sequences around takes all its KV heads: whole cache rows, in order). Keys are taken a tile of
// kLanes (16 under AVX-512, 8 under AVX2, vec.h) at a time. An item of many rows (prompt chunks)
// stages its keys and values as float32, four tiles at once with their rows read in turn, and gets
// q.k for a tile's keys as one vector by kQkRows rows and two transposed tiles at a time. An item of
// few rows (decode tokens) reads keys and values where they lie in the cache, a block's rows in
// order, and gets q.k by a transposing reduction of kLanes partial sums: it reads each row once, so
// a staged copy would only add a store and a load per value, and loads straight from memory overlap
// with the products. An item takes its keys a chunk at a time (512 or 256): the chunk's scores, a softmax that
// keeps each row's running max and sum (rescaling the row's sums when a later chunk's max is larger,
// as flash attention does), then p.V accumulating up to four rows at a time; so the scores stay in
// the core's own caches whatever the context's length, and the next rows of keys and values are
// prefetched while a group's products run. Everything is float32 whatever the cache dtype (float32,
// bfloat16, float16). Threads take items from a shared counter, largest first. Every index is
// checked before any memory is read.
//
// Cascade: decode tokens of sequences that share their leading cache blocks (one prompt with many
// samples, a common system prompt) attend over the shared part together, before the items run: per
// KV head, one matrix product of all their queries with the shared keys, a softmax per row that keeps
// its max and sum, and one product with the shared values. Each item then covers only its
// sequence's own keys and merges the two parts by their maxima and sums (log-sum-exp).
#include <ATen/core/Tensor.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace cbserve;

// rows (queries x grouped heads) per item in prefill chunks: each item reads its keys and values once,
// so more rows an item is less reading for a long context (64 rows ran at 0.85x the speed of 128
// over 16,384-32,768 keys, 2026-11-29)
constexpr int64_t kTileRows = 128;
constexpr int64_t kTransposeRows = 8;  // from this many rows of a head, q.k runs on a transposed key tile
constexpr int64_t kStreams = 4;  // tiles staged together, their rows read in turn (see walk)
// keys a pass of an item takes (multiples of kStreams x kLanes), so that its scores (rows x this) stay
// in the core's caches: 512 for prompt chunks (2-4% faster than 256 on the W2 and W3 prompt shapes of
// benchmarks/attention_kernel.py in two runs); 256 for decode tokens, whose
// chunk of key rows and the value rows prefetched beside them must stay in L2 until p.V (at 512,
// 1.2x the time over 16,384 keys in float32)
constexpr int64_t kPrefillKeyChunk = 512;
constexpr int64_t kDecodeKeyChunk = 256;
constexpr int64_t kPrefetchKeys = 2 * kLanes;  // how far ahead a decode token's key rows are fetched
// register blocks sized to the register file: 32 registers of 16 lanes under AVX-512, 16 of 8 under
// AVX2 (accumulators plus the loaded operands must fit, or the loops spill to the stack)
constexpr int kQkRows = kLanes == 16 ? 8 : 4;  // q.k rows against two transposed tiles: 2 x rows accumulators
constexpr int kPvChunks = kLanes == 16 ? 4 : 2;  // p.V: four rows x this many chunks of a value row

// r[i] = sum of the lanes of a[i], for kLanes vectors: rounds of pairwise shuffles and adds (45
// operations for 16 sums, against about 7 per horizontal sum).
#if defined(__AVX512F__)
inline vfloat reduce_lanes(const vfloat* a) {
  vfloat b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#else
inline vfloat reduce_lanes(const vfloat* a) {
  vfloat b[4], c[2];
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

// In-place transpose of a kLanes x kLanes float block held as kLanes rows: round k swaps bit k of
// the row index with bit k of the column index, between rows i and i + 2^k.
#define CB_SWAP(K, ...)                                            \
  for (int i = 0; i < kLanes; ++i)                                 \
    if (!(i & (1 << K))) {                                         \
      const vfloat a = r[i], b = r[i + (1 << K)];                  \
      r[i] = __builtin_shufflevector(a, b, CB_FIRST(__VA_ARGS__)); \
      r[i + (1 << K)] = __builtin_shufflevector(a, b, CB_SECOND(__VA_ARGS__)); \
    }
#if defined(__AVX512F__)
#define CB_FIRST(A0, A1, A2, A3, A4, A5, A6, A7, A8, A9, A10, A11, A12, A13, A14, A15, ...) \
  A0, A1, A2, A3, A4, A5, A6, A7, A8, A9, A10, A11, A12, A13, A14, A15
#define CB_SECOND(A0, A1, A2, A3, A4, A5, A6, A7, A8, A9, A10, A11, A12, A13, A14, A15, ...) __VA_ARGS__
inline void transpose_lanes(vfloat* r) {
  CB_SWAP(0, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31)
  CB_SWAP(1, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31)
  CB_SWAP(2, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31)
  CB_SWAP(3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31)
}
#else
#define CB_FIRST(A0, A1, A2, A3, A4, A5, A6, A7, ...) A0, A1, A2, A3, A4, A5, A6, A7
#define CB_SECOND(A0, A1, A2, A3, A4, A5, A6, A7, ...) __VA_ARGS__
inline void transpose_lanes(vfloat* r) {
  CB_SWAP(0, 0, 8, 2, 10, 4, 12, 6, 14, 1, 9, 3, 11, 5, 13, 7, 15)
  CB_SWAP(1, 0, 1, 8, 9, 4, 5, 12, 13, 2, 3, 10, 11, 6, 7, 14, 15)
  CB_SWAP(2, 0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)
}
#endif
#undef CB_FIRST
#undef CB_SECOND
#undef CB_SWAP

// the cache lines of [p, p + bytes) on their way to this core's caches: with Locality 3 (prefetcht0)
// into L1, with 1 (prefetcht2) into L2 only
template <int Locality = 3>
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 0, Locality);
}

// {0, 1, ..., kLanes - 1}
inline vint lane_index() {
  vint v;
  for (int i = 0; i < kLanes; ++i) v[i] = i;
  return v;
}

inline float hmax(vfloat v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

struct Item {
  int64_t seq, h0, h1, q0, q1, cost;  // KV heads [h0, h1), queries [q0, q1) of the sequence's chunk
};

struct Scratch {
  std::vector<float> q, keys, keys_t, values, scores, acc, total, max;
};

// Decode sequences that share their first `blocks` cache blocks
struct Share {
  std::vector<int64_t> seqs;
  int64_t blocks;
};

// The shared part's attention for each (sequence, query head) of a share: the max of its scores,
// the sum of exp(score - max), and the sum of exp(score - max) * v; keys_done[s]: keys it covers
struct Prior {
  std::vector<int64_t> keys_done;
  std::vector<float> max, total, acc;
};

template <typename T>
struct Attention {
  T* out;
  const T *q, *k_cache, *v_cache;
  const int32_t *block_tables, *k_lens, *q_start;
  int64_t q_stride_t, q_stride_h;
  int64_t num_heads, num_kv_heads, head_dim, v_dim, block_size, max_blocks, window;
  float scale;
  const Prior* prior = nullptr;  // set when some sequences share blocks

  // the first key a query tile [q0, ...) of sequence seq attends to (before the sliding window:
  // none; keys a prior covers: skipped)
  int64_t first_key(int64_t seq, int64_t q_pos0) const {
    const int64_t from_window = window > 0 ? std::max<int64_t>(0, q_pos0 - window + 1) : 0;
    return prior ? std::max(from_window, prior->keys_done[seq]) : from_window;
  }

  // Walks cache rows [first, first + n) of one sequence in groups of up to kStreams tiles of kLanes,
  // staging KV heads [h0, h1) of each row as float32 [h1 - h0, dim] in `staged` (zeros past the
  // end; a group's rows are consecutive there) and calling visit(g0, rows, staged) per group. A
  // group's tiles lie in different blocks and their rows are read in turn: reading several places
  // at once keeps more memory reads in flight (random 8 KB blocks read at 12 GB/s one at a time,
  // 20 GB/s four at a time on this project's machine). Before a group is staged the next one's rows
  // are prefetched (up to `ahead` rows past the range, which the caller will walk next), so that
  // they come from memory while this group's products run: a long context's keys are read from
  // memory by every item, and without it each group waited for its rows (a 512-query chunk over
  // 16,384 keys ran at three quarters of the speed of one over 1,750).
  template <typename Visit>
  void walk(const T* cache, int64_t dim, int64_t seq, int64_t h0, int64_t h1, int64_t first, int64_t n,
            int64_t ahead, float* staged, Visit visit, const T* also = nullptr, int64_t also_dim = 0) const {
    const int64_t width = (h1 - h0) * dim, chunks = width / kLanes;
    const int64_t tile_size = kLanes * width;
    auto row = [&](int64_t key) { return cache_row(cache, dim, seq, h0, key); };
    constexpr int64_t kGroup = kStreams * kLanes;
    const int64_t row_bytes = width * static_cast<int64_t>(sizeof(T));
    const int64_t also_bytes = (h1 - h0) * also_dim * static_cast<int64_t>(sizeof(T));
    for (int64_t g0 = 0; g0 < n; g0 += kGroup) {
      const int64_t next_end = std::min(g0 + 2 * kGroup, n + ahead);
      for (int64_t t = g0 + kGroup; t < next_end; ++t) prefetch(row(first + t), row_bytes);
      if (also)  // the same rows of another cache (the values, walked after this group's scores)
        for (int64_t t = g0; t < std::min(g0 + kGroup, n); ++t) prefetch(cache_row(also, also_dim, seq, h0, first + t), also_bytes);
      const int64_t tiles = std::min<int64_t>(kStreams, (n - g0 + kLanes - 1) / kLanes);
      for (int64_t j = 0; j < kLanes; ++j)
        for (int64_t g = 0; g < tiles; ++g) {
          float* dst = staged + g * tile_size + j * width;
          const int64_t t = g0 + g * kLanes + j;
          if (t >= n) {
            std::fill(dst, dst + width, 0.0f);
            continue;
          }
          const T* src = row(first + t);
          for (int64_t c = 0; c < chunks; ++c) store(dst + c * kLanes, load(src + c * kLanes));
        }
      visit(g0, std::min(n - g0, tiles * kLanes), staged);
    }
  }

  // acc rows a[0 .. R) (CN kLanes-float chunks each) += sum_j p[i][j] v_j, v_j rows `stride` floats apart
  template <int R, int CN, typename V>
  static void accumulate(float* const* a, const float* const* p, const V* values, int64_t stride, int64_t tn) {
    vfloat acc[R][CN];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < CN; ++c) acc[r][c] = load(a[r] + c * kLanes);
    for (int64_t j = 0; j < tn; ++j) {
      vfloat w[R];
      for (int r = 0; r < R; ++r) w[r] = p[r][j] - vfloat{};  // a broadcast (x - 0 is x, -0 included)
      for (int c = 0; c < CN; ++c) {
        vfloat v = load(values + j * stride + c * kLanes);
        // v stays in a register: otherwise the compiler folds this load into every row's product
        // (R loads instead of one) and the loop waits on loads instead of multiplies
        CB_KEEP_IN_REGISTER(v);
        for (int r = 0; r < R; ++r) acc[r][c] += w[r] * v;
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < CN; ++c) store(a[r] + c * kLanes, acc[r][c]);
  }

  // p.V for rows [r, r + R) of one head over one tile, chunk by chunk
  template <int R, typename V>
  void accumulate_rows(float* const* a, const float* const* p, const V* vt, int64_t v_width, int64_t tn) const {
    const int64_t vc = v_dim / kLanes;
    int64_t c = 0;
    for (; c + kPvChunks <= vc; c += kPvChunks) {
      float* ac[R];
      for (int r = 0; r < R; ++r) ac[r] = a[r] + c * kLanes;
      accumulate<R, kPvChunks>(ac, p, vt + c * kLanes, v_width, tn);
    }
    for (; c < vc; ++c) {
      float* ac[R];
      for (int r = 0; r < R; ++r) ac[r] = a[r] + c * kLanes;
      accumulate<R, 1>(ac, p, vt + c * kLanes, v_width, tn);
    }
  }

  // q.k of R rows (q: the first, rows head_dim apart) against one or two transposed tiles
  // ([dim][kLanes keys] each, k1 ignored unless Two): per dim, one broadcast q value per row times one
  // key vector per tile, so each value loaded feeds R or 2R products; a tile's scores in lanes.
  template <int R, bool Two, int KC>
  void qk_block(const float* q, const float* k0, const float* k1, float* out, int64_t npad) const {
    const int64_t dim = KC ? KC * kLanes : head_dim;
    vfloat a0[R], a1[R];
    for (int i = 0; i < R; ++i) a0[i] = a1[i] = vfloat{};
    for (int64_t d = 0; d < dim; ++d) {
      const vfloat x0 = load(k0 + d * kLanes), x1 = Two ? load(k1 + d * kLanes) : x0;
      for (int i = 0; i < R; ++i) {
        const float w = q[i * head_dim + d];
        a0[i] += w * x0;
        if (Two) a1[i] += w * x1;
      }
    }
    for (int i = 0; i < R; ++i) {
      store(out + i * npad, a0[i]);
      if (Two) store(out + i * npad + kLanes, a1[i]);
    }
  }

  template <int R, int KC>
  void qk_rows(const float* q, const float* kt, int64_t tiles, float* out, int64_t npad) const {
    const int64_t step = (KC ? KC * kLanes : head_dim) * kLanes;
    int64_t g = 0;
    for (; g + 2 <= tiles; g += 2) qk_block<R, true, KC>(q, kt + g * step, kt + (g + 1) * step, out + g * kLanes, npad);
    if (g < tiles) qk_block<R, false, KC>(q, kt + g * step, nullptr, out + g * kLanes, npad);
  }

  // Scores of a staged group of tiles for the rows of head hh when they are many: each tile is
  // transposed ([dim][kLanes keys]), then kQkRows rows times two tiles at a time (2 x kQkRows accumulators),
  // four or one row for what is left.
  template <int KC>
  void scores_transposed(Scratch& s, const float* keys, int64_t tiles, int64_t hh, int64_t per_head, int64_t k_width,
                         int64_t npad, int64_t t0) const {
    const int64_t dim = KC ? KC * kLanes : head_dim;
    float* kt = s.keys_t.data();
    for (int64_t g = 0; g < tiles; ++g)
      for (int64_t c = 0; c < dim; c += kLanes) {
        vfloat block[kLanes];
        for (int64_t j = 0; j < kLanes; ++j) block[j] = load(keys + (g * kLanes + j) * k_width + hh * head_dim + c);
        transpose_lanes(block);
        for (int64_t i = 0; i < kLanes; ++i) store(kt + (g * dim + c + i) * kLanes, block[i]);
      }
    const int64_t r1 = (hh + 1) * per_head;
    int64_t r = hh * per_head;
    auto at = [&](int64_t row) { return std::make_pair(s.q.data() + row * head_dim, s.scores.data() + row * npad + t0); };
    for (; r + kQkRows <= r1; r += kQkRows) qk_rows<kQkRows, KC>(at(r).first, kt, tiles, at(r).second, npad);
    for (; r + 4 <= r1; r += 4) qk_rows<4, KC>(at(r).first, kt, tiles, at(r).second, npad);
    for (; r < r1; ++r) qk_rows<1, KC>(at(r).first, kt, tiles, at(r).second, npad);
  }

  // Row `key` of one sequence in a cache, from KV head h0 on
  const T* cache_row(const T* cache, int64_t dim, int64_t seq, int64_t h0, int64_t key) const {
    const int64_t block = block_tables[seq * max_blocks + key / block_size];
    return cache + (block * block_size + key % block_size) * num_kv_heads * dim + h0 * dim;
  }

  // Scores of few rows, the keys read where they lie in the cache, kLanes keys at a time (past the
  // last key: the last key again, masked by the softmax). Staging costs more than it saves here: a
  // decode token's keys are read once, and loads straight from memory overlap with the products.
  // The key rows kPrefetchKeys ahead (up to `ahead` past the range) and this tile's value rows (p.V
  // reads them after the chunk's softmax) are prefetched: the hardware's own prefetch alone left a
  // long context's decode tokens reading at half the host's bandwidth. They are fetched into L2, not
  // L1 (prefetcht2): 2 x kLanes rows of keys and a tile of values are hundreds of cache lines, far more
  // than L1 has misses in flight, and the loads find them in L2 (on a Zen 4, 6-16% less time in
  // float32 and 16-28% in bfloat16 than prefetcht0, docs/benchmarks.md).
  template <int KC>
  void scores_in_place(const Item& it, Scratch& s, int64_t per_head, int64_t rows, int64_t first, int64_t n,
                       int64_t npad, int64_t ahead) const {
    const int64_t kc = KC ? KC : head_dim / kLanes;
    const int64_t k_bytes = (it.h1 - it.h0) * head_dim * static_cast<int64_t>(sizeof(T));
    const int64_t v_bytes = (it.h1 - it.h0) * v_dim * static_cast<int64_t>(sizeof(T));
    for (int64_t t0 = 0; t0 < n; t0 += kLanes) {
      for (int64_t j = 0; j < kLanes; ++j) {
        const int64_t t = t0 + kPrefetchKeys + j;
        if (t < n + ahead) prefetch<1>(cache_row(k_cache, head_dim, it.seq, it.h0, first + t), k_bytes);
        if (t0 + j < n) prefetch<1>(cache_row(v_cache, v_dim, it.seq, it.h0, first + t0 + j), v_bytes);
      }
      const T* kp[kLanes];
      for (int64_t j = 0; j < kLanes; ++j) kp[j] = cache_row(k_cache, head_dim, it.seq, it.h0, first + std::min(t0 + j, n - 1));
      for (int64_t r = 0; r < rows; ++r) {
        const float* qr = s.q.data() + r * head_dim;
        const int64_t off = (r / per_head) * head_dim;
        vfloat a[kLanes];
        for (int64_t j = 0; j < kLanes; ++j) {
          vfloat sum = load(qr) * load(kp[j] + off);
          for (int64_t c = 1; c < kc; ++c) sum += load(qr + c * kLanes) * load(kp[j] + off + c * kLanes);
          a[j] = sum;
        }
        store(s.scores.data() + r * npad + t0, reduce_lanes(a));
      }
    }
  }

  // acc rows of head hh += p.V over `tn` value rows `stride` apart from vt (keys t0 on)
  template <typename V>
  void accumulate_head(Scratch& s, int64_t hh, int64_t per_head, int64_t npad, int64_t t0, const V* vt, int64_t stride,
                       int64_t tn) const {
    const int64_t end = (hh + 1) * per_head;
    for (int64_t r = hh * per_head; r < end;) {
      const int64_t take = std::min<int64_t>(4, end - r);
      float* a[4];
      const float* p[4];
      for (int64_t i = 0; i < take; ++i) {
        a[i] = s.acc.data() + (r + i) * v_dim;
        p[i] = s.scores.data() + (r + i) * npad + t0;
      }
      switch (take) {
        case 4: accumulate_rows<4>(a, p, vt, stride, tn); break;
        case 3: accumulate_rows<3>(a, p, vt, stride, tn); break;
        case 2: accumulate_rows<2>(a, p, vt, stride, tn); break;
        default: accumulate_rows<1>(a, p, vt, stride, tn);
      }
      r += take;
    }
  }

  // p.V with the values read where they lie: one block's rows (equally spaced) at a time
  void values_in_place(const Item& it, Scratch& s, int64_t heads, int64_t per_head, int64_t first, int64_t n,
                       int64_t npad) const {
    for (int64_t t0 = 0; t0 < n;) {
      const int64_t key = first + t0, tn = std::min(block_size - key % block_size, n - t0);
      const T* rows = cache_row(v_cache, v_dim, it.seq, it.h0, key);
      for (int64_t hh = 0; hh < heads; ++hh) accumulate_head(s, hh, per_head, npad, t0, rows + hh * v_dim, num_kv_heads * v_dim, tn);
      t0 += tn;
    }
  }

  template <int KC>
  void run(const Item& it, Scratch& s) const {
    const int64_t group = num_heads / num_kv_heads, heads = it.h1 - it.h0;
    const int64_t kc = KC ? KC : head_dim / kLanes;
    const int64_t chunk_start = q_start[it.seq], q_len = q_start[it.seq + 1] - chunk_start;
    const int64_t pos0 = k_lens[it.seq] - q_len;  // position of the chunk's first query
    const int64_t per_head = (it.q1 - it.q0) * group, rows = heads * per_head;
    const int64_t last = pos0 + it.q1 - 1;  // keys up to the last query's position
    const int64_t first = first_key(it.seq, pos0 + it.q0);
    const int64_t n = last - first + 1;
    const int64_t k_width = heads * head_dim, v_width = heads * v_dim;
    s.q.resize(rows * head_dim);
    s.keys.resize(kStreams * kLanes * k_width);
    s.keys_t.resize(kStreams * head_dim * kLanes);
    s.values.resize(kStreams * kLanes * v_width);
    s.acc.assign(rows * v_dim, 0.0f);
    s.total.assign(rows, 0.0f);
    s.max.assign(rows, -INFINITY);
    // row r = (hh * queries + i) * group + g: query it.q0 + i of query head (it.h0 + hh) * group + g, scaled
    auto token = [&](int64_t r) { return chunk_start + it.q0 + (r % per_head) / group; };
    auto head = [&](int64_t r) { return (it.h0 + r / per_head) * group + r % group; };
    for (int64_t r = 0; r < rows; ++r) {
      const T* src = q + token(r) * q_stride_t + head(r) * q_stride_h;
      for (int64_t c = 0; c < kc; ++c) store(s.q.data() + r * head_dim + c * kLanes, load(src + c * kLanes) * scale);
    }
    const bool in_place = per_head < kTransposeRows;  // few rows (decode tokens): no staging
    const int64_t chunk = in_place ? kDecodeKeyChunk : kPrefillKeyChunk;
    s.scores.resize(rows * chunk);
    // the keys `chunk` at a time, the softmax online (each row's running max and sum,
    // its sums rescaled when the max grows): the scores stay in the core's own caches however long
    // the context is
    for (int64_t c0 = 0; c0 < n; c0 += chunk) {
      const int64_t cn = std::min(chunk, n - c0), cpad = (cn + kLanes - 1) / kLanes * kLanes;
      // scores[r, t] = q_r . k_(first + c0 + t)
      if (in_place) {
        scores_in_place<KC>(it, s, per_head, rows, first + c0, cn, chunk, n - c0 - cn);
      } else {
        walk(k_cache, head_dim, it.seq, it.h0, it.h1, first + c0, cn, n - c0 - cn, s.keys.data(), [&](int64_t g0, int64_t gn, const float* keys) {
          const int64_t tiles = (gn + kLanes - 1) / kLanes;
          for (int64_t hh = 0; hh < heads; ++hh) scores_transposed<KC>(s, keys, tiles, hh, per_head, k_width, chunk, g0);
        }, v_cache, v_dim);
      }
      // each row's own keys of the chunk (causal, sliding window) into exp(score - running max);
      // the others get probability 0
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = s.scores.data() + r * chunk;
        const int64_t qpos = pos0 + it.q0 + (r % per_head) / group;
        const int64_t lo = std::clamp<int64_t>(first_key(it.seq, qpos) - first - c0, 0, cpad);
        const int64_t hi = std::clamp<int64_t>(qpos - first - c0 + 1, lo, cpad);
        if (lo == hi) {
          std::fill(sr, sr + cpad, 0.0f);
          continue;
        }
        // lanes of keys [lo, hi) in the vector of keys t .. t + kLanes
        auto own = [&](int64_t t) {
          const vint key = lane_index() + static_cast<int32_t>(t);
          return (key >= static_cast<int32_t>(lo)) & (key < static_cast<int32_t>(hi));
        };
        // vectors wholly inside [lo, hi) need no mask; those wholly outside are zeros
        const int64_t a = lo / kLanes * kLanes, b = (hi + kLanes - 1) / kLanes * kLanes;
        auto edge = [&](int64_t t) { return t < lo || t + kLanes > hi; };
        vfloat vm = vfloat{} - INFINITY;
        for (int64_t t = a; t < b; t += kLanes) {
          const vfloat v = load(sr + t);
          vm = ((edge(t) ? own(t) : vint{} - 1) & (v > vm)) ? v : vm;
        }
        const float m_old = s.max[r], m = std::max(m_old, hmax(vm));
        std::fill(sr, sr + a, 0.0f);
        std::fill(sr + b, sr + cpad, 0.0f);
        vfloat vsum{};
        for (int64_t t = a; t < b; t += kLanes) {
          vfloat p = exp_neg(load(sr + t) - m);
          if (edge(t)) p = own(t) ? p : vfloat{};
          store(sr + t, p);
          vsum += p;
        }
        float total = s.total[r];
        if (m > m_old && m_old != -INFINITY) {  // the sums so far were relative to a smaller max
          const float f = std::exp(m_old - m);
          total *= f;
          float* a = s.acc.data() + r * v_dim;
          for (int64_t i = 0; i < v_dim; i += kLanes) store(a + i, load(a + i) * f);
        }
        s.total[r] = total + hsum(vsum);
        s.max[r] = m;
      }
      // acc[r] += sum_t p[r, t] v_(first + c0 + t): up to four rows of one head at a time
      if (in_place) {
        values_in_place(it, s, heads, per_head, first + c0, cn, chunk);
      } else {
        // (a staged group's rows are consecutive, so its tiles count as one)
        walk(v_cache, v_dim, it.seq, it.h0, it.h1, first + c0, cn, n - c0 - cn, s.values.data(), [&](int64_t t0, int64_t tn, const float* values) {
          for (int64_t hh = 0; hh < heads; ++hh) accumulate_head(s, hh, per_head, chunk, t0, values + hh * v_dim, v_width, tn);
        });
      }
    }
    finish(it, s, rows, per_head, group, chunk_start);
  }

  // out rows from the sums, merged with a prior's shared part where there is one
  void finish(const Item& it, const Scratch& s, int64_t rows, int64_t per_head, int64_t group, int64_t chunk_start) const {
    auto token = [&](int64_t r) { return chunk_start + it.q0 + (r % per_head) / group; };
    auto head = [&](int64_t r) { return (it.h0 + r / per_head) * group + r % group; };
    const bool merge = prior && prior->keys_done[it.seq] > 0;
    for (int64_t r = 0; r < rows; ++r) {
      T* dst = out + (token(r) * num_heads + head(r)) * v_dim;
      const float* acc = s.acc.data() + r * v_dim;
      if (!merge) {
        const float inv = 1.0f / s.total[r];
        for (int64_t i = 0; i < v_dim; ++i) dst[i] = static_cast<T>(acc[i] * inv);
        continue;
      }
      // own keys (max m, sum l, acc) and the shared ones (pm, pl, pacc), both rescaled to the larger max
      const int64_t idx = it.seq * num_heads + head(r);
      const float m = s.max[r], pm = prior->max[idx], top = std::max(m, pm);
      const float own = std::exp(m - top), shared = std::exp(pm - top);
      const float inv = 1.0f / (s.total[r] * own + prior->total[idx] * shared);
      const float* pacc = prior->acc.data() + idx * v_dim;
      for (int64_t i = 0; i < v_dim; ++i) dst[i] = static_cast<T>((acc[i] * own + pacc[i] * shared) * inv);
    }
  }
};

// Groups of at least min_seqs decode sequences whose block tables start alike, with the whole blocks
// they share before each one's last key
template <typename T>
std::vector<Share> find_shares(const Attention<T>& a, int64_t num_seqs, int64_t min_seqs) {
  std::vector<int64_t> decodes;
  for (int64_t s = 0; s < num_seqs; ++s)
    if (a.q_start[s + 1] - a.q_start[s] == 1 && a.k_lens[s] > a.block_size) decodes.push_back(s);
  auto table = [&](int64_t s) { return a.block_tables + s * a.max_blocks; };
  std::stable_sort(decodes.begin(), decodes.end(), [&](int64_t x, int64_t y) { return table(x)[0] < table(y)[0]; });
  std::vector<Share> shares;
  for (size_t i = 0, j; i < decodes.size(); i = j) {
    for (j = i + 1; j < decodes.size() && table(decodes[j])[0] == table(decodes[i])[0];) ++j;
    if (static_cast<int64_t>(j - i) < min_seqs) continue;
    Share sh{{decodes.begin() + i, decodes.begin() + j}, a.max_blocks};
    const int32_t* lead = table(sh.seqs[0]);
    for (const int64_t s : sh.seqs) {
      int64_t b = 0;
      const int64_t cap = std::min(sh.blocks, (a.k_lens[s] - 1) / a.block_size);  // one own key at least
      while (b < cap && table(s)[b] == lead[b]) ++b;
      sh.blocks = b;
    }
    if (sh.blocks > 0) shares.push_back(std::move(sh));
  }
  return shares;
}

// The shared part of one share, for every KV head at once: the queries [Hkv, rows, D] (row i * group
// + g: sequence i's query head h * group + g) and the shared keys and values, widened to float32, go
// through two batched products around a softmax that keeps each row's max and sum.
template <typename T>
void attend_shared(const Attention<T>& a, const Share& sh, Prior& prior) {
  const int64_t group = a.num_heads / a.num_kv_heads, kv = a.num_kv_heads, d = a.head_dim, dv = a.v_dim;
  const int64_t members = sh.seqs.size(), rows = members * group, keys = sh.blocks * a.block_size;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor q = at::empty({kv, rows, d}, f32), k = at::empty({kv, keys, d}, f32), v = at::empty({kv, keys, dv}, f32);
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  for (int64_t i = 0; i < members; ++i)
    for (int64_t h = 0; h < a.num_heads; ++h) {
      const T* src = a.q + a.q_start[sh.seqs[i]] * a.q_stride_t + h * a.q_stride_h;
      float* dst = qp + ((h / group) * rows + i * group + h % group) * d;
      for (int64_t c = 0; c < d; c += kLanes) store(dst + c, load(src + c) * a.scale);
    }
  const int32_t* table = a.block_tables + sh.seqs[0] * a.max_blocks;
  at::parallel_for(0, keys, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t slot = static_cast<int64_t>(table[t / a.block_size]) * a.block_size + t % a.block_size;
      for (int64_t h = 0; h < kv; ++h) {
        const T* ks = a.k_cache + (slot * kv + h) * d;
        const T* vs = a.v_cache + (slot * kv + h) * dv;
        for (int64_t c = 0; c < d; c += kLanes) store(kp + (h * keys + t) * d + c, load(ks + c));
        for (int64_t c = 0; c < dv; c += kLanes) store(vp + (h * keys + t) * dv + c, load(vs + c));
      }
    }
  });
  at::Tensor scores = at::bmm(q, k.transpose(1, 2));  // [Hkv, rows, keys]
  float* sp = scores.data_ptr<float>();
  auto index = [&](int64_t row) {  // row of [Hkv * rows] -> (sequence, query head) slot of the prior
    const int64_t h = row / rows, i = (row % rows) / group, g = row % group;
    return sh.seqs[i] * a.num_heads + h * group + g;
  };
  at::parallel_for(0, kv * rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* sr = sp + r * keys;
      float m = -INFINITY;
      for (int64_t t = 0; t < keys; ++t) m = std::max(m, sr[t]);
      float total = 0.0f;
      int64_t t = 0;
      vfloat vsum{};
      for (; t + kLanes <= keys; t += kLanes) {
        const vfloat e = exp_neg(load(sr + t) - m);
        store(sr + t, e);
        vsum += e;
      }
      for (; t < keys; ++t) total += (sr[t] = std::exp(sr[t] - m));
      prior.max[index(r)] = m;
      prior.total[index(r)] = total + hsum(vsum);
    }
  });
  const at::Tensor acc = at::bmm(scores, v);  // [Hkv, rows, Dv]
  const float* ap = acc.data_ptr<float>();
  for (int64_t r = 0; r < kv * rows; ++r) std::memcpy(prior.acc.data() + index(r) * dv, ap + r * dv, dv * sizeof(float));
  for (const int64_t s : sh.seqs) prior.keys_done[s] = keys;
}

template <typename T>
void attend(Attention<T> a, int64_t num_seqs, int64_t cascade_min_seqs) {
  Prior prior;
  const std::vector<Share> shares = cascade_min_seqs > 0 && a.window <= 0 ? find_shares(a, num_seqs, cascade_min_seqs)
                                                                         : std::vector<Share>{};
  if (!shares.empty()) {
    prior.keys_done.assign(num_seqs, 0);
    prior.max.resize(num_seqs * a.num_heads);
    prior.total.resize(num_seqs * a.num_heads);
    prior.acc.resize(num_seqs * a.num_heads * a.v_dim);
    for (const Share& sh : shares) attend_shared(a, sh, prior);
    a.prior = &prior;
  }
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t tile = std::max<int64_t>(1, kTileRows / group);
  // a decode token takes all its KV heads when there are enough sequences to share out: each cache
  // row is then read whole, in order
  const bool whole_rows = num_seqs >= 4 * at::get_num_threads();
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = a.q_start[s + 1] - a.q_start[s], pos0 = a.k_lens[s] - q_len;
    const int64_t step = q_len == 1 && whole_rows ? a.num_kv_heads : 1;
    for (int64_t q0 = 0; q0 < q_len; q0 += tile) {
      const int64_t q1 = std::min(q_len, q0 + tile);
      const int64_t keys = pos0 + q1 - a.first_key(s, pos0 + q0);
      for (int64_t h = 0; h < a.num_kv_heads; h += step) items.push_back({s, h, h + step, q0, q1, keys * (q1 - q0 + 1) * step});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  std::atomic<int64_t> next{0};
  const int64_t kc = a.head_dim / kLanes;
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch s;
    for (int64_t i = next++; i < static_cast<int64_t>(items.size()); i = next++) {
      if (kc == 4) a.template run<4>(items[i], s);
      else if (kc == 8) a.template run<8>(items[i], s);
      else a.template run<0>(items[i], s);
    }
  });
}

}  // namespace

// out [T, H, Dv] contiguous; q [T, H, D] (last dim contiguous); k_cache [N, bs, Hkv, D],
// v_cache [N, bs, Hkv, Dv]; block_tables int32 [S, max_blocks]; k_lens int32 [S] (keys per sequence,
// this step's included); q_start int32 [S + 1] (the step's queries of sequence s are rows
// q_start[s] .. q_start[s+1] - 1, the last positions of its k_lens[s] keys). window <= 0: none.
// cascade_min_seqs: decode tokens of at least this many sequences that share leading blocks attend
// over the shared part together (0 or less: never; the engine passes CASCADE_MIN_SEQS of
// engine/backends/cpu.py).
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                     at::Tensor k_lens, at::Tensor q_start, double scale, int64_t window, int64_t cascade_min_seqs) {
  TORCH_CHECK(out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && q.dim() == 3 &&
                  q.stride(2) == 1,
              "paged_attention: out and the caches must be contiguous, q's last dim too");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  k_lens.scalar_type() == at::kInt && k_lens.is_contiguous() &&
                  q_start.scalar_type() == at::kInt && q_start.is_contiguous(),
              "paged_attention: block_tables, k_lens and q_start must be contiguous int32");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
              "paged_attention: dtypes differ");
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2), v_dim = v_cache.size(3);
  const int64_t num_seqs = block_tables.size(0);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "paged_attention: query heads must be a whole multiple of the KV heads");
  TORCH_CHECK(head_dim % 16 == 0 && v_dim % 16 == 0, "paged_attention: head dims must be multiples of 16");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && v_cache.scalar_type() == q.scalar_type() &&
                  k_cache.size(3) == head_dim && v_cache.size(0) == k_cache.size(0) &&
                  v_cache.size(1) == block_size && v_cache.size(2) == num_kv_heads,
              "paged_attention: the caches do not match the queries or each other");
  TORCH_CHECK(block_tables.dim() == 2 && k_lens.numel() == num_seqs && q_start.numel() == num_seqs + 1 &&
                  out.dim() == 3 && out.size(0) == num_tokens && out.size(1) == num_heads && out.size(2) == v_dim,
              "paged_attention: one block-table row and one length per sequence, q_start one longer, out like q");
  const int64_t max_blocks = block_tables.size(1), num_blocks = k_cache.size(0);
  const int32_t* lens = k_lens.data_ptr<int32_t>();
  const int32_t* starts = q_start.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == num_tokens, "paged_attention: q_start must run from 0 to the tokens");
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = starts[b + 1] - starts[b];
    TORCH_CHECK(q_len >= 1 && q_len <= lens[b], "paged_attention: every sequence needs 1 to k_len queries");
    TORCH_CHECK(lens[b] <= max_blocks * block_size, "paged_attention: sequence length outside its block table");
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tables[b * max_blocks + i] >= 0 && tables[b * max_blocks + i] < num_blocks,
                  "paged_attention: block id outside the cache");
  }
  auto run = [&](auto zero) {
    using T = decltype(zero);
    Attention<T> a{out.data_ptr<T>(), q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                         tables, lens, starts, q.stride(0), q.stride(1), num_heads, num_kv_heads, head_dim, v_dim,
                         block_size, max_blocks, window, static_cast<float>(scale)};
    attend(a, num_seqs, cascade_min_seqs);
  };
  for_each_float_type(q, "paged_attention", run);
}
