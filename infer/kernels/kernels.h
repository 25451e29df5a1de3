// The kernel module's functions (small_matmul.cpp, panels.cpp, attention.cpp, quant.cpp), for the fused layer span
// (layer_span.cpp) and the Python bindings (also in layer_span.cpp). One extension is built from all of them
// (infer/kernels/__init__.py).
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <string>

namespace layerskip {

// Cephes' expf, the attentions' ``exp``: x = n ln2 + r (ln2 in two parts), then a degree-6 polynomial in r times 2^n.
constexpr float EXP_LOG2E = 1.44269504088896341f, EXP_LN2_HI = 0.693359375f, EXP_LN2_LO = -2.12194440e-4f;
constexpr float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                            5.0000001201e-1f};

// The instruction set this process uses ("avx512" or "avx2"), chosen once from cpuid.
std::string path_name();
// Whether bf16 runs here (AVX512_BF16).
bool supports_bf16();
// How many threads one of the kernel's parallel regions (``at::parallel_for``, as the matmuls split their rows) runs
// on now: torch.get_num_threads() where this extension was compiled for torch's parallel backend, 1 where not.
int64_t parallel_threads();
// y = x @ w^T, x (T, K), w (N, K), any N and K (bf16: K even); every output element accumulated in the same order
// whatever T is (on the AVX-512 path w is packed on the fly: panel_matmul).
torch::Tensor small_matmul(const torch::Tensor& x, const torch::Tensor& w);
// Weight rows per group of the panel layout (panels.cpp; infer/kernels/panels.py packs it).
constexpr int64_t PANEL_ROWS = 48;
// w (N, K) fp32 (any K) or bf16 (K even), packed in panels: (G, K, PANEL_ROWS), G = ceil(N / PANEL_ROWS)
// (panels.cpp's layout).
torch::Tensor pack_panels(const torch::Tensor& w);
// y = x @ w^T, x (T, K), w's n rows packed in panels (G, K, PANEL_ROWS); AVX-512 path; batch invariant.
torch::Tensor panel_matmul(const torch::Tensor& x, const torch::Tensor& w, int64_t n);
// x @ w^T for w packed (3-D: panel_matmul) or plain (N, K) with N == n (small_matmul).
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, int64_t n);
// y = x @ dequantize(w)^T (T, n), x (T, K) fp32 or bf16, w int8 codes (G, K, 48) or int4 words (G, K / 8, 48) with
// their scales (quant.cpp's layout, infer/kernels/quant.py packs it); y in x's dtype; batch invariant.
torch::Tensor quant_matmul(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales, int64_t n,
                           int64_t bits, int64_t group);
// act(gate) * up of a gated MLP, gate_up (T, 2 I) = [gate | up]: (T, I), each row alone (SiLU, or GELU-tanh where
// ``gelu``; activation.cpp). fp32 on either path, bf16 (torch's roundings) on the AVX-512 path.
torch::Tensor gated_act(const torch::Tensor& gate_up, bool gelu);
// w * (x * rsqrt(mean(x^2) + eps)) per row (bf16: HF's arithmetic); AVX-512 path only.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
// softmax(q k^T scale) v, one query row at a time over its visible keys; q (Hq, T, D), k, v (Hkv, S, D), mask (T, S)
// bool or none. Returns (Hq, T, D) as a view of a (T, Hq, D) tensor. fp32 on either path (any D <= 256), bf16 on
// the AVX-512 path with AVX512_BF16.
torch::Tensor attend_rows(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const c10::optional<torch::Tensor>& mask, double scale);
// attend_rows's AVX-512 path (attention.cpp): q (Hq, T, D), k, v (Hkv, S, D) with the last dim contiguous, mask (T, S)
// contiguous or null. Returns (T, Hq, D).
torch::Tensor wide_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const bool* mask,
                             double scale);
// Whether bf16 attention sums its values over pairs of keys (vdpbf16ps, where this CPU adds a pair's products in key
// order; attention.cpp's ``sequential_pairs``) rather than one key at a time.
bool bf16_value_pairs();
// attend_rows after writing k, v (Hkv, T, D) at slots [start, start + T) of layer ``layer`` of ck, cv (L, Hkv, C, D).
torch::Tensor attend_cache(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& ck, const torch::Tensor& cv, int64_t layer, int64_t start,
                           const c10::optional<torch::Tensor>& mask, double scale);

}  // namespace layerskip

namespace layerskip::simd {

// The first n of 8 fp32 lanes as an AVX2 mask (_mm256_maskload_ps / _mm256_maskstore_ps): a row's last K % 8 values.
inline __m256i first8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

}  // namespace layerskip::simd

// The AVX-512 files' shared lane helpers (each file calls them from its own target region).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace layerskip::simd {

// The first n of 16 (fp32) or 32 (bf16) lanes: a load or store mask for a row's tail.
inline __mmask16 first(int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFF : n <= 0 ? 0 : (1u << n) - 1); }
inline __mmask32 first32(int64_t n) { return n >= 32 ? ~__mmask32(0) : n <= 0 ? 0 : (__mmask32(1) << n) - 1; }
// 16 bf16 values (their bits) widened to fp32, exactly.
inline __m512 widen(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }

// fp32 -> bf16 as ATen's vectorised ops round (cvtfp32_bf16): nearest even by integer arithmetic, NaN -> 0xffff.
// (Not vcvtneps2bf16: that one flushes denormal inputs to zero, which torch does not.)
inline __m256i round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  __m512i t = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  t = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(t, _mm512_set1_epi32(0x7fff)), bits), 16);
  t = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), _mm512_set1_epi32(0xffff), t);
  return _mm512_cvtusepi32_epi16(t);
}

// The first lanes (mask m) of a row of fp32 or bf16 as 16 fp32 lanes (zeros elsewhere), and back as torch stores them.
inline __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load(const c10::BFloat16* p, __mmask16 m) { return widen(_mm256_maskz_loadu_epi16(m, p)); }
inline void store(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store(c10::BFloat16* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, round_bf16(v)); }

// A result as a tensor of the element type (the pointer's) holds it: fp32 as computed, bf16 rounded.
inline __m512 held(__m512 v, const float*) { return v; }
inline __m512 held(__m512 v, const c10::BFloat16*) { return widen(round_bf16(v)); }

}  // namespace layerskip::simd
#pragma GCC pop_options
