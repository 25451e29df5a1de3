// The gated MLP's activation, act(gate) * up, one row at a time (``gated_act``): SiLU, or GELU-tanh (Gemma 3).
//
// Why not torch's F.silu / F.gelu: their CPU kernels compute a contiguous stretch in vectors and its last few elements
// by a scalar loop whose exp (or tanh) rounds differently, and above a size (SiLU 32768 elements, GELU 16384) they
// split the tensor among threads at points that depend on its size, mid-row. So with 2 threads a row of a T-row
// verification could round differently from the same row decoded alone (T * I >= 32768 and I not a multiple of the
// vector step: docs/KERNELS.md, "Where the exactness contract holds"). Here every element, a row's tail included
// (masked lanes), runs the same vector code, and threads split whole rows: a row's bits depend on nothing else.
//
// Both activations as x * sigmoid(z) = x / (1 + exp(-z)): SiLU z = x; GELU-tanh 0.5 x (1 + tanh(u)) = x sigmoid(2 u),
// u = sqrt(2 / pi) (x + 0.044715 x^3). exp is Cephes' expf (layerskip::EXP_*), its argument clamped to [-88, 88]
// (beyond, x / (1 + exp(-z)) is x or a zero to within 1e-38 of x's size). Against torch's own functions: within a few
// fp32 ulps (tests/infer/test_odd_widths.py). bf16 (AVX-512 path): the activation rounded to bf16, then the product
// rounded, as torch's F.silu(gate).mul_(up) rounds.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>

namespace {

constexpr float GELU_2K = 1.5957691216057308f;  // 2 sqrt(2 / pi)
constexpr float GELU_C = 0.044715f;
constexpr float EXP_MAX = 88.0f;
constexpr int64_t GRAIN = 16384;  // elements per parallel chunk (whole rows)

using layerskip::EXP_LN2_HI;
using layerskip::EXP_LN2_LO;
using layerskip::EXP_LOG2E;
using layerskip::EXP_P;

// ------------------------------------------------------------------------------------------- AVX2 (fp32)
namespace avx2 {

inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-EXP_MAX)), _mm256_set1_ps(EXP_MAX));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x));
  __m256 p = _mm256_set1_ps(EXP_P[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[i]));
  const __m256 e = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n from the exponent bits: n in [-127, 127] (n = -127 gives 0, a value below 2^-126 anyway)
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(e, _mm256_castsi256_ps(two_n));
}

inline __m256 act(__m256 x, bool gelu) {
  const __m256 z = gelu ? _mm256_mul_ps(_mm256_set1_ps(GELU_2K),
                                        _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(GELU_C),
                                                                       _mm256_mul_ps(_mm256_mul_ps(x, x), x))))
                        : x;
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), z));
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// Rows [t0, t1) of gu (rows of 2 I at stride ld: gate then up) into out (rows of I).
void rows(const float* gu, int64_t ld, float* out, int64_t I, bool gelu, int64_t t0, int64_t t1) {
  const int64_t tail = I % 8;
  const __m256i m = layerskip::simd::first8(tail);
  for (int64_t t = t0; t < t1; ++t) {
    const float* g = gu + t * ld;
    const float* u = g + I;
    float* o = out + t * I;
    int64_t j = 0;
    for (; j + 8 <= I; j += 8)
      _mm256_storeu_ps(o + j, _mm256_mul_ps(act(_mm256_loadu_ps(g + j), gelu), _mm256_loadu_ps(u + j)));
    if (tail) {
      const __m256 a = act(_mm256_maskload_ps(g + j, m), gelu);
      _mm256_maskstore_ps(o + j, m, _mm256_mul_ps(a, _mm256_maskload_ps(u + j, m)));
    }
  }
}

}  // namespace avx2

// ----------------------------------------------------------------------------------------- AVX-512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace wide {

using layerskip::simd::first;
using layerskip::simd::held;
using layerskip::simd::load;
using layerskip::simd::store;

inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-EXP_MAX)), _mm512_set1_ps(EXP_MAX));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x));
  __m512 p = _mm512_set1_ps(EXP_P[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P[i]));
  return _mm512_scalef_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f))), n);
}

inline __m512 act(__m512 x, bool gelu) {
  const __m512 z = gelu ? _mm512_mul_ps(_mm512_set1_ps(GELU_2K),
                                        _mm512_add_ps(x, _mm512_mul_ps(_mm512_set1_ps(GELU_C),
                                                                       _mm512_mul_ps(_mm512_mul_ps(x, x), x))))
                        : x;
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), z));
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

// Rows [t0, t1) of gu (rows of 2 I at stride ld: gate then up) into out (rows of I); E fp32 or bf16.
template <class E>
void rows(const E* gu, int64_t ld, E* out, int64_t I, bool gelu, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const E* g = gu + t * ld;
    E* o = out + t * I;
    for (int64_t j = 0; j < I; j += 16) {
      const __mmask16 m = first(I - j);
      store(o + j, _mm512_mul_ps(held(act(load(g + j, m), gelu), g), load(g + I + j, m)), m);
    }
  }
}

}  // namespace wide
#pragma GCC pop_options

}  // namespace

namespace layerskip {

torch::Tensor gated_act(const torch::Tensor& gate_up, bool gelu) {
  const bool bf16 = gate_up.dtype() == torch::kBFloat16, avx512 = path_name() == "avx512";
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.device().is_cpu(),
              "gate_up (T, 2 I) on the CPU");
  TORCH_CHECK(gate_up.dtype() == torch::kFloat32 || (bf16 && avx512), "gated_act: fp32, or bf16 on the AVX-512 path");
  const auto gu = gate_up.stride(1) == 1 ? gate_up : gate_up.contiguous();
  const int64_t T = gu.size(0), I = gu.size(1) / 2, ld = gu.stride(0);
  auto out = torch::empty({T, I}, gu.options());  // (T, I)
  if (T == 0 || I == 0) return out;
  const int64_t grain = std::max<int64_t>(1, GRAIN / I);  // rows per chunk: a row is never split
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    if (bf16) {
      wide::rows(reinterpret_cast<const c10::BFloat16*>(gu.data_ptr()), ld,
                 reinterpret_cast<c10::BFloat16*>(out.data_ptr()), I, gelu, t0, t1);
    } else if (avx512) {
      wide::rows(gu.data_ptr<float>(), ld, out.data_ptr<float>(), I, gelu, t0, t1);
    } else {
      avx2::rows(gu.data_ptr<float>(), ld, out.data_ptr<float>(), I, gelu, t0, t1);
    }
  });
  return out;
}

}  // namespace layerskip
