// Decoding attention on the AVX-512 path: softmax(q k^T scale) v for every query row of one call, fp32, or bf16 with
// AVX512_BF16 (fp32 arithmetic, the output rounded once). ``attend_rows`` (small_matmul.cpp) checks the arguments
// and calls ``wide_attention`` here.
//
// The query heads that share a KV head and all the call's rows run together: a KV head's keys are transposed once
// per call into blocks of 16 keys, head dim major (``pack_keys``: for each dim, or each pair of dims in bf16, the
// block's 16 keys side by side), so one vector holds 16 keys' terms and a query's 16 scores need no horizontal sum;
// a block's loads serve up to 4 queries, and each value row's loads serve up to 4 queries.
//
// Batch invariance (tests/infer/test_kernel_attention.py): each query's output is bitwise what it computes alone over
// just its visible keys, whatever T is, wherever the mask has gaps, whichever queries share its tile and however the
// work is split over threads:
//   score        one fp32 chain over the head dim in order from zero (fmadd; bf16: vdpbf16ps over pairs of dims),
//                times ``scale``: each score on its own;
//   max          exact in any order;
//   exp          elementwise (``exp16``, Cephes' expf); a masked key's weight is an exact zero;
//   sum, values  one chain each over the keys in ascending order from zero, so the masked keys' zeros leave the chain
//                what it is over the visible keys alone (x + 0 = x; a chain that starts at +0 never holds -0).
// A row with no visible key gives zeros.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using BF16 = c10::BFloat16;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace wide {

constexpr int64_t LANES = 16;  // keys per block
constexpr int QUERY_TILE = 4;  // queries per register tile (scores: x 2 blocks; values: x 4 chunks of 16 dims)
constexpr int64_t MAX_QUERIES = 48;  // queries per work item: 16 rows of a group of 3 heads in one item
constexpr int64_t FETCH_BYTES = 256 << 10;  // a KV head's keys and values up to this size are prefetched first

using layerskip::simd::first;
using layerskip::simd::first32;
using layerskip::simd::widen;

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const BF16* p, __mmask16 m) { return widen(_mm256_maskz_loadu_epi16(m, p)); }
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(BF16* p, __m512 v, __mmask16 m) {  // round to nearest even
  _mm256_mask_storeu_epi16(p, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

// 16 dwords of a row starting at dword ``w`` of D_w (fp32: floats; bf16: pairs of dims, D elements), zeros past it.
inline __m512i row_dwords(const float* row, int64_t w, int64_t Dw) {
  return _mm512_maskz_loadu_epi32(first(Dw - w), row + w);
}
inline __m512i row_dwords(const BF16* row, int64_t w, int64_t D) {
  return _mm512_maskz_loadu_epi16(first32(D - 2 * w), row + 2 * w);
}

// r[i] lane j -> r[j] lane i, 16 x 16 dwords: within 128-bit blocks (unpack 32, then 64), then across blocks.
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4 i + c], block L: column 4 L + c of rows 4 i .. 4 i + 3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), b = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i e = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i f = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(a, e, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(a, e, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(b, f, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(b, f, 0xDD);
  }
}

// Whether this CPU's vdpbf16ps adds a lane's high product to the accumulator, then its low one, each sum rounded to
// fp32 (Intel's documented order; measured on Zen 4 against both other orders and one rounding over 3.2 M random
// lanes): then ``pair_tile``'s pairs of keys are one chain over the keys in order. Two lanes tell it apart, checked
// once: 1 + (-1) + 2^-30 is 2^-30 only with the high product first; 1 + 2^-24 + 2^-24 is 1 only with a rounding
// after each product. Elsewhere, or with LAYERSKIP_ATTENTION_PAIRS=off, bf16 values take ``value_tile``'s one key at a
// time.
inline bool sequential_pairs() {
  static const bool found = [] {
    const char* force = std::getenv("LAYERSKIP_ATTENTION_PAIRS");
    if (force != nullptr && std::string(force) == "off") return false;
    const auto pair = [](float high, float low) {
      return static_cast<int32_t>((uint32_t(BF16(high).x) << 16) | BF16(low).x);
    };
    const __m512i a = _mm512_setr_epi32(pair(-1.0f, 0x1p-15f), pair(0x1p-12f, 0x1p-12f), 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                        0, 0, 0, 0, 0);
    const __m512i b = _mm512_setr_epi32(pair(1.0f, 0x1p-15f), pair(0x1p-12f, 0x1p-12f), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                        0, 0, 0, 0);
    float out[16];
    _mm512_storeu_ps(out, _mm512_dpbf16_ps(_mm512_set1_ps(1.0f), reinterpret_cast<__m512bh>(a),
                                           reinterpret_cast<__m512bh>(b)));
    return out[0] == 0x1p-30f && out[1] == 1.0f;
  }();
  return found;
}

// The call's sizes and strides (elements; the last dim contiguous).
struct Shape {
  int64_t Hq, T, G, S, D, Dw;  // query heads, rows, heads per KV head, keys, head dim, dwords per row (bf16: D / 2 up)
  int64_t Dp;  // Dw rounded up to 16: a packed key block's dword columns
  int64_t qh, qt, kh, ks, vh, vs;  // q (Hq, T, D), k and v (Hkv, S, D) strides
  float scale;
};

// Keys [0, S) of one KV head into blocks of 16, dword-column major: kt[(b Dp + w) 16 + i] = dword w of key 16 b + i
// (zeros past S and past Dw). kt: nb Dp 16 dwords, nb = ceil(S / 16), Dp = Dw rounded up to 16.
template <class E>
void pack_keys(const E* k, const Shape& s, int32_t* kt) {
  const int64_t nb = (s.S + LANES - 1) / LANES, Dp = s.Dp, D = s.D, ks = s.ks;
  const int64_t width = sizeof(E) == 2 ? D : s.Dw;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t keys = s.S - b * LANES;
    for (int64_t w = 0; w < Dp; w += LANES, kt += LANES * LANES) {
      __m512i r[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) r[i] = row_dwords(k + (b * LANES + i) * ks, w, i < keys ? width : 0);
      transpose16(r);
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c) _mm512_storeu_si512(kt + c * LANES, r[c]);
    }
  }
}

// Lane i's term of a dword of the query (broadcast) and a dword column of a key block: fp32 fmadd, or bf16 vdpbf16ps
// (each lane adds its pair's two products).
inline __m512 term(__m512 acc, int32_t q, __m512i keys, float) {
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_set1_epi32(q)), _mm512_castsi512_ps(keys), acc);
}
inline __m512 term(__m512 acc, int32_t q, __m512i keys, BF16) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(_mm512_set1_epi32(q)), reinterpret_cast<__m512bh>(keys));
}

// Which of keys [16 b, 16 b + 16) row ``vis`` (null: all of [0, S)) sees.
inline __mmask16 visible(const bool* vis, int64_t b, int64_t S) {
  const __mmask16 in = first(S - b * LANES);
  if (vis == nullptr) return in;
  const __m128i bytes = _mm_maskz_loadu_epi8(in, vis + b * LANES);
  return _mm_test_epi8_mask(bytes, bytes);
}

// Scores of QN queries (dwords qs, Dw each) against KB blocks from block b: (dot product) scale, -inf where the
// query's row does not see the key. score rows: QN of them, ``stride`` apart, nb 16 entries each.
template <class E, int QN, int KB>
void score_tile(const int32_t* qs, const int32_t* kt, const bool* const* vis, const Shape& s, int64_t b, float* score,
                int64_t stride) {
  __m512 acc[QN][KB];
  for (int q = 0; q < QN; ++q)
    for (int j = 0; j < KB; ++j) acc[q][j] = _mm512_setzero_ps();
  const int64_t Dw = s.Dw, Dp = s.Dp;
  for (int64_t w = 0; w < Dw; ++w) {
    __m512i keys[KB];
#pragma GCC unroll 2
    for (int j = 0; j < KB; ++j) keys[j] = _mm512_loadu_si512(kt + ((b + j) * Dp + w) * LANES);
#pragma GCC unroll 4
    for (int q = 0; q < QN; ++q)
#pragma GCC unroll 2
      for (int j = 0; j < KB; ++j) acc[q][j] = term(acc[q][j], qs[q * Dw + w], keys[j], E());
  }
  for (int q = 0; q < QN; ++q)
    for (int j = 0; j < KB; ++j) {
      const __m512 v = _mm512_mul_ps(acc[q][j], _mm512_set1_ps(s.scale));
      _mm512_storeu_ps(score + q * stride + (b + j) * LANES,
                       _mm512_mask_blend_ps(visible(vis[q], b + j, s.S), _mm512_set1_ps(-INFINITY), v));
    }
}

// exp(x), 16 lanes: Cephes' expf (layerskip::EXP_*), 2^n by scalef.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(layerskip::EXP_LOG2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 hi = _mm512_fnmadd_ps(n, _mm512_set1_ps(layerskip::EXP_LN2_HI), x);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(layerskip::EXP_LN2_LO), hi);
  __m512 p = _mm512_set1_ps(layerskip::EXP_P[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(layerskip::EXP_P[i]));
  return _mm512_scalef_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f))), n);
}

// A query's scores (nb blocks) -> exp(score - max), an exact zero where masked (all zeros when nothing is visible).
// The max passes over a NaN score, as std::max(m, score) does (vmaxps returns its second operand on a NaN).
inline void weights(float* score, int64_t nb) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t b = 0; b < nb; ++b) mx = _mm512_max_ps(_mm512_loadu_ps(score + b * LANES), mx);
  const float m = _mm512_reduce_max_ps(mx);
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 x = _mm512_loadu_ps(score + b * LANES);
    const __mmask16 seen = m == -INFINITY ? 0 : _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ);
    _mm512_storeu_ps(score + b * LANES, _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(x, _mm512_set1_ps(m)))));
  }
}

// QN queries' accumulators (4 vectors each) and weight sums, all zero.
template <int QN>
__attribute__((always_inline)) inline void clear(__m512 (&acc)[QN][4], __m512 (&sum)[QN]) {
#pragma GCC unroll 8
  for (int q = 0; q < QN; ++q) {
    sum[q] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) acc[q][c] = _mm512_setzero_ps();
  }
}

// 1 / a weight sum that every lane holds; 0 where the sum is 0 (no visible key: the output is zeros).
inline __m512 inverse(__m512 sum) {
  const __mmask16 some = _mm512_cmp_ps_mask(sum, _mm512_setzero_ps(), _CMP_NEQ_UQ);
  return _mm512_maskz_div_ps(some, _mm512_set1_ps(1.0f), sum);
}

// Dims [16 c0, 16 c0 + 64) of QN queries' outputs: the weights' sum and the weighted sum of the values, each one
// chain over keys [0, S) in order, the values' sums times 1 / the weights' sum (none: 0). p: QN weight rows.
template <class E, int QN>
void value_tile(const E* v, const Shape& s, const float* const* p, int64_t c0, E* const* out) {
  __mmask16 mk[4];
  for (int c = 0; c < 4; ++c) mk[c] = first(s.D - LANES * (c0 + c));
  __m512 acc[QN][4], sum[QN];
  clear<QN>(acc, sum);
  const float* pq[QN];
  for (int q = 0; q < QN; ++q) pq[q] = p[q];
  const int64_t S = s.S, vs = s.vs;
  const E* row = v + LANES * c0;
  for (int64_t key = 0; key < S; ++key, row += vs) {
    __m512 x[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) x[c] = load16(row + LANES * c, mk[c]);
#pragma GCC unroll 8
    for (int q = 0; q < QN; ++q) {
      const __m512 w = _mm512_set1_ps(pq[q][key]);
      sum[q] = _mm512_add_ps(sum[q], w);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) acc[q][c] = _mm512_fmadd_ps(w, x[c], acc[q][c]);
    }
  }
#pragma GCC unroll 8
  for (int q = 0; q < QN; ++q) {
    const __m512 inv = inverse(sum[q]);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) store16(out[q] + LANES * (c0 + c), _mm512_mul_ps(acc[q][c], inv), mk[c]);
  }
}

// bf16 weights in pairs of keys for ``pair_tile``: dword m = (high half: key 2 m, low half: key 2 m + 1), each weight
// rounded to bf16 (nearest even). p: a query's weights (nb blocks of 16); pairs: nb 8 dwords.
inline void weight_pairs(const float* p, int64_t nb, int32_t* pairs) {
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i words = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(p + b * LANES)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + b * 8), _mm256_ror_epi32(words, 16));
  }
}

// bf16 values over pairs of keys: dims [32 c0, 32 c0 + 64) of QN queries' outputs. vdpbf16ps adds a lane's high
// product, then its low one, each sum rounded to fp32 (``sequential_pairs``), so with a key pair's values interleaved
// (high: key 2 m, low: key 2 m + 1; ``_mm512_unpack*_epi16`` per 128-bit block, which puts dims 8 b .. 8 b + 3 of a
// 32-dim chunk in the low vector's block b and 8 b + 4 .. 8 b + 7 in the high one's) each output element, and the
// weights' sum (against ones), is one chain over the keys in order: what ``value_tile`` computes with each weight
// rounded to bf16, at half the instructions. pairs: QN rows of pair weights.
template <int QN>
void pair_tile(const BF16* v, const Shape& s, const int32_t* const* pairs, int64_t c0, BF16* const* out) {
  __mmask32 mk[2];
  for (int c = 0; c < 2; ++c) mk[c] = first32(s.D - 32 * (c0 + c));
  __m512 acc[QN][4], sum[QN];  // acc: chunk c0's low, high, chunk c0 + 1's low, high
  clear<QN>(acc, sum);
  const int32_t* pq[QN];
  for (int q = 0; q < QN; ++q) pq[q] = pairs[q];
  const __m512bh ones = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x3F803F80));  // (1.0, 1.0)
  const int64_t S = s.S, vs = s.vs;
  const BF16* row = v + 32 * c0;
  for (int64_t m = 0; 2 * m < S; ++m, row += 2 * vs) {
    const bool second = 2 * m + 1 < S;
    __m512bh half[4];
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) {
      const __m512i x = _mm512_maskz_loadu_epi16(mk[c], row + 32 * c);
      const __m512i y = _mm512_maskz_loadu_epi16(second ? mk[c] : 0, row + vs + 32 * c);
      half[2 * c] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(y, x));
      half[2 * c + 1] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(y, x));
    }
#pragma GCC unroll 8
    for (int q = 0; q < QN; ++q) {
      const __m512bh w = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pq[q][m]));
      sum[q] = _mm512_dpbf16_ps(sum[q], w, ones);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) acc[q][c] = _mm512_dpbf16_ps(acc[q][c], w, half[c]);
    }
  }
  const __m512i front = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i back = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
#pragma GCC unroll 8
  for (int q = 0; q < QN; ++q) {
    const __m512 inv = inverse(sum[q]);
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) {
      const __m512 lo = _mm512_mul_ps(acc[q][2 * c], inv), hi = _mm512_mul_ps(acc[q][2 * c + 1], inv);
      const int64_t d = 32 * (c0 + c);
      store16(out[q] + d, _mm512_permutex2var_ps(lo, front, hi), first(s.D - d));
      store16(out[q] + d + LANES, _mm512_permutex2var_ps(lo, back, hi), first(s.D - d - LANES));
    }
  }
}

template <class E, int QN>
void tile(const E* v, const Shape& s, const int32_t* qs, const int32_t* kt, const bool* const* vis, float* score,
          int64_t stride, int32_t* pairs, E* const* out) {
  const int64_t nb = (s.S + LANES - 1) / LANES;
  for (int64_t b = 0; b + 1 < nb; b += 2) score_tile<E, QN, 2>(qs, kt, vis, s, b, score, stride);
  if (nb % 2 == 1) score_tile<E, QN, 1>(qs, kt, vis, s, nb - 1, score, stride);
  const float* p[QN];
  for (int q = 0; q < QN; ++q) weights(score + q * stride, nb), p[q] = score + q * stride;
  if constexpr (sizeof(E) == 2) {
    if (pairs != nullptr) {
      const int32_t* pp[QN];
      for (int q = 0; q < QN; ++q) weight_pairs(p[q], nb, pairs + q * stride / 2), pp[q] = pairs + q * stride / 2;
      for (int64_t c0 = 0; 32 * c0 < s.D; c0 += 2) pair_tile<QN>(v, s, pp, c0, out);
      return;
    }
  }
  for (int64_t c0 = 0; c0 * LANES < s.D; c0 += 4) value_tile<E, QN>(v, s, p, c0, out);
}

// Prefetch rows [0, S) of a KV head's keys or values (``stride`` apart) into L1: a decoding step finds them in memory
// (the weights streamed since evicted them), and the packing and value loops would otherwise wait on one row at a time.
// Only up to FETCH_BYTES of keys and values (measured: at 200 cached keys it saves 0.4-0.8 ms of a bf16 step; at 2000,
// 512 KB a head in bf16, it cost 0.4-0.6 ms).
template <class E>
void fetch(const E* rows, int64_t stride, const Shape& s) {
  const int64_t bytes = s.D * int64_t(sizeof(E));
  for (int64_t r = 0; r < s.S; ++r)
    for (int64_t b = 0; b < bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rows + r * stride) + b, _MM_HINT_T0);
}

// Queries [u0, u1) of KV head j (query u: row u / G, head j G + u % G): pack the head's keys, then tiles of
// QUERY_TILE queries.
template <class E>
void attend_item(const E* q, const E* k, const E* v, const bool* mask, E* out, const Shape& s, int64_t j, int64_t u0,
                 int64_t u1) {
  const int64_t nb = (s.S + LANES - 1) / LANES, stride = nb * LANES;
  thread_local std::vector<int32_t> kt, qs, pairs;
  thread_local std::vector<float> score;
  const bool paired = sizeof(E) == 2 && sequential_pairs();
  pairs.resize(paired ? QUERY_TILE * stride / 2 : 0);
  int32_t* pp = paired ? pairs.data() : nullptr;
  kt.resize(nb * s.Dp * LANES);
  qs.assign(QUERY_TILE * s.Dw, 0);
  score.resize(QUERY_TILE * stride);
  if (2 * s.S * s.D * int64_t(sizeof(E)) <= FETCH_BYTES) {
    fetch(k + j * s.kh, s.ks, s);
    fetch(v + j * s.vh, s.vs, s);
  }
  pack_keys(k + j * s.kh, s, kt.data());
  for (int64_t a = u0; a < u1; a += QUERY_TILE) {
    const int n = static_cast<int>(std::min<int64_t>(QUERY_TILE, u1 - a));
    const bool* vis[QUERY_TILE];
    E* outs[QUERY_TILE];
    for (int i = 0; i < n; ++i) {
      const int64_t t = (a + i) / s.G, h = j * s.G + (a + i) % s.G;
      std::memcpy(qs.data() + i * s.Dw, q + h * s.qh + t * s.qt, s.D * sizeof(E));  // bf16, odd D: the pad stays 0
      vis[i] = mask == nullptr ? nullptr : mask + t * s.S;
      outs[i] = out + (t * s.Hq + h) * s.D;
    }
    const E* vj = v + j * s.vh;
    if (n == 4) tile<E, 4>(vj, s, qs.data(), kt.data(), vis, score.data(), stride, pp, outs);
    else if (n == 3) tile<E, 3>(vj, s, qs.data(), kt.data(), vis, score.data(), stride, pp, outs);
    else if (n == 2) tile<E, 2>(vj, s, qs.data(), kt.data(), vis, score.data(), stride, pp, outs);
    else tile<E, 1>(vj, s, qs.data(), kt.data(), vis, score.data(), stride, pp, outs);
  }
}

}  // namespace wide
#pragma GCC pop_options

// Work items: (KV head, a run of its G T queries). Each head's queries in runs of up to MAX_QUERIES, and in more runs
// where that gives every thread two items, as long as each run keeps a full tile (a run packs its head's keys again).
template <class E>
void attend_all(const E* q, const E* k, const E* v, const bool* mask, E* out, const wide::Shape& s, int64_t Hkv) {
  const int64_t queries = s.G * s.T, threads = at::get_num_threads();
  const int64_t spread = std::min((2 * threads + Hkv - 1) / Hkv, queries / wide::QUERY_TILE);
  const int64_t runs = std::max({int64_t(1), (queries + wide::MAX_QUERIES - 1) / wide::MAX_QUERIES,
                                 threads > 1 ? spread : 1});
  at::parallel_for(0, Hkv * runs, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t j = i / runs, r = i % runs;
      wide::attend_item(q, k, v, mask, out, s, j, r * queries / runs, (r + 1) * queries / runs);
    }
  });
}

}  // namespace

namespace layerskip {

bool bf16_value_pairs() { return path_name() == "avx512" && supports_bf16() && wide::sequential_pairs(); }

torch::Tensor wide_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const bool* mask, double scale) {
  const bool bf16 = q.scalar_type() == torch::kBFloat16;
  const int64_t Hq = q.size(0), T = q.size(1), D = q.size(2), Hkv = k.size(0);
  const int64_t Dw = bf16 ? (D + 1) / 2 : D;
  const wide::Shape s{Hq, T, Hq / Hkv, k.size(1), D, Dw, (Dw + wide::LANES - 1) / wide::LANES * wide::LANES,
                      q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                      static_cast<float>(scale)};
  auto out = torch::empty({T, Hq, D}, q.options());  // (T, Hq, D)
  if (bf16) {
    attend_all(reinterpret_cast<const BF16*>(q.data_ptr()), reinterpret_cast<const BF16*>(k.data_ptr()),
               reinterpret_cast<const BF16*>(v.data_ptr()), mask, reinterpret_cast<BF16*>(out.data_ptr()), s, Hkv);
  } else {
    attend_all(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), mask, out.data_ptr<float>(), s, Hkv);
  }
  return out;
}

}  // namespace layerskip
