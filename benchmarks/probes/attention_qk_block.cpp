// The CPU attention kernel's q.k register block alone, outside cbserve: R query rows times T tiles of
// 16 transposed keys ([dim][16 keys] each), head dim 64, one broadcast q value per row and dim times
// one key vector per tile (as engine/csrc/paged_attention_cpu.cpp's qk_block does with R = 8, T = 2
// under AVX-512), over 128 rows x 512 keys held in the core's caches, one thread, best of 20.
// It shows what the loop reaches when nothing else (staging, softmax, prefetch) runs beside it.
//
//   g++ -O3 -march=native benchmarks/probes/attention_qk_block.cpp -o /tmp/qk_block && /tmp/qk_block
//
// Any x86-64 CPU with AVX-512F (16-float vectors). docs/benchmarks.md (W3 on the Zen 4) has its
// figures: 115-116 GFLOP/s for 8x2, 6x4, 8x3, 12x2 and 7x4 on one core, 67-95 for 4x4 (two runs).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

typedef float vfloat __attribute__((vector_size(64), aligned(64)));

static inline vfloat load(const float* p) { vfloat v; std::memcpy(&v, p, sizeof(v)); return v; }
static inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }

template <int R, int T>
__attribute__((noinline)) void qk_block(const float* q, const float* kt, float* out, int dim) {
  vfloat acc[R][T];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < T; ++t) acc[i][t] = vfloat{};
  for (int d = 0; d < dim; ++d) {
    vfloat k[T];
    for (int t = 0; t < T; ++t) k[t] = load(kt + (t * dim + d) * 16);
    for (int i = 0; i < R; ++i) {
      const float w = q[i * dim + d];
      for (int t = 0; t < T; ++t) acc[i][t] += w * k[t];
    }
  }
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < T; ++t) store(out + (i * T + t) * 16, acc[i][t]);
}

template <int R, int T>
double gflops() {
  const int dim = 64, rows = 128, tiles = 32, repeats = 20;
  std::vector<float> q(rows * dim), kt(tiles * dim * 16), out(R * T * 16);
  for (float& x : q) x = std::rand() / static_cast<float>(RAND_MAX);
  for (float& x : kt) x = std::rand() / static_cast<float>(RAND_MAX);
  double best = 1e9;
  for (int rep = 0; rep < 20; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < repeats; ++it)
      for (int r = 0; r + R <= rows; r += R)
        for (int g = 0; g + T <= tiles; g += T) qk_block<R, T>(q.data() + r * dim, kt.data() + g * dim * 16, out.data(), dim);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const double flops = 2.0 * repeats * (rows / R * R) * (tiles / T * T) * 16 * dim;
  return flops / best / 1e9;
}

int main() {
  std::printf("rows x tiles  GFLOP/s (one thread)\n");
  std::printf("8x2   %.1f\n", gflops<8, 2>());
  std::printf("6x4   %.1f\n", gflops<6, 4>());
  std::printf("8x3   %.1f\n", gflops<8, 3>());
  std::printf("12x2  %.1f\n", gflops<12, 2>());
  std::printf("7x4   %.1f\n", gflops<7, 4>());
  std::printf("4x4   %.1f\n", gflops<4, 4>());
}
