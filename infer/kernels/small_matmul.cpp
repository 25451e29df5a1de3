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
//   avx2    fp32, 8 lanes, one dot product per output element (one vector accumulator, k-chunks in sequence, then the
//           same horizontal sum): one token streams 8 rows at once, several share 4-row halves; and its own row
//           attention (the file is compiled with -mavx2 -mfma; AVX-512 code is in target regions).
// Elsewhere the Python side uses torch (the portable path).
//
// On the AVX-512 path the module also has the RMSNorm of a row (``rms_norm``); on both paths decoding attention one
// query row at a time (``attend_rows``: each row over its visible keys in ascending order, the same arithmetic
// whatever T is; fp32 on AVX2, fp32 and bf16 on AVX-512, where the query heads sharing a KV head run up to 3 at a
// time over each key and value load, each head's arithmetic unchanged).
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

// Cephes' expf, both paths' ``exp``: x = n ln2 + r (ln2 in two parts), then a degree-6 polynomial in r times 2^n.
constexpr float EXP_LOG2E = 1.44269504088896341f, EXP_LN2_HI = 0.693359375f, EXP_LN2_LO = -2.12194440e-4f;
constexpr float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                            5.0000001201e-1f};

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

// TB tokens x NB weight rows per block: TB * NB accumulators stay in registers. K % 8 == 0.
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
inline __m512 widen(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }

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

// ---- attention of one query row over the cache (batch invariant: the row's arithmetic never depends on T)
inline __mmask16 first(int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1); }
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) { return widen(_mm256_maskz_loadu_epi16(m, p)); }
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, narrow(v)); }

// Eight dot products at once, one per vector: lane i + lane i+8 of each (``fold``), then ``avx2::reduce8``'s tree:
// the same for every vector, so a key's score does not depend on where in a block of 8 it falls.
inline __m256 fold(__m512 a) { return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)); }
inline __m256 reduce8(const __m512* a) {
  __m256 f[8];
  for (int j = 0; j < 8; ++j) f[j] = fold(a[j]);
  return avx2::reduce8(f);
}

// exp(x), 16 lanes (``avx2::EXP_P``'s Cephes expf, 2^n by scalef); elementwise, so a score's exp does not depend on
// its lane either.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(avx2::EXP_LOG2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 hi = _mm512_fnmadd_ps(n, _mm512_set1_ps(avx2::EXP_LN2_HI), x);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(avx2::EXP_LN2_LO), hi);
  __m512 p = _mm512_set1_ps(avx2::EXP_P[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(avx2::EXP_P[i]));
  return _mm512_scalef_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f))), n);
}

struct Rows {  // strides in elements; the last dim of every tensor is contiguous
  int64_t S, D, kh, ks, vh, vs;  // keys; head dim; k head/row strides; v head/row strides
  float scale;
};

// The scores' max (16 lanes at a time: a max is exact in any order; a NaN score is passed over, as std::max(m,
// score) would: vmaxps returns its second operand when either is NaN), each score's exp(score - max) in place, and
// 1 / their sum (the n-th into sum n % 2, the two added at the end; no score: 0, so the output is zeros).
inline float softmax_weights(float* score, int64_t n) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 16) mx = _mm512_max_ps(_mm512_mask_loadu_ps(mx, first(n - i), score + i), mx);
  const float m = _mm512_reduce_max_ps(mx);
  for (int64_t i = 0; i < n; i += 16)
    store16(score + i, exp16(_mm512_sub_ps(load16(score + i, first(n - i)), _mm512_set1_ps(m))), first(n - i));
  float even = 0.0f, odd = 0.0f;  // two chains in registers
  int64_t i = 0;
  for (; i + 1 < n; i += 2) even += score[i], odd += score[i + 1];
  if (i < n) even += score[i];
  return n > 0 ? 1.0f / (even + odd) : 0.0f;
}

// Chunks [c0, c0 + 4) of the QB heads' outputs: the weighted sum of the visible keys' values in order, the n-th
// into sum n % 2 (the heads share each value load), times ``inv``.
template <class E, int NC, int QB>
inline void values(const E* v, const int64_t* seen, int64_t n, int64_t vs, const float* score, int64_t stride,
                   const float* inv, int c0, const __mmask16* mk, E* const* out) {
  constexpr int CB = NC < 4 ? NC : 4;
  const int cn = std::min(CB, NC - c0);
  __m512 acc[QB][CB], odd[QB][CB];
  for (int b = 0; b < QB; ++b)
    for (int c = 0; c < CB; ++c) acc[b][c] = odd[b][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 2) {
    const E* row = v + seen[i] * vs + 16 * c0;
    for (int c = 0; c < cn; ++c) {
      const __m512 x = load16(row + 16 * c, mk[c0 + c]);
      for (int b = 0; b < QB; ++b) acc[b][c] = _mm512_fmadd_ps(_mm512_set1_ps(score[b * stride + i]), x, acc[b][c]);
    }
    if (i + 1 == n) break;
    const E* next = v + seen[i + 1] * vs + 16 * c0;
    for (int c = 0; c < cn; ++c) {
      const __m512 x = load16(next + 16 * c, mk[c0 + c]);
      for (int b = 0; b < QB; ++b)
        odd[b][c] = _mm512_fmadd_ps(_mm512_set1_ps(score[b * stride + i + 1]), x, odd[b][c]);
    }
  }
  for (int b = 0; b < QB; ++b)
    for (int c = 0; c < cn; ++c)
      store16(out[b] + 16 * (c0 + c), _mm512_mul_ps(_mm512_add_ps(acc[b][c], odd[b][c]), _mm512_set1_ps(inv[b])),
              mk[c0 + c]);
}

// bf16 scores of 8 keys for QB heads: 32 dims a vdpbf16ps (each lane adds a pair of products, exact in fp32, into its
// accumulator), no widening; the last chunk masked (zeros add nothing).
template <int NC, int QB>
inline void pair_dots(const c10::BFloat16* const* q, const c10::BFloat16* const* key, int64_t D, __m512 (&acc)[QB][8]) {
  for (int c = 0; c < (NC + 1) / 2; ++c) {
    const int64_t left = D - 32 * c;
    const __mmask32 m = left >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << left) - 1);
    __m512i qc[QB];
    for (int b = 0; b < QB; ++b) qc[b] = _mm512_maskz_loadu_epi16(m, q[b] + 32 * c);
    for (int j = 0; j < 8; ++j) {
      const __m512i kc = _mm512_maskz_loadu_epi16(m, key[j] + 32 * c);
      for (int b = 0; b < QB; ++b)
        acc[b][j] = _mm512_dpbf16_ps(acc[b][j], reinterpret_cast<__m512bh>(qc[b]), reinterpret_cast<__m512bh>(kc));
    }
  }
}

// QB query heads of one row (D = NC chunks of 16, the last masked), all reading one KV head with the same visible
// keys (mask row ``vis``, null: all), listed in ascending order: every visible key's score for each head in blocks
// of 8 (bf16: ``pair_dots``; ``reduce8``; the heads share each key load), their max, exp (``exp16``) and the weighted sum of the values
// in that order, the n-th visible key into sum n % 2 (two dependency chains; the two added at the end). Every
// head's arithmetic is what it computes alone (QB = 1), in the same order, and a masked key adds nothing, so a row
// of a T-token call computes what the same row computes alone. ``score``: QB (S + 16) entries of scratch (head b's
// at b (S + 16)), ``seen``: S + 16.
template <class E, int NC, int QB>
void attend_heads(const E* const* q, const E* k, const E* v, const bool* vis, const Rows& r, float* score,
                  int64_t* seen, E* const* out) {
  __mmask16 mk[NC];
  for (int c = 0; c < NC; ++c) mk[c] = first(r.D - 16 * c);
  const int64_t stride = r.S + 16;
  int64_t n = 0;
  for (int64_t s = 0; s < r.S; ++s) seen[n] = s, n += vis == nullptr || vis[s];
  for (int64_t i = 0; i < n; i += 8) {
    __m512 acc[QB][8];
    const E* key[8];
    for (int j = 0; j < 8; ++j) key[j] = k + seen[std::min(i + j, n - 1)] * r.ks;  // past the last key: the last again
    for (int b = 0; b < QB; ++b)
      for (int j = 0; j < 8; ++j) acc[b][j] = _mm512_setzero_ps();
    if constexpr (sizeof(E) == 2) {
      pair_dots<NC, QB>(q, key, r.D, acc);
    } else {
      for (int c = 0; c < NC; ++c) {
        __m512 qc[QB];
        for (int b = 0; b < QB; ++b) qc[b] = load16(q[b] + 16 * c, mk[c]);
        for (int j = 0; j < 8; ++j) {
          const __m512 kc = load16(key[j] + 16 * c, mk[c]);
          for (int b = 0; b < QB; ++b) acc[b][j] = _mm512_fmadd_ps(qc[b], kc, acc[b][j]);
        }
      }
    }
    for (int b = 0; b < QB; ++b)
      _mm256_storeu_ps(score + b * stride + i, _mm256_mul_ps(reduce8(acc[b]), _mm256_set1_ps(r.scale)));
  }
  float inv[QB];
  for (int b = 0; b < QB; ++b) inv[b] = softmax_weights(score + b * stride, n);
  for (int c0 = 0; c0 < NC; c0 += 4) values<E, NC, QB>(v, seen, n, r.vs, score, stride, inv, c0, mk, out);
}

// attend_heads with NC = ceil(D / 16) fixed at compile time (1..16: head dims up to 256) and QB (1..3) heads.
template <class E, int NC = 1>
void attend_any(int64_t nc, int qb, const E* const* q, const E* k, const E* v, const bool* vis, const Rows& r,
                float* score, int64_t* seen, E* const* out) {
  if constexpr (NC < 16) {
    if (nc > NC) return attend_any<E, NC + 1>(nc, qb, q, k, v, vis, r, score, seen, out);
  }
  if (qb == 3) attend_heads<E, NC, 3>(q, k, v, vis, r, score, seen, out);
  else if (qb == 2) attend_heads<E, NC, 2>(q, k, v, vis, r, score, seen, out);
  else attend_heads<E, NC, 1>(q, k, v, vis, r, score, seen, out);
}

// The query heads reading one KV head (G of them) split into parts of up to 3, as even as they go: part p's first
// head within the group and its count.
inline int64_t parts(int64_t G) { return (G + 2) / 3; }
inline int64_t part_start(int64_t G, int64_t p) { return p * G / parts(G); }

// Items [i0, i1) of the (head part, row) pairs, Hkv parts(G) T of them, part-major; q (Hq, T, D) at strides qh, qt;
// mask (T, S); out (T, Hq, D) contiguous. Query head h reads KV head h / G.
template <class E>
void attend_range(const E* q, int64_t qh, int64_t qt, const E* k, const E* v, const bool* mask, E* out,
                  int64_t Hq, int64_t T, int64_t G, const Rows& r, int64_t i0, int64_t i1) {
  std::vector<float> score(3 * (r.S + 16));
  std::vector<int64_t> seen(r.S + 16);
  const int64_t P = parts(G);
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t g = i / T, t = i % T, j = g / P, p = g % P;
    const int64_t h0 = j * G + part_start(G, p), qb = part_start(G, p + 1) - part_start(G, p);
    const E* qs[3];
    E* outs[3];
    for (int64_t b = 0; b < qb; ++b) qs[b] = q + (h0 + b) * qh + t * qt, outs[b] = out + (t * Hq + h0 + b) * r.D;
    attend_any<E>((r.D + 15) / 16, int(qb), qs, k + j * r.kh, v + j * r.vh, mask == nullptr ? nullptr : mask + t * r.S,
                  r, score.data(), seen.data(), outs);
  }
}

}  // namespace avx512
#pragma GCC pop_options

// ------------------------------------------------------------------------------------- AVX2 row attention
// fp32 only, D % 8 == 0: the AVX-512 path's ``attend_heads`` one head at a time in 8 lanes, so CPUs without AVX-512
// keep T-token verification bitwise equal to one-token decoding in fp32. Its own arithmetic (another lane count,
// another reduction tree): equal to the AVX-512 path's to rounding, not bitwise; each path is batch invariant on its
// own.
namespace avx2 {

// exp(x) for x <= 0, 8 lanes: the AVX-512 path's Cephes expf, times 2^n from the exponent bits (the clamp at -88
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

// One query row against one KV head's keys, as ``avx512::attend_heads`` for one head: every visible key's score in
// blocks of 8; their max, exp and the weighted sum of their values in ascending order, the n-th visible key into sum
// n % 2.
// ``score`` and ``seen``: S + 16 entries of scratch.
inline void attend_row(const float* q, const float* k, const float* v, const bool* vis, const avx512::Rows& r,
                       float* score, int64_t* seen, float* out) {
  const int64_t nc = r.D / 8;
  int64_t n = 0;
  for (int64_t s = 0; s < r.S; ++s) seen[n] = s, n += vis == nullptr || vis[s];
  for (int64_t i = 0; i < n; i += 8) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < nc; ++c) {
      const __m256 qv = _mm256_loadu_ps(q + 8 * c);
      for (int j = 0; j < 8; ++j)  // past the last key: the last key again (its score is not used)
        acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + seen[std::min(i + j, n - 1)] * r.ks + 8 * c), acc[j]);
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
    for (int64_t c = 0; c < nc; ++c) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + seen[i] * r.vs + 8 * c), acc[c]);
    if (i + 1 == n) break;
    const __m256 p1 = _mm256_set1_ps(score[i + 1]);
    sums[1] += score[i + 1];
    for (int64_t c = 0; c < nc; ++c)
      odd[c] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v + seen[i + 1] * r.vs + 8 * c), odd[c]);
  }
  const __m256 inv = _mm256_set1_ps(n > 0 ? 1.0f / (sums[0] + sums[1]) : 0.0f);  // no visible key: zeros
  for (int64_t c = 0; c < nc; ++c) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(_mm256_add_ps(acc[c], odd[c]), inv));
}

// Items [i0, i1) of the (query head, row) pairs, as ``avx512::attend_range`` (fp32).
void attend_range(const float* q, int64_t qh, int64_t qt, const float* k, const float* v, const bool* mask, float* out,
                  int64_t Hq, int64_t T, int64_t G, const avx512::Rows& r, int64_t i0, int64_t i1) {
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
  TORCH_CHECK(x.size(1) % 8 == 0, "K must be a multiple of 8");
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
// visible): softmax(q k^T scale) v per query row, each row alone (``avx512::attend_heads``), fp32 or bf16 (fp32
// arithmetic, the output rounded once). Returns (Hq, T, D) as a view of a (T, Hq, D) tensor. On the AVX2 path fp32
// only, D % 8 == 0 (``avx2::attend_row``).
torch::Tensor attend_rows(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const c10::optional<torch::Tensor>& mask, double scale) {
  const bool bf16 = q.dtype() == torch::kBFloat16, wide = isa().avx512;
  TORCH_CHECK(!bf16 || (wide && isa().bf16), "attend_rows: bf16 runs on the AVX-512 path with AVX512_BF16 only");
  TORCH_CHECK(wide || q.size(-1) % 8 == 0, "attend_rows: the AVX2 path needs a head dim divisible by 8");
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
  const avx512::Rows r{S, D, kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), static_cast<float>(scale)};
  auto out = torch::empty({T, Hq, D}, q.options());
  const bool* mp = mc.defined() ? mc.data_ptr<bool>() : nullptr;
  const int64_t G = Hq / k.size(0), items = wide ? k.size(0) * avx512::parts(G) * T : Hq * T;
  at::parallel_for(0, items, wide ? 1 : 4, [&](int64_t i0, int64_t i1) {
    if (!wide) {
      avx2::attend_range(qc.data_ptr<float>(), qc.stride(0), qc.stride(1), kc.data_ptr<float>(), vc.data_ptr<float>(),
                         mp, out.data_ptr<float>(), Hq, T, G, r, i0, i1);
    } else if (bf16) {
      using B = c10::BFloat16;
      avx512::attend_range<B>(reinterpret_cast<const B*>(qc.data_ptr()), qc.stride(0), qc.stride(1),
                              reinterpret_cast<const B*>(kc.data_ptr()), reinterpret_cast<const B*>(vc.data_ptr()), mp,
                              reinterpret_cast<B*>(out.data_ptr()), Hq, T, G, r, i0, i1);
    } else {
      avx512::attend_range<float>(qc.data_ptr<float>(), qc.stride(0), qc.stride(1), kc.data_ptr<float>(),
                                  vc.data_ptr<float>(), mp, out.data_ptr<float>(), Hq, T, G, r, i0, i1);
    }
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
