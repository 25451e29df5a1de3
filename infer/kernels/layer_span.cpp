// A layer program over packed rows in one call from Python (issues 44, 65): the fused executor's C++.
//
// The eager layer loop (infer/model/loop.py over infer/model/layer_math.py) runs ~34 small torch ops a layer and the
// interpreter between them: ~4 ms of a 30-layer one-token step beside ~26 ms of matmuls. This file runs the same
// layers from C++ over the N rows of one or several sequences ("segments"): the norms, the projections and the MLP
// once over all N rows (one weight stream for the whole batch), the attention per segment over its own cache (its
// K/V written at its own lengths, its positions, its mask, the layer's sliding window over its slots' positions).
//
// Every family of layerskip_core/families.py: the plain RMSNorm and Gemma's (1 + w) one, q/k norms before RoPE, norms
// after attention and MLP, SiLU or GELU-tanh, biases on the projections, each layer's RoPE table (an identity one for
// a layer without RoPE) and sliding window, the attention scale.
//
// Bitwise the Python loop: the kernel's own functions (rms_norm, linear, attend_rows, gated_act) are called where the
// loop calls them; where the loop calls torch (Gemma's norm: F.rms_norm in fp32, its upcast in bf16; the plain norm's
// torch fallback in bf16 when a row is not a multiple of 16 wide) the same ATen ops run on the same shapes; the
// elementwise steps torch computes as one rounding per op (RoPE's two products and their sum, bias adds, the residual
// sums) are written here with the same roundings: fp32 products and sums, never contracted into an FMA (the extension
// is built with -ffp-contract=off); bf16 each op in fp32 on the widened values, rounded to bf16 as ATen rounds (round
// to nearest even in integer arithmetic). Each of those is row by row, so a row of a packed call is bitwise what its
// sequence computes alone (tests/infer/test_fused_families.py, test_kernel_layer.py).
//
// The cache lengths and the layer counters are the runner's to advance (infer/model/runner.py, after any executor);
// this file reads the lengths, writes K/V rows (and, for windowed layers, the slots' positions) past them. Scope (the
// Python side, infer/model/fused_span.py, decides per runner and per call): the AVX-512 path, fp32 and bf16
// (AVX512_BF16), never T > 1 rows of a segment from an empty layer (those attend causally on SDPA).
//
// A layer's matrices may be a quantized draft's (int8 / int4 codes, issue 64: infer.model.quant_weights): each then
// runs on quant.cpp's matmul, the function QuantLinear calls, so a quantized copy's layers are bitwise the loop's too.
//
// This file also holds the module's Python bindings (the kernel functions are the other files', see kernels.h).
#include "kernels.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstring>
#include <exception>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

using BF16 = c10::BFloat16;
using torch::Tensor;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace vec {

using layerskip::simd::first;
using layerskip::simd::held;
using layerskip::simd::load;
using layerskip::simd::store;

// RoPE of one head row x (D): (x * c) + (roll(x, D/2) * s), as layer_math.qkv_rope's (qk * cos).add_(qk.roll(D // 2,
// dims=-1).mul_(sin)): each product and the sum one op in E. ``rolled``: D elements of scratch.
template <class E>
void rope_row(const E* x, const E* c, const E* s, E* out, int64_t D, E* rolled) {
  const int64_t half = D / 2;
  std::memcpy(rolled, x + half, half * sizeof(E));  // roll by D/2: element j reads x[(j + D/2) % D]
  std::memcpy(rolled + half, x, half * sizeof(E));
  for (int64_t j = 0; j < D; j += 16) {
    const __mmask16 m = first(D - j);
    const __m512 a = held(_mm512_mul_ps(load(x + j, m), load(c + j, m)), x);
    const __m512 b = held(_mm512_mul_ps(load(rolled + j, m), load(s + j, m)), x);
    store(out + j, _mm512_add_ps(a, b), m);
  }
}

// y[j] = y[j] + x[j] over n elements, in fp32 then stored in E: torch's y.add_(x) (and y + x: a sum commutes).
template <class E>
void add(E* y, const E* x, int64_t n) {
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = first(n - j);
    store(y + j, _mm512_add_ps(load(y + j, m), load(x + j, m)), m);
  }
}

}  // namespace vec
#pragma GCC pop_options

// One of a layer's matrices as the kernel reads it (the runner's tensors, held, not copied): float, plain (n, K) or
// packed in panels (G, K, 48) (layerskip::linear), or a quantized draft's (``bits`` 8 or 4: int8 codes (G, K, 48) or
// int4 words (G, K / 8, 48) and their scales, layerskip::quant_matmul, infer.model.quant_weights.QuantLinear);
// undefined ``w``: the layer has none.
struct Matrix {
  Tensor w, scales;
  int64_t bits = 0, group = 0;  // bits 0: float; group: int4's k per scale
  int64_t in = 0;  // K, its input width
  bool defined() const { return w.defined(); }
};

// x (N, K) @ W^T: (N, n), on the matrix's own route (both batch invariant: a row's bits do not depend on N).
Tensor matmul(const Tensor& x, const Matrix& m, int64_t n) {
  if (m.bits == 0) return layerskip::linear(x, m.w, n);
  return layerskip::quant_matmul(x, m.w, m.scales, n, m.bits, m.group);
}

// One decoder layer's tensors (the runner's own, held, not copied); an undefined tensor: the layer has none.
struct Layer {
  Tensor attn_norm;  // (d,)
  Matrix qkv;  // ((Hq + 2 Hkv) D, d)
  Tensor qkv_bias;  // ((Hq + 2 Hkv) D,)
  Matrix o;  // (d, Hq D)
  Tensor o_bias, q_norm, k_norm, post_attn_norm;  // (d,), (D,), (D,), (d,): Qwen2's bias, Qwen3's and Gemma 3's norms
  Tensor mlp_norm;  // (d,)
  Matrix gate_up, down;  // (2 I, d), (d, I); gate_up undefined: no MLP
  Tensor post_mlp_norm;  // (d,)
  int64_t rope = 0;  // its RoPE table
  int64_t window = 0;  // its sliding window W (a query at p sees keys at (p - W, p]); 0: full attention
};

// What every layer shares.
struct Shape {
  int64_t Hq, Hkv, D;
  double eps, scale;
  bool offset;  // Gemma's (1 + w) norm, its weights 1 + w in fp32 (infer.model.weights.norm_weight)
  bool gelu;  // GELU-tanh, else SiLU
};

// One sequence's rows in a call: rows [row, row + T) of the packed hidden, plain C++ values (read from Python before
// the layers run without the GIL).
struct Segment {
  int64_t row, T;
  std::vector<int64_t> pos;  // (T,) RoPE positions
  Tensor ck, cv;  // (L, Hkv, C, D)
  Tensor slots;  // (L, C) long: each slot's position (KVCache.pos); undefined where the model has no window
  std::vector<int64_t> lengths;  // per layer: KVCache.lengths
  c10::optional<Tensor> mask;  // (T, W) bool over the last W slots; none: causal
  std::map<int64_t, c10::optional<Tensor>> masks;  // by start slot
};

// One call: its segments and the RoPE tables, per table (n, D).
struct Call {
  std::vector<Segment> segs;
  std::vector<Tensor> cos, sin;
};

// program.visible / Segment.attention_mask: (T, S) bool over slots [0, S), S = slot + T, made once per start slot;
// none for one row without a mask (every key visible).
const c10::optional<Tensor>& visible(Segment& s, int64_t slot) {
  const auto known = s.masks.find(slot);
  if (known != s.masks.end()) return known->second;
  const int64_t T = s.T, S = slot + T;
  c10::optional<Tensor> out;
  if (s.mask.has_value() || T > 1) {
    auto m = torch::empty({T, S}, torch::kBool);  // (T, S)
    bool* p = m.data_ptr<bool>();
    std::memset(p, 1, T * S);
    if (!s.mask.has_value()) {  // causal new rows: row t sees slots [0, slot + t]
      for (int64_t t = 0; t < T; ++t) std::memset(p + t * S + slot + t + 1, 0, T - t - 1);
    } else {
      const int64_t W = s.mask->size(1);
      TORCH_CHECK_VALUE(W <= S, "mask covers ", W, " slots but only ", S, " exist");
      const bool* given = s.mask->data_ptr<bool>();
      for (int64_t t = 0; t < T; ++t) std::memcpy(p + t * S + S - W, given + t * W, W);
    }
    out = m;
  }
  return s.masks.emplace(slot, std::move(out)).first->second;
}

// program.window_mask: layer ``i``'s mask for the segment's rows from ``slot``: the segment's (``visible``) where the
// layer attends fully; with a window W the rows' positions are recorded in the slots' positions, and once the layer's
// slots outnumber W, keys W or more positions before a row are hidden too (layer_math.near).
c10::optional<Tensor> layer_mask(Segment& s, const Layer& w, int64_t i, int64_t slot) {
  const auto& base = visible(s, slot);
  if (w.window <= 0) return base;
  const int64_t T = s.T, S = slot + T, W = w.window;
  TORCH_CHECK(s.slots.defined(), "layer ", i, " has a sliding window: the cache needs its slots' positions");
  int64_t* kp = s.slots.data_ptr<int64_t>() + i * s.slots.stride(0);
  for (int64_t t = 0; t < T; ++t) kp[slot + t] = s.pos[t];
  if (S <= W) return base;
  auto m = torch::empty({T, S}, torch::kBool);  // (T, S): near, and base (causal where none and T > 1)
  bool* p = m.data_ptr<bool>();
  const bool* b = base.has_value() ? base->data_ptr<bool>() : nullptr;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t from = s.pos[t] - W;
    for (int64_t j = 0; j < S; ++j) {
      const bool seen = b != nullptr ? b[t * S + j] : (T == 1 || j <= slot + t);
      p[t * S + j] = seen && kp[j] > from;
    }
  }
  return m;
}

// y += x elementwise (y fresh and contiguous), as attention_out's and mlp's y.add_(hidden).
void add_into(Tensor& y, const Tensor& x) {
  const auto xc = x.contiguous();
  if (y.scalar_type() == torch::kBFloat16) {
    vec::add(y.data_ptr<BF16>(), xc.data_ptr<BF16>(), y.numel());
  } else {
    vec::add(y.data_ptr<float>(), xc.data_ptr<float>(), y.numel());
  }
}

// Linear.__call__ (or QuantLinear's) on the kernel: x @ w^T, then ``+ bias`` (a new tensor, one rounding per
// element) where there is one: (N, n).
Tensor linear(const Tensor& x, const Matrix& w, const Tensor& bias, int64_t n) {
  auto y = matmul(x, w, n);  // (N, n)
  if (!bias.defined()) return y;
  const int64_t N = y.size(0);
  if (y.scalar_type() == torch::kBFloat16) {
    for (int64_t r = 0; r < N; ++r) vec::add(y.data_ptr<BF16>() + r * n, bias.data_ptr<BF16>(), n);
  } else {
    for (int64_t r = 0; r < N; ++r) vec::add(y.data_ptr<float>() + r * n, bias.data_ptr<float>(), n);
  }
  return y;
}

// HF's upcast RMSNorm: x32 = x.float(); x32 * rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps), in ATen's ops.
Tensor upcast_norm(const Tensor& x, double eps) {
  const auto x32 = x.to(torch::kFloat);
  return x32 * at::rsqrt(x32.pow(2).mean(-1, true) + eps);
}

// layer_math.norm over the last dim: the (1 + w) flavour as torch computes it (F.rms_norm in fp32, the upcast in
// bf16, times the fp32 weight, cast); the plain one as infer.model.weights.rms_norm (the kernel's row norm in fp32 and
// in bf16 16-wide rows, else the upcast and w * x32.to(dtype)).
Tensor norm(const Tensor& x, const Tensor& w, const Shape& s) {
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  if (s.offset) {
    if (!bf16) return at::rms_norm(x, {w.numel()}, w, s.eps);
    return (upcast_norm(x, s.eps) * w).to(x.scalar_type());
  }
  if (!bf16 || x.size(-1) % 16 == 0) return layerskip::rms_norm(x, w, s.eps);
  return w * upcast_norm(x, s.eps).to(x.scalar_type());
}

// RoPE of row r's q heads into q (N, Hq, D), and per segment its k heads into the layer's cache rows [slot, slot +
// T), its v heads copied there. qs, ks: the q and k heads of row r at qs + r * q_row (head h: + h D), likewise k;
// v: the v heads at vs + r * v_row.
template <class E>
void rope_rows(const E* qs, int64_t q_row, const E* ks, int64_t k_row, const E* vs, int64_t v_row, Tensor& q,
               Call& c, int64_t i, int64_t table, const Shape& sh) {
  const int64_t Hq = sh.Hq, Hkv = sh.Hkv, D = sh.D;
  std::vector<E> rolled(D);
  const E* cos = c.cos.at(table).data_ptr<E>();
  const E* sin = c.sin.at(table).data_ptr<E>();
  for (auto& s : c.segs) {
    const int64_t slot = s.lengths[i];
    auto kl = s.ck.select(0, i), vl = s.cv.select(0, i);  // (Hkv, C, D)
    E *kp = kl.data_ptr<E>(), *vp = vl.data_ptr<E>();
    for (int64_t t = 0; t < s.T; ++t) {
      const int64_t r = s.row + t;
      const E* cr = cos + s.pos[t] * D;
      const E* sr = sin + s.pos[t] * D;
      for (int64_t h = 0; h < Hq; ++h)
        vec::rope_row(qs + r * q_row + h * D, cr, sr, q.data_ptr<E>() + (r * Hq + h) * D, D, rolled.data());
      for (int64_t j = 0; j < Hkv; ++j) {
        vec::rope_row(ks + r * k_row + j * D, cr, sr, kp + j * kl.stride(0) + (slot + t) * kl.stride(1), D,
                      rolled.data());
        std::memcpy(vp + j * vl.stride(0) + (slot + t) * vl.stride(1), vs + r * v_row + j * D, D * sizeof(E));
      }
    }
  }
}

// Per call: the segments, checked, as plain C++ values. Each entry (T, positions, k, v, slot positions or None,
// lengths, mask or None). A cache may hold more layers than the stack (a draft's copy of layers [0, E) over the
// model's own cache, infer.model.quant_weights.quantized): the stack's layer i is the cache's layer i.
std::vector<Segment> read_segments(const py::list& given, int64_t N, int64_t L, const Shape& sh,
                                   torch::ScalarType dtype) {
  std::vector<Segment> out;
  int64_t row = 0;
  for (const auto& item : given) {
    const auto t = item.cast<py::tuple>();
    TORCH_CHECK(t.size() == 7, "a segment: (T, positions, k, v, slot positions, lengths, mask)");
    Segment s{row, t[0].cast<int64_t>(), t[1].cast<std::vector<int64_t>>(), t[2].cast<Tensor>(),
              t[3].cast<Tensor>(), t[4].is_none() ? Tensor() : t[4].cast<Tensor>(),
              t[5].cast<std::vector<int64_t>>(), c10::nullopt, {}};
    if (!t[6].is_none()) s.mask = t[6].cast<Tensor>().contiguous();
    TORCH_CHECK(s.T >= 1 && static_cast<int64_t>(s.pos.size()) == s.T, "a segment's T rows and T positions");
    const auto& ck = s.ck;
    TORCH_CHECK(ck.dim() == 4 && s.cv.sizes() == ck.sizes() && ck.size(0) >= L && ck.size(1) == sh.Hkv &&
                ck.size(3) == sh.D && ck.stride(3) == 1 && s.cv.stride(3) == 1 && ck.scalar_type() == dtype &&
                s.cv.scalar_type() == dtype && ck.device().is_cpu(),
                "caches (L', Hkv, C, D), L' >= the stack's L layers, in the hidden's dtype");
    TORCH_CHECK(static_cast<int64_t>(s.lengths.size()) == ck.size(0), "lengths: the cache's ", ck.size(0), " layers");
    TORCH_CHECK(!s.slots.defined() || (s.slots.dim() == 2 && s.slots.size(0) == ck.size(0) &&
                                       s.slots.size(1) == ck.size(2) &&
                                       s.slots.stride(1) == 1 && s.slots.scalar_type() == torch::kLong),
                "slot positions (L, C) long");
    TORCH_CHECK(!s.mask.has_value() || (s.mask->scalar_type() == torch::kBool && s.mask->dim() == 2 &&
                                        s.mask->size(0) == s.T), "mask (T, W) bool");
    row += s.T;
    out.push_back(std::move(s));
  }
  TORCH_CHECK(row == N && !out.empty(), "the segments' rows: the hidden's ", N);
  return out;
}

// A layer's matrix as Python gives it (infer.model.fused_span._layer): None, a float matrix (n, K) or its panels
// (G, K, 48), or a quantized one as (codes, scales, bits, group, K), checked here once.
Matrix read_matrix(const py::handle& given) {
  if (given.is_none()) return {};
  if (!py::isinstance<py::tuple>(given)) {
    const auto w = given.cast<Tensor>();
    TORCH_CHECK(w.dim() == 2 || w.dim() == 3, "a float matrix (n, K) or its panels (G, K, 48)");
    return {w, Tensor(), 0, 0, w.size(1)};
  }
  const auto t = given.cast<py::tuple>();
  TORCH_CHECK(t.size() == 5, "a quantized matrix: (codes, scales, bits, group, K)");
  Matrix m{t[0].cast<Tensor>(), t[1].cast<Tensor>(), t[2].cast<int64_t>(), t[3].cast<int64_t>(),
           t[4].cast<int64_t>()};
  const auto codes = m.bits == 8 ? torch::kInt8 : torch::kInt32;
  TORCH_CHECK((m.bits == 8 || (m.bits == 4 && m.group > 0 && m.group % 8 == 0 && m.in % m.group == 0)) &&
              m.w.dim() == 3 && m.w.scalar_type() == codes && m.w.size(1) == (m.bits == 8 ? m.in : m.in / 8) &&
              m.w.size(2) == layerskip::PANEL_ROWS && m.w.is_contiguous() && m.scales.is_contiguous(),
              "a quantized matrix: int8 codes (G, K, 48) or int4 words (G, K / 8, 48), its group dividing K");
  return m;
}

class LayerStack {
 public:
  // ``layers``: per layer a dict of its tensors (attn_norm, qkv, qkv_bias, o, o_bias, q_norm, k_norm, post_attn_norm,
  // mlp_norm, gate_up, down, post_mlp_norm: None where it has none) and ints (rope: its table; window: W, or 0).
  LayerStack(const py::list& layers, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale,
             bool offset_norm, bool gelu)
      : s_{heads, kv_heads, head_dim, eps, scale, offset_norm, gelu} {
    TORCH_CHECK(layerskip::path_name() == "avx512", "LayerStack: the kernel's AVX-512 path only");
    TORCH_CHECK(head_dim % 2 == 0 && head_dim <= 256 && kv_heads > 0 && heads % kv_heads == 0, "head shapes");
    for (const auto& item : layers) {
      const auto d = item.cast<py::dict>();
      auto get = [&](const char* k) {
        return !d.contains(k) || d[k].is_none() ? Tensor() : d[k].cast<Tensor>();
      };
      auto matrix = [&](const char* k) { return !d.contains(k) ? Matrix() : read_matrix(d[k]); };
      Layer w{get("attn_norm"), matrix("qkv"), get("qkv_bias"), matrix("o"), get("o_bias"), get("q_norm"),
              get("k_norm"), get("post_attn_norm"), get("mlp_norm"), matrix("gate_up"), matrix("down"),
              get("post_mlp_norm"), d["rope"].cast<int64_t>(), d["window"].cast<int64_t>()};
      TORCH_CHECK(w.attn_norm.defined() && w.qkv.defined() && w.o.defined() && w.o.in == heads * head_dim &&
                  w.gate_up.defined() == w.down.defined() && w.gate_up.defined() == w.mlp_norm.defined() &&
                  w.q_norm.defined() == w.k_norm.defined(),
                  "layer shapes: fused q/k/v, o, q and k norms both or neither, the MLP's three tensors all or none");
      layers_.push_back(std::move(w));
    }
  }

  // The walk of a program (infer.model.program.Program.walk): per item a step, 4 layer + 2 attn + mlp, or a cut, -1 -
  // layer (the stream entering that layer is kept). ``segments``: see read_segments; cos, sin: the RoPE tables.
  // Returns (the kept streams in the walk's order, the stream after the last step). The layers run without the GIL.
  py::tuple run(const Tensor& hidden, const std::vector<int64_t>& walk, const py::list& segments,
                std::vector<Tensor> cos, std::vector<Tensor> sin) {
    const auto L = static_cast<int64_t>(layers_.size());
    const auto dtype = hidden.scalar_type();
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) >= 1 && (dtype == torch::kFloat32 || dtype == torch::kBFloat16) &&
                hidden.device().is_cpu(), "hidden (N, d) fp32 or bf16 on the CPU");
    Call c{read_segments(segments, hidden.size(0), L, s_, dtype), std::move(cos), std::move(sin)};
    check_tables(c, dtype);
    for (const int64_t item : walk) TORCH_CHECK(item >= 0 ? item / 4 < L : -1 - item <= L, "a layer past the stack");
    std::vector<Tensor> kept;
    Tensor h = hidden.contiguous();
    std::exception_ptr error;
    {
      py::gil_scoped_release unlocked;
      try {
        for (const int64_t item : walk) {
          if (item < 0) {
            kept.push_back(h);
            continue;
          }
          const int64_t i = item / 4;
          if (item & 2) h = attention(layers_[i], i, h, c);
          if (item & 1) h = mlp(layers_[i], h);
        }
      } catch (...) {
        error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
    py::list out;
    for (auto& t : kept) out.append(t);
    return py::make_tuple(out, h);
  }

 private:
  void check_tables(const Call& c, torch::ScalarType dtype) const {
    TORCH_CHECK(c.cos.size() == c.sin.size() && !c.cos.empty(), "RoPE tables: as many cos as sin");
    for (const auto& w : layers_) TORCH_CHECK(w.rope >= 0 && w.rope < int64_t(c.cos.size()), "a layer's RoPE table");
    for (size_t r = 0; r < c.cos.size(); ++r) {
      TORCH_CHECK(c.cos[r].is_contiguous() && c.sin[r].is_contiguous() && c.cos[r].sizes() == c.sin[r].sizes() &&
                  c.cos[r].dim() == 2 && c.cos[r].size(1) == s_.D && c.cos[r].scalar_type() == dtype &&
                  c.sin[r].scalar_type() == dtype, "RoPE tables (n, D) contiguous in the hidden's dtype");
      for (const auto& s : c.segs)
        for (const int64_t p : s.pos) TORCH_CHECK(p >= 0 && p < c.cos[r].size(0), "position ", p, " past the RoPE table");
    }
  }

  // layer_math.qkv_rope, the loop's cached attention per segment (the row attention), layer_math.attention_out:
  // (N, d).
  Tensor attention(const Layer& w, int64_t i, const Tensor& h, Call& c) {
    const int64_t N = h.size(0), Hq = s_.Hq, Hkv = s_.Hkv, D = s_.D, width = (Hq + 2 * Hkv) * D;
    for (const auto& s : c.segs) {
      const int64_t slot = s.lengths[i], stop = slot + s.T;
      TORCH_CHECK(slot > 0 || s.T == 1, "T > 1 rows from an empty layer attend causally on SDPA: the Python loop's");
      TORCH_CHECK(stop <= s.ck.size(2), "KV cache full: layer ", i, " needs ", stop, " slots, capacity ",
                  s.ck.size(2));
    }
    const auto heads = linear(norm(h, w.attn_norm, s_), w.qkv, w.qkv_bias, width);  // (N, (Hq + 2 Hkv) D)
    auto q = torch::empty({N, Hq, D}, h.options());  // (N, Hq, D)
    const bool bf16 = h.scalar_type() == torch::kBFloat16;
    Tensor qn, kn;  // (N, Hq, D), (N, Hkv, D): the q/k norms' outputs, where the layer has them
    if (w.q_norm.defined()) {
      const auto split = heads.view({N, Hq + 2 * Hkv, D});
      qn = norm(split.narrow(1, 0, Hq), w.q_norm, s_).contiguous();
      kn = norm(split.narrow(1, Hq, Hkv), w.k_norm, s_).contiguous();
    }
    const void* base = heads.data_ptr();
    const int64_t esize = bf16 ? 2 : 4;
    const void* qs = qn.defined() ? qn.data_ptr() : base;
    const void* ks = kn.defined() ? kn.data_ptr() : static_cast<const char*>(base) + Hq * D * esize;
    const void* vs = static_cast<const char*>(base) + (Hq + Hkv) * D * esize;
    const int64_t q_row = qn.defined() ? Hq * D : width, k_row = kn.defined() ? Hkv * D : width;
    if (bf16) {
      rope_rows<BF16>(static_cast<const BF16*>(qs), q_row, static_cast<const BF16*>(ks), k_row,
                      static_cast<const BF16*>(vs), width, q, c, i, w.rope, s_);
    } else {
      rope_rows<float>(static_cast<const float*>(qs), q_row, static_cast<const float*>(ks), k_row,
                       static_cast<const float*>(vs), width, q, c, i, w.rope, s_);
    }
    Tensor out;  // (N, Hq D)
    if (c.segs.size() == 1) {
      out = attend(w, i, q, c.segs[0]).transpose(0, 1).reshape({N, Hq * D});  // the (T, Hq, D) buffer itself
    } else {
      out = torch::empty({N, Hq * D}, h.options());
      for (auto& s : c.segs) out.narrow(0, s.row, s.T).view({s.T, Hq, D}).copy_(attend(w, i, q, s).transpose(0, 1));
    }
    auto y = linear(out, w.o, w.o_bias, h.size(1));  // (N, d)
    if (w.post_attn_norm.defined()) y = norm(y, w.post_attn_norm, s_);
    add_into(y, h);
    return y;
  }

  // One segment's attention at layer i over its cache's slots up to its new ones (written by rope_rows) with its
  // mask at the layer's start slot, cut to the layer's window: (Hq, T, D), a view of a (T, Hq, D) tensor.
  Tensor attend(const Layer& w, int64_t i, const Tensor& q, Segment& s) {
    const int64_t slot = s.lengths[i], stop = slot + s.T;
    const auto mask = layer_mask(s, w, i, slot);
    auto kl = s.ck.select(0, i), vl = s.cv.select(0, i);  // (Hkv, C, D)
    return layerskip::attend_rows(q.narrow(0, s.row, s.T).transpose(0, 1), kl.narrow(1, 0, stop),
                                  vl.narrow(1, 0, stop), mask, s_.scale);
  }

  // layer_math.mlp: norm, gate/up, act(gate) * up (the kernel's row activation, as layer_math.gated), down, the
  // post-MLP norm where the family has one, residual: (N, d).
  Tensor mlp(const Layer& w, const Tensor& h) {
    if (!w.gate_up.defined()) return h;
    const int64_t I = w.down.in;
    const auto gu = matmul(norm(h, w.mlp_norm, s_), w.gate_up, 2 * I);  // (N, 2 I)
    const auto act = layerskip::gated_act(gu, s_.gelu);  // (N, I)
    auto y = matmul(act, w.down, h.size(1));  // (N, d)
    if (w.post_mlp_norm.defined()) y = norm(y, w.post_mlp_norm, s_);
    add_into(y, h);
    return y;
  }

  std::vector<Layer> layers_;
  Shape s_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace layerskip;
  m.def("small_matmul", &small_matmul, "y = x @ w.T for small T (fp32, or bf16 with AVX512_BF16)");
  m.def("pack_panels", &pack_panels, "w (N, K) packed in panels (G, K, 48) for panel_matmul (AVX-512 path)");
  m.def("panel_matmul", &panel_matmul, "y = x @ w.T, w's n rows packed in panels (infer.kernels.panels; AVX-512)",
        py::arg("x"), py::arg("w"), py::arg("n"));
  m.def("path", &path_name, "the instruction set this process uses: 'avx512' or 'avx2'");
  m.def("supports_bf16", &supports_bf16, "whether bf16 weights run here (AVX512_BF16)");
  m.def("parallel_threads", &parallel_threads, "how many threads one of the kernel's parallel regions runs on now");
  m.def("attend_rows", &attend_rows, "softmax(q k^T scale) v one query row at a time (fp32; bf16 with AVX512_BF16)");
  m.def("attend_cache", &attend_cache, "attend_rows after writing k, v into one layer of the KV caches");
  m.def("bf16_value_pairs", &bf16_value_pairs, "whether bf16 attention sums values over pairs of keys (vdpbf16ps)");
  m.def("gated_act", &gated_act, "act(gate) * up of gate_up (T, 2 I) = [gate | up], row by row (SiLU; GELU-tanh "
        "where gelu)", py::arg("gate_up"), py::arg("gelu") = false);
  m.def("rms_norm", &rms_norm, "w * x * rsqrt(mean(x^2) + eps) over the last dim (fp32, bf16; AVX-512 path)");
  py::class_<LayerStack>(m, "LayerStack", "a runner's decoder layers, run as one program per call (AVX-512 path)")
      .def(py::init<const py::list&, int64_t, int64_t, int64_t, double, double, bool, bool>(), py::arg("layers"),
           py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("scale"),
           py::arg("offset_norm"), py::arg("gelu"))
      .def("run", &LayerStack::run, "a program's walk over packed rows of segments: (kept streams, the last stream)",
           py::arg("hidden"), py::arg("walk"), py::arg("segments"), py::arg("cos"), py::arg("sin"));
}
