// Weight-only int8 / int4 matmul for quantized drafts: y = x @ dequantize(w)^T with x (T, K) fp32 or bf16 (int4: x
// on an int8 grid first, below), y in x's dtype (infer/kernels/quant.py packs the weights and is the Python API).
//
// The layout is the panels' (panels.cpp): the weight's rows in groups of 48 (three 16-row panels; the last group
// padded with zero rows), each group one contiguous block, k-major, so a step reads a matrix as one sequential stream
// and an output needs no horizontal sum (lane l of panel q is row 48 g + 16 q + l).
//   int8 (per output channel): for each k, the group's 48 codes (int8) side by side: (G, K, 48) bytes; one scale a
//        row, (G * 48) fp32 or bf16, applied once at the end.
//   int4 (groups of ``group`` k along a row, symmetric): for each 8 consecutive k0..k0+7, each row's 8 codes in one
//        little-endian 32-bit word, the code of k0 + 2p (two's complement, -8..7) in bits 4p..4p+3 and that of
//        k0 + 2p + 1 in bits 16 + 4p..: (G, K / 8, 48) words; one scale per row and group, (G, K / group, 48) fp32
//        or bf16. So the low nibbles of a word's four bytes hold the codes of k0, k0 + 4, k0 + 1, k0 + 5 and the high
//        nibbles those of k0 + 2, k0 + 6, k0 + 3, k0 + 7: two vpdpbusd operands (and, shifted by 4p and read as
//        16-bit halves, the pairs (k0 + 2p, k0 + 2p + 1) of vdpbf16ps's layout).
// Arithmetic, activations kept in float (bf16 x widened exactly) for int8: the codes become fp32 values in registers
// (a sign extension and a convert) and are multiplied into fp32 accumulators with FMAs, one broadcast x[k] per token.
// int4 multiplies integers: each row of x is quantized per group of ``group`` k to int8 (symmetric, s = max |x| / 127,
// round half to even; quant.py's int4_activations is the same grid), the codes' sign bits flipped (code + 8, 0..15)
// and each 32-bit word split into two nibble planes of 4 k a lane, and the group's dot products summed exactly in
// int32 (AVX-512: vpdpbusd, AVX512_VNNI, which every CPU with the AVX-512 path's AVX512_BF16 has; AVX2: vpmaddubsw
// and vpmaddwd), less 8 * the sum of x's codes; a decoded code costs a third of an instruction where the fp32 route
// spent two (a shift and a vpermps) and an FMA per token. The output is rounded once to x's dtype.
//
// Batch invariance: an int8 output element is one accumulator, fmadd over k in ascending order from zero, times its
// scale; an int4 one is, group by group in ascending order, (exact int32 sum, converted exactly) * x's scale, added
// into the output as fmadd(that, scale, out) (out from zero), x's codes and scales quantized per row. Neither depends
// on T, on the pass that computes a token, or on how the row groups are split over threads: row t of a T-row call is
// bitwise the 1-row call.
//
// Paths (chosen by the module's path(): "avx512" or "avx2", LAYERSKIP_KERNEL_ISA=avx2 forces the latter): AVX-512
// runs up to 8 tokens a pass over 3 panel vectors; AVX2 the same layout as six 8-lane halves, 2 tokens a pass. The
// two paths sum in the same order per lane, so they agree bitwise too. Registered as torch operators
// (``torch.ops.layerskip_quant``), so they exist once the kernel module is loaded.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t ROWS = layerskip::PANEL_ROWS;  // weight rows per group (48)
constexpr int64_t GRAIN = 4;  // row groups per parallel chunk

// What a call multiplies: x (T, K) fp32 (bf16 widened first), one row group's codes and scales at a time.
struct Job {
  const float* x;
  int64_t T, K, group;  // group: int4's k per scale (0 for int8)
  const void* scales;
  bool bf16_scales;
  const int32_t* xw;  // int4: x's int8 codes, per 8 k two words (T, K / 8, 2) (see Acts)
  const float* xs;  // int4: x's scale per row and group (T, K / group)
  const int32_t* xc;  // int4: 8 * the sum of x's codes per row and group (T, K / group): the offset's correction
};

// int4's activations: each row's group of ``group`` k quantized to int8, symmetric (s = max |x| / 127, q =
// round-half-even(x / s) in -127..127; s = 0 gives q = 0), and the codes of each 8 k packed as two 32-bit words in the
// weight words' byte order: bytes (k0, k0+4, k0+1, k0+5) and (k0+2, k0+6, k0+3, k0+7).
struct Acts {
  std::vector<int32_t> words;
  std::vector<float> scale;
  std::vector<int32_t> corr;
};

Acts quantize_acts(const float* x, int64_t T, int64_t K, int64_t group) {
  static constexpr int ORDER[8] = {0, 4, 1, 5, 2, 6, 3, 7};  // k0 + ORDER[b] goes to byte b of the two words
  const int64_t groups = K / group;
  Acts a{std::vector<int32_t>(T * K / 4), std::vector<float>(T * groups), std::vector<int32_t>(T * groups)};
  std::vector<int8_t> q(K);
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * K;
    for (int64_t g = 0; g < groups; ++g) {
      float amax = 0.0f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) amax = std::max(amax, std::fabs(xt[k]));
      const float s = amax / 127.0f;
      int32_t sum = 0;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) {
        const float r = s == 0.0f ? 0.0f : std::nearbyint(xt[k] / s);
        q[k] = int8_t(std::min(127.0f, std::max(-127.0f, r)));
        sum += q[k];
      }
      a.scale[t * groups + g] = s;
      a.corr[t * groups + g] = 8 * sum;
    }
    auto* bytes = reinterpret_cast<int8_t*>(a.words.data() + t * K / 4);
    for (int64_t k = 0; k < K; k += 8)
      for (int b = 0; b < 8; ++b) bytes[k + b] = q[k + ORDER[b]];
  }
  return a;
}

// ------------------------------------------------------------------------------------------ AVX-512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace wide {

constexpr int PANELS = 3, PASS_MAX = 8;

inline __m512 scales16(const Job& j, int64_t i) {
  if (j.bf16_scales) return layerskip::simd::widen(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(static_cast<const c10::BFloat16*>(j.scales) + i)));
  return _mm512_loadu_ps(static_cast<const float*>(j.scales) + i);
}

// TB tokens (x rows from t0) against row group g of int8 codes w (K, 48): out (TB, 48) fp32, scaled.
template <int TB>
void pass8(const Job& j, int64_t t0, const int8_t* w, int64_t g, float* out) {
  __m512 acc[TB][PANELS];
  for (int t = 0; t < TB; ++t)
    for (int q = 0; q < PANELS; ++q) acc[t][q] = _mm512_setzero_ps();
  const float* x = j.x + t0 * j.K;
  for (int64_t k = 0; k < j.K; ++k, w += ROWS) {
    __m512 wv[PANELS];
    for (int q = 0; q < PANELS; ++q)
      wv[q] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * q))));
    for (int t = 0; t < TB; ++t) {
      const __m512 xb = _mm512_set1_ps(x[t * j.K + k]);
      for (int q = 0; q < PANELS; ++q) acc[t][q] = _mm512_fmadd_ps(wv[q], xb, acc[t][q]);
    }
  }
  for (int q = 0; q < PANELS; ++q) {
    const __m512 s = scales16(j, g * ROWS + 16 * q);
    for (int t = 0; t < TB; ++t) _mm512_storeu_ps(out + t * ROWS + 16 * q, _mm512_mul_ps(acc[t][q], s));
  }
}

// TB tokens against row group g of int4 words w (K / 8, 48): out (TB, 48) fp32. Per group of k, each lane's
// int32 sum of (code + 8) * x code over the group (vpdpbusd: the codes made unsigned by flipping their sign bit,
// two nibble planes of 4 k a word), less 8 * the sum of x's codes, converted (exactly), times x's scale, and added
// into the output as fmadd(that, scale, out).
template <int TB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"))) void pass4(const Job& j, int64_t t0, const int32_t* w, int64_t g, float* out) {
  const int64_t groups = j.K / j.group, words = j.K / 8, per = j.group / 8;
  const __m512i nib = _mm512_set1_epi32(0x0F0F0F0F), flip = _mm512_set1_epi32(0x08080808);
  for (int64_t i = 0; i < TB * ROWS; ++i) out[i] = 0.0f;
  for (int64_t kg = 0; kg < groups; ++kg) {
    __m512i acc[TB][PANELS];
    for (int t = 0; t < TB; ++t)
      for (int q = 0; q < PANELS; ++q) acc[t][q] = _mm512_setzero_si512();
    const int32_t* xw = j.xw + (t0 * words + kg * per) * 2;
    for (int64_t b = 0; b < per; ++b, w += ROWS) {
      __m512i lo[PANELS], hi[PANELS];
      for (int q = 0; q < PANELS; ++q) {
        const __m512i v = _mm512_loadu_si512(w + 16 * q);
        lo[q] = _mm512_ternarylogic_epi32(v, nib, flip, 0x6A);  // (v & nib) ^ flip
        hi[q] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(v, 4), nib, flip, 0x6A);
      }
      for (int t = 0; t < TB; ++t) {
        const __m512i xl = _mm512_set1_epi32(xw[(t * words + b) * 2]), xh = _mm512_set1_epi32(xw[(t * words + b) * 2 + 1]);
        for (int q = 0; q < PANELS; ++q) acc[t][q] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[t][q], lo[q], xl), hi[q], xh);
      }
    }
    for (int q = 0; q < PANELS; ++q) {
      const __m512 s = scales16(j, (g * groups + kg) * ROWS + 16 * q);
      for (int t = 0; t < TB; ++t) {
        const int64_t tg = (t0 + t) * groups + kg;
        const __m512 d = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[t][q], _mm512_set1_epi32(j.xc[tg]))),
                                       _mm512_set1_ps(j.xs[tg]));
        float* o = out + t * ROWS + 16 * q;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(d, s, _mm512_loadu_ps(o)));
      }
    }
  }
}

template <bool INT4>
void pass(int tb, const Job& j, int64_t t0, const void* w, int64_t g, float* out) {
  using P = void (*)(const Job&, int64_t, const void*, int64_t, float*);
  static constexpr P table[PASS_MAX] = {
#define LAYERSKIP_QUANT_PASS(TB)                                                                                     \
  [](const Job& j, int64_t t0, const void* w, int64_t g, float* out) {                                           \
    if constexpr (INT4) pass4<TB>(j, t0, static_cast<const int32_t*>(w), g, out);                                  \
    else pass8<TB>(j, t0, static_cast<const int8_t*>(w), g, out);                                                  \
  }
      LAYERSKIP_QUANT_PASS(1), LAYERSKIP_QUANT_PASS(2), LAYERSKIP_QUANT_PASS(3), LAYERSKIP_QUANT_PASS(4),
      LAYERSKIP_QUANT_PASS(5), LAYERSKIP_QUANT_PASS(6), LAYERSKIP_QUANT_PASS(7), LAYERSKIP_QUANT_PASS(8)};
#undef LAYERSKIP_QUANT_PASS
  table[tb - 1](j, t0, w, g, out);
}

}  // namespace wide
#pragma GCC pop_options

// ------------------------------------------------------------------------------------------ AVX2
namespace narrow {

constexpr int HALVES = 6, PASS_MAX = 2;  // 8-lane halves of a row group; tokens a pass

inline __m256 scales8(const Job& j, int64_t i) {
  if (j.bf16_scales) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const c10::BFloat16*>(j.scales) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  return _mm256_loadu_ps(static_cast<const float*>(j.scales) + i);
}

template <int TB>
void pass8(const Job& j, int64_t t0, const int8_t* w, int64_t g, float* out) {
  __m256 acc[TB][HALVES];
  for (int t = 0; t < TB; ++t)
    for (int h = 0; h < HALVES; ++h) acc[t][h] = _mm256_setzero_ps();
  const float* x = j.x + t0 * j.K;
  for (int64_t k = 0; k < j.K; ++k, w += ROWS) {
    __m256 xb[TB];
    for (int t = 0; t < TB; ++t) xb[t] = _mm256_set1_ps(x[t * j.K + k]);
    for (int h = 0; h < HALVES; ++h) {
      const __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 8 * h))));
      for (int t = 0; t < TB; ++t) acc[t][h] = _mm256_fmadd_ps(wv, xb[t], acc[t][h]);
    }
  }
  for (int h = 0; h < HALVES; ++h) {
    const __m256 s = scales8(j, g * ROWS + 8 * h);
    for (int t = 0; t < TB; ++t) _mm256_storeu_ps(out + t * ROWS + 8 * h, _mm256_mul_ps(acc[t][h], s));
  }
}

// int4 as the AVX-512 path computes it (the same exact integer sums: vpmaddubsw pairs, at most 2 * 15 * 127, never
// saturate; vpmaddwd adds them into int32), then the same float steps per lane.
template <int TB>
void pass4(const Job& j, int64_t t0, const int32_t* w, int64_t g, float* out) {
  const int64_t groups = j.K / j.group, words = j.K / 8, per = j.group / 8;
  const __m256i nib = _mm256_set1_epi32(0x0F0F0F0F), flip = _mm256_set1_epi32(int32_t(0x88888888u));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t i = 0; i < TB * ROWS; ++i) out[i] = 0.0f;
  for (int64_t kg = 0; kg < groups; ++kg) {
    __m256i acc[TB][HALVES];
    for (int t = 0; t < TB; ++t)
      for (int h = 0; h < HALVES; ++h) acc[t][h] = _mm256_setzero_si256();
    const int32_t* xw = j.xw + (t0 * words + kg * per) * 2;
    for (int64_t b = 0; b < per; ++b, w += ROWS) {
      __m256i xl[TB], xh[TB];
      for (int t = 0; t < TB; ++t) {
        xl[t] = _mm256_set1_epi32(xw[(t * words + b) * 2]);
        xh[t] = _mm256_set1_epi32(xw[(t * words + b) * 2 + 1]);
      }
      for (int h = 0; h < HALVES; ++h) {
        const __m256i v = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 8 * h)), flip);
        const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi32(v, 4), nib);
        for (int t = 0; t < TB; ++t) {
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl[t]), _mm256_maddubs_epi16(hi, xh[t]));
          acc[t][h] = _mm256_add_epi32(acc[t][h], _mm256_madd_epi16(p, ones));
        }
      }
    }
    for (int h = 0; h < HALVES; ++h) {
      const __m256 s = scales8(j, (g * groups + kg) * ROWS + 8 * h);
      for (int t = 0; t < TB; ++t) {
        const int64_t tg = (t0 + t) * groups + kg;
        const __m256 d = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[t][h], _mm256_set1_epi32(j.xc[tg]))),
                                       _mm256_set1_ps(j.xs[tg]));
        float* o = out + t * ROWS + 8 * h;
        _mm256_storeu_ps(o, _mm256_fmadd_ps(d, s, _mm256_loadu_ps(o)));
      }
    }
  }
}

template <bool INT4>
void pass(int tb, const Job& j, int64_t t0, const void* w, int64_t g, float* out) {
  if constexpr (INT4) {
    if (tb == 1) return pass4<1>(j, t0, static_cast<const int32_t*>(w), g, out);
    return pass4<2>(j, t0, static_cast<const int32_t*>(w), g, out);
  } else {
    if (tb == 1) return pass8<1>(j, t0, static_cast<const int8_t*>(w), g, out);
    return pass8<2>(j, t0, static_cast<const int8_t*>(w), g, out);
  }
}

}  // namespace narrow

// Row groups [g0, g1) for all T tokens in passes of at most pass_max, the tokens split evenly: y (T, N).
template <bool INT4, bool WIDE, class Out>
void groups(const Job& j, const char* w, int64_t group_bytes, Out* y, int64_t N, int64_t g0, int64_t g1) {
  constexpr int pass_max = WIDE ? wide::PASS_MAX : narrow::PASS_MAX;
  const int64_t passes = (j.T + pass_max - 1) / pass_max;
  float out[wide::PASS_MAX * ROWS];
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t rows = std::min(ROWS, N - g * ROWS);
    for (int64_t t = 0, p = 0; t < j.T; ++p) {
      const int64_t tb = (j.T - t + (passes - p) - 1) / (passes - p);
      if constexpr (WIDE) wide::pass<INT4>(int(tb), j, t, w + g * group_bytes, g, out);
      else narrow::pass<INT4>(int(tb), j, t, w + g * group_bytes, g, out);
      for (int64_t i = 0; i < tb; ++i)
        for (int64_t r = 0; r < rows; ++r) y[(t + i) * N + g * ROWS + r] = Out(out[i * ROWS + r]);
      t += tb;
    }
  }
}

template <bool INT4, class Out>
void run(const Job& j, const char* w, int64_t group_bytes, Out* y, int64_t N, int64_t G) {
  const bool wide_path = layerskip::path_name() == "avx512";
  at::parallel_for(0, G, GRAIN, [&](int64_t g0, int64_t g1) {
    if (wide_path) groups<INT4, true>(j, w, group_bytes, y, N, g0, g1);
    else groups<INT4, false>(j, w, group_bytes, y, N, g0, g1);
  });
}

void check(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales, int64_t n, int64_t bits,
           int64_t group) {
  TORCH_CHECK(x.dim() == 2 && (x.dtype() == torch::kFloat32 || x.dtype() == torch::kBFloat16) && x.device().is_cpu(),
              "quant matmul: x (T, K) fp32 or bf16 on the CPU");
  TORCH_CHECK(bits == 8 || bits == 4, "quant matmul: bits 8 or 4, not ", bits);
  const int64_t K = x.size(1), G = w.size(0);
  TORCH_CHECK(n > 0 && (n + ROWS - 1) / ROWS == G, "quant matmul: ", G, " row groups do not hold ", n, " rows");
  TORCH_CHECK(w.is_contiguous() && scales.is_contiguous() && w.device().is_cpu() && scales.device().is_cpu(),
              "quant matmul: packed codes and scales contiguous on the CPU (infer.kernels.quant)");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 || scales.dtype() == torch::kBFloat16, "quant matmul: fp32 or bf16 "
              "scales");
  if (bits == 8) {
    TORCH_CHECK(w.dim() == 3 && w.dtype() == torch::kInt8 && w.size(1) == K && w.size(2) == ROWS,
                "quant matmul: int8 codes packed (G, K, 48)");
    TORCH_CHECK(scales.numel() == G * ROWS, "quant matmul: int8 scales (G * 48)");
  } else {
    TORCH_CHECK(group > 0 && group % 8 == 0 && K % group == 0, "quant matmul: int4 group ", group,
                " must be a multiple of 8 dividing K = ", K);
    TORCH_CHECK(w.dim() == 3 && w.dtype() == torch::kInt32 && w.size(1) == K / 8 && w.size(2) == ROWS,
                "quant matmul: int4 words packed (G, K / 8, 48)");
    TORCH_CHECK(scales.numel() == G * (K / group) * ROWS, "quant matmul: int4 scales (G, K / group, 48)");
  }
}

}  // namespace

namespace layerskip {

// y = x @ dequantize(w)^T (T, n) in x's dtype; w, scales packed by infer.kernels.quant (layout above).
torch::Tensor quant_matmul(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales, int64_t n,
                           int64_t bits, int64_t group) {
  check(x, w, scales, n, bits, group);
  const auto xf = x.to(torch::kFloat32).contiguous();  // bf16 widened exactly; fp32 as it is
  const int64_t T = xf.size(0), K = xf.size(1), G = w.size(0);
  auto y = torch::empty({T, n}, x.options());
  if (T == 0) return y;
  const Acts acts = bits == 4 ? quantize_acts(xf.data_ptr<float>(), T, K, group) : Acts{};
  const Job j{xf.data_ptr<float>(), T, K, bits == 4 ? group : 0, scales.data_ptr(),
              scales.dtype() == torch::kBFloat16, acts.words.data(), acts.scale.data(), acts.corr.data()};
  const int64_t group_bytes = w.stride(0) * w.element_size();
  const char* wp = static_cast<const char*>(w.data_ptr());
  if (x.dtype() == torch::kBFloat16) {
    auto* yp = reinterpret_cast<c10::BFloat16*>(y.data_ptr());
    if (bits == 4) run<true>(j, wp, group_bytes, yp, n, G);
    else run<false>(j, wp, group_bytes, yp, n, G);
  } else {
    float* yp = y.data_ptr<float>();
    if (bits == 4) run<true>(j, wp, group_bytes, yp, n, G);
    else run<false>(j, wp, group_bytes, yp, n, G);
  }
  return y;
}

}  // namespace layerskip

TORCH_LIBRARY(layerskip_quant, m) {
  m.def("matmul(Tensor x, Tensor codes, Tensor scales, int n, int bits, int group) -> Tensor");
  m.impl("matmul", c10::DispatchKey::CPU, TORCH_FN(layerskip::quant_matmul));
}
