// Panel matmul for decoding on AVX-512 CPUs: y = x @ w^T with x (T, K) and w packed once into panels
// (infer/kernels/panels.py), fp32 or bf16 (AVX512_BF16).
//
// The layout: w's rows in groups of 48 (three panels of 16 rows; the last group padded with zero rows), each group one
// contiguous block, k-major: for each k (bf16: each pair of k), the 3 panels' 16 rows side by side. A step therefore
// reads the whole matrix as one sequential stream (the hardware prefetcher follows it at the read rate), each
// 64-byte line is 16 rows' weights at one k (or pair), and the 3 panels give 3 independent accumulator chains even
// for one token. Each token's x[k] (bf16: the pair x[k], x[k+1]) is broadcast and multiplied into 16 rows at once, so
// an output needs no horizontal sum: lane l of panel q's accumulator is row 48 g + 16 q + l.
//
// Batch invariance: every output element is one accumulator, fmadd (fp32) or vdpbf16ps (bf16) over k (pairs) in
// ascending order from zero, whatever T is, whichever pass computes its token and however the groups are split over
// threads; so a row's result is bitwise independent of how many rows the call carries, and a batched verification
// reproduces token-by-token decoding exactly.
//
// Tokens go through a group in passes of up to 8 (3 x 8 accumulators + 3 weight vectors in the 32 registers), the
// tokens split evenly over the passes; with more than one pass each pass also prefetches an equal share of the group
// AHEAD groups on into L2, so the weight stream runs on while the later passes compute on a group already in cache.
// One pass of SOLO_FROM or more tokens (as long on the arithmetic units as the group takes to arrive) prefetches the
// next group likewise; fewer tokens leave the stream to the hardware prefetcher, which follows it best alone.
// Measured on Zen 4 (docs/KERNELS.md, "Kept: weights packed in panels", and "Kept: attention over every query").
#include "kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace panels {

constexpr int64_t PANELS = 3;  // 16-row panels per group
constexpr int64_t GROUP = 16 * PANELS;  // weight rows per group (layerskip::PANEL_ROWS)
constexpr int PASS_MAX = 8;  // tokens per pass
constexpr int64_t AHEAD = 2;  // groups on that a multi-pass group prefetches
constexpr int64_t SOLO_FROM = 7;  // tokens from which a single pass prefetches too
constexpr int64_t SOLO_AHEAD = 1;  // groups on that it prefetches
constexpr int64_t GRAIN = 4;  // groups per parallel chunk (at::parallel_for's grain)
static_assert(GROUP == layerskip::PANEL_ROWS, "the Python packer's group size");

// fp32: one k a step; a panel's 16 rows at that k are one vector.
struct F32 {
  using T = float;
  using W = __m512;
  static constexpr int64_t STEP = 1;
  static inline W weights(const float* p) { return _mm512_loadu_ps(p); }
  static inline W token(const float* x) { return _mm512_set1_ps(*x); }
  static inline __m512 fma(__m512 acc, W w, W x) { return _mm512_fmadd_ps(w, x, acc); }
  static inline float out(float v) { return v; }
};

// bf16: a pair of k a step; a panel's 16 rows at that pair are one vector of 16 (k, k+1) pairs, and vdpbf16ps adds
// each lane's two products into its fp32 accumulator.
struct BF16 {
  using T = c10::BFloat16;
  using W = __m512i;
  static constexpr int64_t STEP = 2;
  static inline W weights(const T* p) { return _mm512_loadu_si512(p); }
  static inline W token(const T* x) {
    int32_t pair;
    std::memcpy(&pair, x, sizeof(pair));
    return _mm512_set1_epi32(pair);
  }
  static inline __m512 fma(__m512 acc, W w, W x) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(w), reinterpret_cast<__m512bh>(x));
  }
  static inline T out(float v) { return T(v); }  // round to nearest even, as torch
};

// Prefetches a pass issues: ``per`` lines each step from ``at`` on, none at or past ``end``.
struct Ahead {
  const char* at;
  const char* end;
  int64_t per;
};

// TB tokens x (K) against one group w (K / STEP steps of 3 panel vectors): out (TB, GROUP) fp32.
template <class E, int TB>
inline void pass(const typename E::T* x, int64_t K, const typename E::T* w, float* out, Ahead ahead) {
  __m512 acc[TB][PANELS];
  for (int t = 0; t < TB; ++t)
    for (int q = 0; q < PANELS; ++q) acc[t][q] = _mm512_setzero_ps();
  if (ahead.at >= ahead.end) ahead.per = 0;
  for (int64_t k = 0; k < K; k += E::STEP, w += GROUP * E::STEP) {
    for (int64_t p = 0; p < ahead.per; ++p, ahead.at += 64) _mm_prefetch(ahead.at, _MM_HINT_T1);
    typename E::W wv[PANELS];
    for (int q = 0; q < PANELS; ++q) wv[q] = E::weights(w + q * 16 * E::STEP);
    for (int t = 0; t < TB; ++t) {
      const auto xb = E::token(x + t * K + k);
      for (int q = 0; q < PANELS; ++q) acc[t][q] = E::fma(acc[t][q], wv[q], xb);
    }
  }
  for (int t = 0; t < TB; ++t)
    for (int q = 0; q < PANELS; ++q) _mm512_storeu_ps(out + t * GROUP + q * 16, acc[t][q]);
}

template <class E>
inline void pass_of(int tb, const typename E::T* x, int64_t K, const typename E::T* w, float* out, Ahead ahead) {
  switch (tb) {
    case 1: return pass<E, 1>(x, K, w, out, ahead);
    case 2: return pass<E, 2>(x, K, w, out, ahead);
    case 3: return pass<E, 3>(x, K, w, out, ahead);
    case 4: return pass<E, 4>(x, K, w, out, ahead);
    case 5: return pass<E, 5>(x, K, w, out, ahead);
    case 6: return pass<E, 6>(x, K, w, out, ahead);
    case 7: return pass<E, 7>(x, K, w, out, ahead);
    default: return pass<E, 8>(x, K, w, out, ahead);
  }
}

// Groups [g0, g1) of w (G groups of GROUP rows, N of them real) for all T tokens: y (T, N).
template <class E>
void groups(const typename E::T* x, const typename E::T* w, typename E::T* y, int64_t T, int64_t K, int64_t N,
            int64_t G, int64_t g0, int64_t g1) {
  using Elem = typename E::T;
  const int64_t size = K * GROUP;  // elements of a group
  const int64_t passes = (T + PASS_MAX - 1) / PASS_MAX;
  const int64_t steps = K / E::STEP, lines = size * int64_t(sizeof(Elem)) / 64;
  const bool fetch = passes > 1 || T >= SOLO_FROM;
  const int64_t per = fetch ? (lines + passes * steps - 1) / (passes * steps) : 0;  // prefetches a step
  const int64_t ahead = passes > 1 ? AHEAD : SOLO_AHEAD;
  const char* end = reinterpret_cast<const char*>(w + G * size);
  float out[PASS_MAX * GROUP];
  for (int64_t g = g0; g < g1; ++g) {
    const Elem* wg = w + g * size;
    const char* next = reinterpret_cast<const char*>(wg + ahead * size);
    const int64_t rows = std::min(GROUP, N - g * GROUP);
    for (int64_t t = 0, p = 0; t < T; ++p) {
      const int64_t left = T - t, tb = (left + (passes - p) - 1) / (passes - p);
      pass_of<E>(int(tb), x + t * K, K, wg, out, Ahead{next + p * per * steps * 64, end, per});
      for (int64_t i = 0; i < tb; ++i)
        for (int64_t r = 0; r < rows; ++r) y[(t + i) * N + g * GROUP + r] = E::out(out[i * GROUP + r]);
      t += tb;
    }
  }
}

}  // namespace panels
#pragma GCC pop_options

}  // namespace

namespace layerskip {

torch::Tensor pack_panels(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.dtype() == torch::kFloat32 || w.dtype() == torch::kBFloat16) && w.device().is_cpu(),
              "w (N, K) fp32 or bf16 on the CPU");
  TORCH_CHECK(w.size(0) > 0 && (w.dtype() == torch::kFloat32 || w.size(1) % 2 == 0),
              "w (N, K) with N > 0 (bf16: K even, the layout's pairs)");
  const auto wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), G = (N + PANEL_ROWS - 1) / PANEL_ROWS;
  auto out = torch::zeros({G, K, PANEL_ROWS}, wc.options());  // (G, K, 48); the last group's missing rows zero
  const bool bf16 = w.dtype() == torch::kBFloat16;
  const int64_t es = wc.element_size();
  const char* src = static_cast<const char*>(wc.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t n = g0 * PANEL_ROWS; n < std::min(N, g1 * PANEL_ROWS); ++n) {
      const int64_t g = n / PANEL_ROWS, r = n % PANEL_ROWS;
      for (int64_t k = 0; k < K; ++k) {  // fp32: (g, k, r); bf16: (g, k / 2, r, k % 2)
        const int64_t at = g * K * PANEL_ROWS + (bf16 ? (k / 2) * 2 * PANEL_ROWS + r * 2 + k % 2 : k * PANEL_ROWS + r);
        std::memcpy(dst + at * es, src + (n * K + k) * es, es);
      }
    }
  });
  return out;
}

torch::Tensor panel_matmul(const torch::Tensor& x, const torch::Tensor& w, int64_t n) {
  const bool bf16 = x.dtype() == torch::kBFloat16;
  TORCH_CHECK(path_name() == "avx512", "panel_matmul: the kernel's AVX-512 path only");
  TORCH_CHECK(x.dtype() == w.dtype() && (bf16 || x.dtype() == torch::kFloat32), "x and w both fp32 or both bf16");
  TORCH_CHECK(!bf16 || supports_bf16(), "bf16 needs a CPU with AVX512_BF16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.size(1) == x.size(1) && w.size(2) == PANEL_ROWS && w.is_contiguous(),
              "x (T, K) and w packed (G, K, ", PANEL_ROWS, ") contiguous (infer.kernels.panels.pack)");
  TORCH_CHECK(n > 0 && (n + PANEL_ROWS - 1) / PANEL_ROWS == w.size(0), "n: ", w.size(0), " groups hold ",
              w.size(0) * PANEL_ROWS - PANEL_ROWS + 1, " to ", w.size(0) * PANEL_ROWS, " rows, not ", n);
  TORCH_CHECK(!bf16 || x.size(1) % 2 == 0, "bf16: K must be even (the layout's pairs)");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "CPU tensors only");
  const auto xc = x.contiguous();
  const int64_t T = xc.size(0), K = xc.size(1), G = w.size(0);
  auto y = torch::empty({T, n}, xc.options());
  if (T == 0) return y;
  if (bf16) {
    const auto* xp = reinterpret_cast<const c10::BFloat16*>(xc.data_ptr());
    const auto* wp = reinterpret_cast<const c10::BFloat16*>(w.data_ptr());
    auto* yp = reinterpret_cast<c10::BFloat16*>(y.data_ptr());
    at::parallel_for(0, G, panels::GRAIN, [&](int64_t g0, int64_t g1) {
      panels::groups<panels::BF16>(xp, wp, yp, T, K, n, G, g0, g1);
    });
  } else {
    const float* xp = xc.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, G, panels::GRAIN, [&](int64_t g0, int64_t g1) {
      panels::groups<panels::F32>(xp, wp, yp, T, K, n, G, g0, g1);
    });
  }
  return y;
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, int64_t n) {
  if (w.dim() == 3) return panel_matmul(x, w, n);
  TORCH_CHECK(w.size(0) == n, "w (", n, ", K)");
  return small_matmul(x, w);
}

}  // namespace layerskip
