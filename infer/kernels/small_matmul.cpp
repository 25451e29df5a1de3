// Small-batch matmul for decoding on CPU: y = x @ w^T with x (T, K), w (N, K) row-major, fp32 or bf16.
//
// Decoding verifies a handful of tokens at once (T = 1..32). BLAS packs the whole weight matrix on
// every call at such small T; this kernel streams each weight row from memory once and reuses it for
// every token while it sits in cache, so verifying T tokens costs little more than one token.
//
// Batch invariance: every output element is accumulated in the same order whatever T is and whichever block shape
// computes it, so a row's result is bitwise independent of how many rows are batched, and batched verification
// reproduces token-by-token decoding exactly.
//
// Paths, chosen once per process from cpuid (never per call, so the order never changes within a run):
//   avx512  fp32, and bf16 on CPUs with AVX512_BF16: the weights packed in panels (panels.cpp; the runner packs each
//           matrix once at load, ``small_matmul`` here packs on the fly);
//   avx2    fp32, 8 lanes, one dot product per output element (one vector accumulator, k-chunks in sequence, a row's
//           last K % 8 values by masked loads, then the same horizontal sum): one token streams 8 rows at once,
//           several share 4-row halves; and its own row
//           attention (the file is compiled with -mavx2 -mfma; AVX-512 code is in target regions).
// Elsewhere the Python side uses torch (the portable path).
//
// On the AVX-512 path the module also has the RMSNorm of a row (``rms_norm``); on both paths decoding attention
// (``attend_rows``: each query row as it computes alone over its visible keys, the same arithmetic whatever T is;
// fp32 on AVX2, one row at a time, here; fp32 and bf16 on AVX-512, every query of a KV head together, attention.cpp).
// The functions Python calls are declared in kernels.h (namespace layerskip) and bound in layer_span.cpp.
#include "kernels.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cmath>
#include <vector>

namespace {

// ------------------------------------------------------------------------------------------- AVX2
namespace avx2 {

// Eight dot products at once, one per vector: out[j] = ((x0+x1)+(x2+x3)) + ((x4+x5)+(x6+x7)), x_i = a[j] lane i:
// the same tree for every j, so a key's score does not depend on where in a block of 8 it falls.
inline __m256 reduce8(const __m256* a) {
  const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

using layerskip::EXP_LN2_HI;
using layerskip::EXP_LN2_LO;
using layerskip::EXP_LOG2E;
using layerskip::EXP_P;

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

// One k-chunk of 8 into the block's accumulators; TAIL: the last K % 8 columns by masked loads (zeros past K, so
// a row's tail adds exact zeros, the same in every block shape).
template <int TB, int NB, bool TAIL>
inline void chunk(__m256 (&acc)[TB][NB], const float* x, const float* w, int64_t K, int64_t k, __m256i m) {
  __m256 wv[NB];
  for (int r = 0; r < NB; ++r) wv[r] = TAIL ? _mm256_maskload_ps(w + r * K + k, m) : _mm256_loadu_ps(w + r * K + k);
  for (int t = 0; t < TB; ++t) {
    const __m256 xv = TAIL ? _mm256_maskload_ps(x + t * K + k, m) : _mm256_loadu_ps(x + t * K + k);
    for (int r = 0; r < NB; ++r) acc[t][r] = _mm256_fmadd_ps(xv, wv[r], acc[t][r]);
  }
}

// TB tokens x NB weight rows per block: TB * NB accumulators stay in registers; any K.
template <int TB, int NB>
inline void block(const float* x, const float* w, float* y, int64_t K, int64_t N) {
  __m256 acc[TB][NB];
  for (int t = 0; t < TB; ++t)
    for (int r = 0; r < NB; ++r) acc[t][r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) chunk<TB, NB, false>(acc, x, w, K, k, _mm256_setzero_si256());
  if (k < K) chunk<TB, NB, true>(acc, x, w, K, k, layerskip::simd::first8(K - k));
  for (int t = 0; t < TB; ++t)
    for (int r = 0; r < NB; ++r) y[t * N + r] = hsum(acc[t][r]);
}

template <int NB>
inline void rows(const float* x, const float* w, float* y, int64_t T, int64_t K, int64_t N, int64_t n) {
  int64_t t = 0;
  for (; t + 4 <= T; t += 4) block<4, NB>(x + t * K, w + n * K, y + t * N + n, K, N);
  for (; t + 2 <= T; t += 2) block<2, NB>(x + t * K, w + n * K, y + t * N + n, K, N);
  for (; t < T; ++t) block<1, NB>(x + t * K, w + n * K, y + t * N + n, K, N);
}

// Weight rows in blocks of 8 [b0, b1): one token streams 8 rows at once; several share 4-row halves.
void f32_range(const float* x, const float* w, float* y, int64_t T, int64_t K, int64_t N, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n = b * 8;
    if (n + 8 <= N && T == 1) {
      block<1, 8>(x, w + n * K, y + n, K, N);
    } else if (n + 8 <= N) {
      rows<4>(x, w, y, T, K, N, n);
      rows<4>(x, w, y, T, K, N, n + 4);
    } else {
      for (int64_t m = n; m < N; ++m) rows<1>(x, w, y, T, K, N, m);
    }
  }
}

}  // namespace avx2

// ----------------------------------------------------------------------------------------- AVX-512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace avx512 {

inline float hsum(__m512 v) {
  const __m256 lo = _mm512_castps512_ps256(v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return avx2::hsum(_mm256_add_ps(lo, hi));
}

// RMSNorm of one row: the sum of squares in 16 fp32 lanes over the row in order, then the same horizontal sum.
inline float inv_rms(const float* x, int64_t d, float eps) {
  __m512 acc = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= d; k += 16) {
    const __m512 v = _mm512_loadu_ps(x + k);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  if (k < d) {
    const __m512 v = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (d - k)) - 1), x + k);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  return 1.0f / std::sqrt(hsum(acc) / static_cast<float>(d) + eps);
}

void rms_norm_f32(const float* x, const float* w, float* y, int64_t rows, int64_t d, float eps) {
  for (int64_t t = 0; t < rows; ++t, x += d, y += d) {
    const float rs = inv_rms(x, d, eps);
    const __m512 r = _mm512_set1_ps(rs);
    int64_t k = 0;
    for (; k + 16 <= d; k += 16)
      _mm512_storeu_ps(y + k, _mm512_mul_ps(_mm512_loadu_ps(w + k), _mm512_mul_ps(_mm512_loadu_ps(x + k), r)));
    for (; k < d; ++k) y[k] = w[k] * (x[k] * rs);
  }
}

// bf16 rows as HF's LlamaRMSNorm computes them: normalise in fp32, round to bf16, times the bf16 weight (the
// product rounded to bf16 again, as torch multiplies two bf16 tensors).
using layerskip::simd::widen;

inline __m512 load_bf16(const c10::BFloat16* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

inline __m256i narrow(__m512 v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }  // round to nearest even

// d % 16 == 0.
void rms_norm_bf16(const c10::BFloat16* x, const c10::BFloat16* w, c10::BFloat16* y, int64_t rows, int64_t d,
                   float eps) {
  for (int64_t t = 0; t < rows; ++t, x += d, y += d) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < d; k += 16) {
      const __m512 v = load_bf16(x + k);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(hsum(acc) / static_cast<float>(d) + eps));
    for (int64_t k = 0; k < d; k += 16) {
      const __m512 normed = widen(narrow(_mm512_mul_ps(load_bf16(x + k), r)));  // x32.to(bf16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + k), narrow(_mm512_mul_ps(load_bf16(w + k), normed)));
    }
  }
}

}  // namespace avx512
#pragma GCC pop_options

// ------------------------------------------------------------------------------------- AVX2 row attention
// fp32 only, any head dim (its last D % 8 dims by masked loads): one query row at a time over its visible keys, so
// CPUs without AVX-512 keep T-token verification bitwise equal to one-token decoding in fp32. Its own arithmetic
// (scores by a reduction tree, two chains of keys): equal to the AVX-512 path's (attention.cpp) to rounding, not
// bitwise; each path is batch invariant on its own.
namespace avx2 {

struct Rows {  // strides in elements; the last dim of every tensor is contiguous
  int64_t S, D, kh, ks, vh, vs;  // keys; head dim; k head/row strides; v head/row strides
  float scale;
};

// exp(x) for x <= 0, 8 lanes: Cephes' expf (layerskip::EXP_*), times 2^n from the exponent bits (the clamp at -88
// keeps n + 127 >= 0). Elementwise: a score's exp does not depend on its lane.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 hi = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), hi);
  __m256 p = _mm256_set1_ps(EXP_P[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[i]));
  const __m256 e = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(e, _mm256_castsi256_ps(two_n));
}

constexpr int MAX_CHUNKS = 32;  // D <= 256

// One query row against one KV head's keys: every visible key's score in blocks of 8 (``reduce8``); their max, exp
// and the weighted sum of their values in ascending order, the n-th visible key into sum n % 2. ``score`` and
// ``seen``: S + 16 entries of scratch.
inline void attend_row(const float* q, const float* k, const float* v, const bool* vis, const Rows& r,
                       float* score, int64_t* seen, float* out) {
  const int64_t full = r.D / 8, nc = (r.D + 7) / 8;  // whole chunks of 8 dims; all chunks, a masked last one
  const __m256i tail = layerskip::simd::first8(r.D - 8 * full);
  const auto load = [&](const float* p, int64_t c) {  // zeros past D
    return c < full ? _mm256_loadu_ps(p + 8 * c) : _mm256_maskload_ps(p + 8 * c, tail);
  };
  int64_t n = 0;
  for (int64_t s = 0; s < r.S; ++s) seen[n] = s, n += vis == nullptr || vis[s];
  for (int64_t i = 0; i < n; i += 8) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < nc; ++c) {
      const __m256 qv = load(q, c);
      for (int j = 0; j < 8; ++j)  // past the last key: the last key again (its score is not used)
        acc[j] = _mm256_fmadd_ps(qv, load(k + seen[std::min(i + j, n - 1)] * r.ks, c), acc[j]);
    }
    _mm256_storeu_ps(score + i, _mm256_mul_ps(reduce8(acc), _mm256_set1_ps(r.scale)));
  }
  float m = -INFINITY, sums[2] = {0.0f, 0.0f};
  for (int64_t i = 0; i < n; ++i) m = std::max(m, score[i]);
  for (int64_t i = 0; i < n; i += 8)  // up to 7 scratch entries past n: computed, never read
    _mm256_storeu_ps(score + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(score + i), _mm256_set1_ps(m))));
  __m256 acc[MAX_CHUNKS], odd[MAX_CHUNKS];
  for (int64_t c = 0; c < nc; ++c) acc[c] = odd[c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 2) {
    const __m256 p = _mm256_set1_ps(score[i]);
    sums[0] += score[i];
    for (int64_t c = 0; c < nc; ++c) acc[c] = _mm256_fmadd_ps(p, load(v + seen[i] * r.vs, c), acc[c]);
    if (i + 1 == n) break;
    const __m256 p1 = _mm256_set1_ps(score[i + 1]);
    sums[1] += score[i + 1];
    for (int64_t c = 0; c < nc; ++c) odd[c] = _mm256_fmadd_ps(p1, load(v + seen[i + 1] * r.vs, c), odd[c]);
  }
  const __m256 inv = _mm256_set1_ps(n > 0 ? 1.0f / (sums[0] + sums[1]) : 0.0f);  // no visible key: zeros
  for (int64_t c = 0; c < nc; ++c) {
    const __m256 o = _mm256_mul_ps(_mm256_add_ps(acc[c], odd[c]), inv);
    if (c < full) _mm256_storeu_ps(out + 8 * c, o);
    else _mm256_maskstore_ps(out + 8 * c, tail, o);
  }
}

// Items [i0, i1) of the (query head, row) pairs, row-minor: q (Hq, T, D) at strides qh, qt; mask (T, S); out (T, Hq,
// D) contiguous. Query head h reads KV head h / G.
void attend_range(const float* q, int64_t qh, int64_t qt, const float* k, const float* v, const bool* mask, float* out,
                  int64_t Hq, int64_t T, int64_t G, const Rows& r, int64_t i0, int64_t i1) {
  std::vector<float> score(r.S + 16);
  std::vector<int64_t> seen(r.S + 16);
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t h = i / T, t = i % T, j = h / G;
    attend_row(q + h * qh + t * qt, k + j * r.kh, v + j * r.vh, mask == nullptr ? nullptr : mask + t * r.S, r,
               score.data(), seen.data(), out + (t * Hq + h) * r.D);
  }
}

}  // namespace avx2

// ------------------------------------------------------------------------------------------ dispatch
struct Isa {
  bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  bool bf16 = avx512 && __builtin_cpu_supports("avx512bf16");
};

const Isa& isa() {
  static const Isa found = [] {
    Isa i;
    const char* force = std::getenv("LAYERSKIP_KERNEL_ISA");  // "avx2": the AVX2 path even on AVX-512 CPUs
    if (force != nullptr && std::string(force) == "avx2") i.avx512 = i.bf16 = false;
    return i;
  }();
  return found;
}

}  // namespace

namespace layerskip {

std::string path_name() { return isa().avx512 ? "avx512" : "avx2"; }

bool supports_bf16() { return isa().bf16; }

int64_t parallel_threads() {
  std::vector<char> seen(at::get_num_threads() + 1, 0);
  // One item per grain, as many items as the matmuls of a large matrix: each thread marks itself.
  const int64_t last = int64_t(seen.size()) - 1;
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) { seen[std::min<int64_t>(at::get_thread_num(), last)] = 1; });
  int64_t n = 0;
  for (char c : seen) n += c;
  return n;
}

torch::Tensor small_matmul(const torch::Tensor& x, const torch::Tensor& w) {
  const bool bf16 = x.dtype() == torch::kBFloat16;
  TORCH_CHECK(x.dtype() == w.dtype() && (bf16 || x.dtype() == torch::kFloat32), "x and w both fp32 or both bf16");
  TORCH_CHECK(!bf16 || isa().bf16, "bf16 needs a CPU with AVX512_BF16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x (T, K) and w (N, K)");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "CPU tensors only");
  if (isa().avx512) return panel_matmul(x, pack_panels(w), w.size(0));  // packed on the fly (the runner packs once)
  const auto xc = x.contiguous();
  const auto wc = w.contiguous();
  const int64_t T = xc.size(0), K = xc.size(1), N = wc.size(0);
  auto y = torch::empty({T, N}, xc.options());
  if (T == 0 || N == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + 7) / 8, 32, [&](int64_t b0, int64_t b1) { avx2::f32_range(xp, wp, yp, T, K, N, b0, b1); });
  return y;
}

// x (rows, d), w (d,): w * (x * rsqrt(mean(x^2) + eps)), one row at a time (batch invariant); fp32, or bf16 in HF's
// arithmetic. The Python side calls it on the AVX-512 path only; torch's norm elsewhere.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  const bool bf16 = x.dtype() == torch::kBFloat16;
  TORCH_CHECK(isa().avx512 && (!bf16 || isa().bf16), "rms_norm: AVX-512 path only (bf16: with AVX512_BF16)");
  TORCH_CHECK(x.dtype() == w.dtype() && (bf16 || x.dtype() == torch::kFloat32) && x.device().is_cpu(),
              "fp32 or bf16 CPU tensors");
  TORCH_CHECK(x.size(-1) == w.numel() && w.is_contiguous() && (!bf16 || w.numel() % 16 == 0),
              "w (d,) for x (..., d); bf16: d % 16 == 0");
  const auto xc = x.contiguous();
  auto y = torch::empty_like(xc);
  const int64_t d = w.numel();
  if (bf16) {
    avx512::rms_norm_bf16(reinterpret_cast<const c10::BFloat16*>(xc.data_ptr()),
                          reinterpret_cast<const c10::BFloat16*>(w.data_ptr()),
                          reinterpret_cast<c10::BFloat16*>(y.data_ptr()), xc.numel() / d, d, static_cast<float>(eps));
  } else {
    avx512::rms_norm_f32(xc.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), xc.numel() / d, d,
                         static_cast<float>(eps));
  }
  return y;
}

// q (Hq, T, D) over k, v (Hkv, S, D) (any strides, the last dim contiguous), ``mask`` (T, S) bool or None (all
// visible): softmax(q k^T scale) v per query row, each row as it computes alone; fp32 or bf16 (fp32 arithmetic, the
// output rounded once) on the AVX-512 path (attention.cpp: every query of a KV head over each key load), fp32 on
// the AVX2 path (``avx2::attend_row``). Returns (Hq, T, D) as a view of a (T, Hq, D) tensor.
torch::Tensor attend_rows(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const c10::optional<torch::Tensor>& mask, double scale) {
  const bool bf16 = q.dtype() == torch::kBFloat16, wide = isa().avx512;
  TORCH_CHECK(!bf16 || (wide && isa().bf16), "attend_rows: bf16 runs on the AVX-512 path with AVX512_BF16 only");
  TORCH_CHECK(q.dtype() == k.dtype() && q.dtype() == v.dtype() && (bf16 || q.dtype() == torch::kFloat32) &&
              q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "fp32 or bf16 CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(2) == k.size(2) &&
              k.size(0) > 0 && q.size(0) % k.size(0) == 0 && q.size(2) <= 256,
              "q (Hq, T, D), k and v (Hkv, S, D), Hq = G Hkv, D <= 256");
  const auto qc = q.stride(2) == 1 ? q : q.contiguous();
  const auto kc = k.stride(2) == 1 ? k : k.contiguous();
  const auto vc = v.stride(2) == 1 ? v : v.contiguous();
  const int64_t Hq = q.size(0), T = q.size(1), D = q.size(2), S = k.size(1);
  torch::Tensor mc;
  if (mask.has_value()) {
    mc = mask->contiguous();
    TORCH_CHECK(mc.dtype() == torch::kBool && mc.dim() == 2 && mc.size(0) == T && mc.size(1) == S, "mask (T, S) bool");
  }
  const bool* mp = mc.defined() ? mc.data_ptr<bool>() : nullptr;
  if (wide) return wide_attention(qc, kc, vc, mp, scale).transpose(0, 1);
  const avx2::Rows r{S, D, kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), static_cast<float>(scale)};
  auto out = torch::empty({T, Hq, D}, q.options());
  const int64_t G = Hq / k.size(0);
  at::parallel_for(0, Hq * T, 4, [&](int64_t i0, int64_t i1) {
    avx2::attend_range(qc.data_ptr<float>(), qc.stride(0), qc.stride(1), kc.data_ptr<float>(), vc.data_ptr<float>(),
                       mp, out.data_ptr<float>(), Hq, T, G, r, i0, i1);
  });
  return out.transpose(0, 1);
}

// ``attend_rows`` after writing k, v (Hkv, T, D) at slots [start, start + T) of layer ``layer`` of the caches ck, cv
// (L, Hkv, C, D), over that layer's slots [0, start + T): one call from Python instead of five.
torch::Tensor attend_cache(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& ck, const torch::Tensor& cv, int64_t layer, int64_t start,
                           const c10::optional<torch::Tensor>& mask, double scale) {
  TORCH_CHECK(ck.dim() == 4 && cv.sizes() == ck.sizes() && k.dim() == 3 && start + k.size(1) <= ck.size(2),
              "caches (L, Hkv, C, D) with room for k's T rows");
  auto kl = ck.select(0, layer), vl = cv.select(0, layer);  // (Hkv, C, D) views
  kl.narrow(1, start, k.size(1)).copy_(k);
  vl.narrow(1, start, v.size(1)).copy_(v);
  return attend_rows(q, kl.narrow(1, 0, start + k.size(1)), vl.narrow(1, 0, start + k.size(1)), mask, scale);
}

}  // namespace layerskip
