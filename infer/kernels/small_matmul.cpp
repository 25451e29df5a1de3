// Small-batch fp32 matmul for decoding on CPU: y = x @ w^T with x (T, K), w (N, K) row-major.
//
// Decoding verifies a handful of tokens at once (T = 1..32). BLAS sgemm packs the whole weight
// matrix on every call at such small T and ends up ~2-3x slower than a single-token gemv; this
// kernel streams each weight row from memory once and reuses it for every token while it sits
// in L1, so the cost of verifying T tokens stays close to the cost of one.
//
// Every output element is one dot product accumulated in the same order (8-wide chunks of k in
// sequence, then a fixed horizontal sum), whatever T is: results are bitwise independent of how
// many tokens are batched, so batched verification reproduces token-by-token decoding exactly.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 shuf = _mm_movehdup_ps(lo);
  __m128 sums = _mm_add_ps(lo, shuf);
  shuf = _mm_movehl_ps(shuf, sums);
  sums = _mm_add_ss(sums, shuf);
  return _mm_cvtss_f32(sums);
}

// TB tokens x NB weight rows per block: TB * NB accumulators stay in registers.
template <int TB, int NB>
inline void block(const float* x, const float* w, float* y, int64_t K, int64_t N) {
  __m256 acc[TB][NB];
  for (int t = 0; t < TB; ++t)
    for (int r = 0; r < NB; ++r) acc[t][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NB];
    for (int r = 0; r < NB; ++r) wv[r] = _mm256_loadu_ps(w + r * K + k);
    for (int t = 0; t < TB; ++t) {
      const __m256 xv = _mm256_loadu_ps(x + t * K + k);
      for (int r = 0; r < NB; ++r) acc[t][r] = _mm256_fmadd_ps(xv, wv[r], acc[t][r]);
    }
  }
  for (int t = 0; t < TB; ++t)
    for (int r = 0; r < NB; ++r) y[t * N + r] = hsum(acc[t][r]);
}

// All T tokens against weight rows [n0, n1), in token blocks of 4, then 2, then 1.
template <int NB>
inline void rows(const float* x, const float* w, float* y, int64_t T, int64_t K, int64_t N, int64_t n) {
  int64_t t = 0;
  for (; t + 4 <= T; t += 4) block<4, NB>(x + t * K, w + n * K, y + t * N + n, K, N);
  for (; t + 2 <= T; t += 2) block<2, NB>(x + t * K, w + n * K, y + t * N + n, K, N);
  for (; t < T; ++t) block<1, NB>(x + t * K, w + n * K, y + t * N + n, K, N);
}

torch::Tensor small_matmul(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "fp32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x (T, K) and w (N, K)");
  TORCH_CHECK(x.size(1) % 8 == 0, "K must be a multiple of 8");
  const auto xc = x.contiguous();
  const auto wc = w.contiguous();
  const int64_t T = xc.size(0), K = xc.size(1), N = wc.size(0);
  auto y = torch::empty({T, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Rows in blocks of 8: one token streams 8 weight rows at once (memory-level parallelism);
  // several tokens share 4-row halves (4 x 4 accumulators).
  at::parallel_for(0, (N + 7) / 8, 32, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * 8;
      if (n + 8 <= N && T == 1) {
        block<1, 8>(xp, wp + n * K, yp + n, K, N);
      } else if (n + 8 <= N) {
        rows<4>(xp, wp, yp, T, K, N, n);
        rows<4>(xp, wp, yp, T, K, N, n + 4);
      } else {
        for (int64_t m = n; m < N; ++m) rows<1>(xp, wp, yp, T, K, N, m);
      }
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_matmul", &small_matmul, "y = x @ w.T for small T (fp32, AVX2/FMA)");
}
