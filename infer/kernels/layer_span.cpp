// Decoder layers [start, end) of one sequence's T new rows in one call from Python (issue 44: a step at memory speed).
//
// The eager layer loop (infer/model/packed.py over infer/model/layer_math.py) runs ~34 small torch ops a layer and
// the interpreter between them: ~4 ms of a 30-layer one-token step beside ~26 ms of matmuls. This file runs the same
// layers from C++: the kernel's own functions (rms_norm, small_matmul, attend_rows, gated_act: the MLP's activation
// row by row, as the Python loop calls it on the kernel) called directly, and the elementwise steps that torch
// computes as one rounding per op (RoPE's two products and their sum, the residual sums) written here with the same
// roundings: fp32 products and sums, never contracted into an FMA (the extension is built with -ffp-contract=off);
// bf16 each op in fp32 on the widened values, rounded to bf16 as ATen rounds (round to nearest even in integer
// arithmetic). So every bit of the output, the KV cache rows, the cache lengths and the layer counters equals the
// Python loop's (tests/infer/test_kernel_layer.py).
//
// Scope (the Python side, infer/model/fused_span.py, decides once per runner and per call): Llama-shaped layers (no
// q/k norms, no post norms, no biases, SiLU, full attention, the plain RMSNorm) on the AVX-512 path, fp32 and bf16
// (AVX512_BF16), T <= 32 rows of one sequence, never T > 1 rows from an empty layer (those attend causally on SDPA).
//
// This file also holds the module's Python bindings (the kernel functions are the other files', see kernels.h).
#include "kernels.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstring>
#include <exception>
#include <map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

using BF16 = c10::BFloat16;

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

// y[j] = y[j] + x[j] over n elements, in fp32 then stored in E: torch's y.add_(x).
template <class E>
void add(E* y, const E* x, int64_t n) {
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = first(n - j);
    store(y + j, _mm512_add_ps(load(y + j, m), load(x + j, m)), m);
  }
}

}  // namespace vec
#pragma GCC pop_options

struct Layer {
  torch::Tensor attn_norm, qkv, o;  // (d,), ((Hq + 2 Hkv) D, d), (d, Hq D); each matrix plain or packed (G, K, 48)
  torch::Tensor mlp_norm, gate_up, down;  // (d,), (2 I, d), (d, I); undefined: no MLP (an exit adapter's layer)
  int64_t rope = 0;  // its RoPE table
};

// One span call: the rows' positions, the RoPE tables, the cache and its lengths, the skip plan, the counters' growth,
// the masks made so far. Plain C++ values (read from Python before, written back after), so the layers run without
// the GIL.
struct Call {
  int64_t T;
  std::vector<int64_t> pos;  // (T,)
  std::vector<torch::Tensor> cos, sin;  // per table (n, D)
  torch::Tensor ck, cv;  // (L, Hkv, C, D)
  c10::optional<torch::Tensor> mask;  // (T, W) bool over the last W slots; none: causal
  std::vector<int64_t> lengths, added;  // per layer: KVCache.lengths, rows to add to its counter
  std::vector<char> skip_attn, skip_mlp;  // per layer, for the layers under the plan
  std::map<int64_t, c10::optional<torch::Tensor>> masks;  // by start slot
};

// Per layer: whether it is in the Python set ``skip`` (None: none is).
std::vector<char> flags(const py::object& skip, size_t layers) {
  std::vector<char> out(layers, 0);
  if (skip.is_none()) return out;
  for (const auto& item : skip) {
    const auto i = item.cast<int64_t>();
    if (i >= 0 && i < static_cast<int64_t>(layers)) out[i] = 1;
  }
  return out;
}

// Runner.attn_mask: (T, S) bool over slots [0, S), S = slot + T, made once per start slot; none for one row without a
// mask (every key visible).
const c10::optional<torch::Tensor>& visible(Call& c, int64_t slot) {
  const auto known = c.masks.find(slot);
  if (known != c.masks.end()) return known->second;
  const int64_t T = c.T, S = slot + T;
  c10::optional<torch::Tensor> out;
  if (c.mask.has_value() || T > 1) {
    auto m = torch::empty({T, S}, torch::kBool);  // (T, S)
    bool* p = m.data_ptr<bool>();
    std::memset(p, 1, T * S);
    if (!c.mask.has_value()) {  // causal new rows: row t sees slots [0, slot + t]
      for (int64_t t = 0; t < T; ++t) std::memset(p + t * S + slot + t + 1, 0, T - t - 1);
    } else {
      const int64_t W = c.mask->size(1);
      TORCH_CHECK_VALUE(W <= S, "mask covers ", W, " slots but only ", S, " exist");
      const bool* given = c.mask->data_ptr<bool>();
      for (int64_t t = 0; t < T; ++t) std::memcpy(p + t * S + S - W, given + t * W, W);
    }
    out = m;
  }
  return c.masks.emplace(slot, std::move(out)).first->second;
}

// y += x elementwise (y fresh and contiguous), as attention_out's and mlp's y.add_(hidden).
void add_into(torch::Tensor& y, const torch::Tensor& x) {
  const auto xc = x.contiguous();
  if (y.scalar_type() == torch::kBFloat16) {
    vec::add(y.data_ptr<BF16>(), xc.data_ptr<BF16>(), y.numel());
  } else {
    vec::add(y.data_ptr<float>(), xc.data_ptr<float>(), y.numel());
  }
}

// RoPE on each row's q heads into q (T, Hq, D) and its k heads into the layer's cache rows [slot, slot + T); v copied
// there as it is. heads (T, (Hq + 2 Hkv) D) contiguous; kl, vl (Hkv, C, D) with unit inner stride.
template <class E>
void rope_rows(const torch::Tensor& heads, torch::Tensor& q, torch::Tensor& kl, torch::Tensor& vl,
               const torch::Tensor& cos, const torch::Tensor& sin, const Call& c, int64_t slot) {
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = kl.size(0), width = heads.size(1);
  std::vector<E> rolled(D);
  for (int64_t t = 0; t < c.T; ++t) {
    const E* row = heads.data_ptr<E>() + t * width;
    const E* cr = cos.data_ptr<E>() + c.pos[t] * D;
    const E* sr = sin.data_ptr<E>() + c.pos[t] * D;
    for (int64_t h = 0; h < Hq; ++h) vec::rope_row(row + h * D, cr, sr, q.data_ptr<E>() + (t * Hq + h) * D, D,
                                                   rolled.data());
    for (int64_t j = 0; j < Hkv; ++j) {
      E* k = kl.data_ptr<E>() + j * kl.stride(0) + (slot + t) * kl.stride(1);
      vec::rope_row(row + (Hq + j) * D, cr, sr, k, D, rolled.data());
      std::memcpy(vl.data_ptr<E>() + j * vl.stride(0) + (slot + t) * vl.stride(1), row + (Hq + Hkv + j) * D,
                  D * sizeof(E));
    }
  }
}

class LayerStack {
 public:
  // ``layers``: per layer (attn_norm, qkv, o, mlp_norm, gate_up, down, rope table), the MLP's three None where it has
  // none; the runner's own tensors (held, not copied).
  LayerStack(const py::list& layers, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale)
      : Hq_(heads), Hkv_(kv_heads), D_(head_dim), eps_(eps), scale_(scale) {
    TORCH_CHECK(layerskip::path_name() == "avx512", "LayerStack: the kernel's AVX-512 path only");
    TORCH_CHECK(head_dim % 2 == 0 && head_dim <= 256 && kv_heads > 0 && heads % kv_heads == 0, "head shapes");
    for (const auto& item : layers) {
      const auto t = item.cast<py::tuple>();
      TORCH_CHECK(t.size() == 7, "a layer: (attn_norm, qkv, o, mlp_norm, gate_up, down, rope table)");
      auto get = [&](size_t k) { return t[k].is_none() ? torch::Tensor() : t[k].cast<torch::Tensor>(); };
      Layer w{get(0), get(1), get(2), get(3), get(4), get(5), t[6].cast<int64_t>()};
      TORCH_CHECK(w.o.size(1) == heads * head_dim && w.gate_up.defined() == w.down.defined() &&
                  w.gate_up.defined() == w.mlp_norm.defined(),
                  "layer shapes: fused q/k/v, o, and the MLP's three tensors all or none");
      layers_.push_back(std::move(w));
    }
  }

  // Layers [start, split) exactly, then [split, end) without the sublayers in skip_attn / skip_mlp (Python sets, or
  // None): Runner.span_rows of one segment. Returns (the stream after split, the stream after end); ``lengths`` (the
  // cache's) and ``counts`` (the runner's layer counters) are advanced as the Python loop advances them. The layers
  // run without the GIL.
  py::tuple span(const torch::Tensor& hidden, std::vector<int64_t> positions, std::vector<torch::Tensor> cos,
                 std::vector<torch::Tensor> sin, torch::Tensor ck, torch::Tensor cv, py::list lengths,
                 py::list counts, int64_t start, int64_t split, int64_t end, const py::object& skip_attn,
                 const py::object& skip_mlp, c10::optional<torch::Tensor> mask) {
    const auto L = layers_.size();
    check(hidden, positions, cos, sin, ck, cv, mask, std::max(split, end), lengths, counts);
    if (mask.has_value()) mask = mask->contiguous();
    Call c{hidden.size(0), std::move(positions), std::move(cos), std::move(sin), std::move(ck), std::move(cv),
           std::move(mask), lengths.cast<std::vector<int64_t>>(), std::vector<int64_t>(L, 0),
           flags(skip_attn, L), flags(skip_mlp, L), {}};
    torch::Tensor exact, out;
    std::exception_ptr error;
    {
      py::gil_scoped_release unlocked;
      try {
        exact = run(hidden, c, start, split, false);
        out = split >= end ? exact : run(exact, c, split, end, true);
      } catch (...) {
        error = std::current_exception();
      }
    }
    for (size_t i = 0; i < L; ++i) {  // what ran, as the Python loop leaves it (also when a layer raised)
      if (c.lengths[i] != lengths[i].cast<int64_t>()) lengths[i] = py::int_(c.lengths[i]);
      if (c.added[i] != 0) counts[i] = py::int_(counts[i].cast<int64_t>() + c.added[i]);
    }
    if (error) std::rethrow_exception(error);
    return py::make_tuple(exact, out);
  }

 private:
  void check(const torch::Tensor& h, const std::vector<int64_t>& pos, const std::vector<torch::Tensor>& cos,
             const std::vector<torch::Tensor>& sin, const torch::Tensor& ck, const torch::Tensor& cv,
             const c10::optional<torch::Tensor>& mask, int64_t last, const py::list& lengths,
             const py::list& counts) const {
    const auto dtype = h.scalar_type();
    TORCH_CHECK(h.dim() == 2 && h.size(0) >= 1 && static_cast<int64_t>(pos.size()) == h.size(0) &&
                (dtype == torch::kFloat32 || dtype == torch::kBFloat16) && h.device().is_cpu(),
                "hidden (T, d) fp32 or bf16 on the CPU, with T positions");
    const auto L = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(last <= L && static_cast<int64_t>(lengths.size()) == L && static_cast<int64_t>(counts.size()) == L,
                "layer range, lengths and counters: the stack's ", L, " layers");
    TORCH_CHECK(ck.dim() == 4 && cv.sizes() == ck.sizes() && ck.size(1) == Hkv_ && ck.size(3) == D_ &&
                ck.stride(3) == 1 && cv.stride(3) == 1 && ck.scalar_type() == dtype && cv.scalar_type() == dtype &&
                ck.size(0) >= last, "caches (L, Hkv, C, D) in the hidden's dtype");
    TORCH_CHECK(cos.size() == sin.size() && !cos.empty(), "RoPE tables: as many cos as sin");
    for (size_t r = 0; r < cos.size(); ++r) {
      TORCH_CHECK(cos[r].is_contiguous() && sin[r].is_contiguous() && cos[r].sizes() == sin[r].sizes() &&
                  cos[r].dim() == 2 && cos[r].size(1) == D_ && cos[r].scalar_type() == dtype &&
                  sin[r].scalar_type() == dtype, "RoPE tables (n, D) contiguous in the hidden's dtype");
      for (const int64_t p : pos) TORCH_CHECK(p >= 0 && p < cos[r].size(0), "position ", p, " past the RoPE table");
    }
    TORCH_CHECK(!mask.has_value() || (mask->scalar_type() == torch::kBool && mask->dim() == 2 &&
                                      mask->size(0) == h.size(0)), "mask (T, W) bool");
  }

  // Layers [a, b) over h (packed.packed_layers of one segment), under the call's skip plan where ``planned``.
  torch::Tensor run(torch::Tensor h, Call& c, int64_t a, int64_t b, bool planned) {
    for (int64_t i = a; i < b; ++i) {
      TORCH_CHECK(i >= 0, "layer ", i);
      const bool attn = !(planned && c.skip_attn[i]), mlp = !(planned && c.skip_mlp[i]);
      if (attn) h = attention(layers_[i], i, h, c);
      if (mlp) h = this->mlp(layers_[i], h);
      if (attn || mlp) c.added[i] += c.T;
    }
    return h;
  }

  // layer_math.qkv_rope, Runner.cached_attention (the row attention), layer_math.attention_out: (T, d).
  torch::Tensor attention(const Layer& w, int64_t i, const torch::Tensor& h, Call& c) {
    const int64_t T = c.T, slot = c.lengths[i], stop = slot + T;
    TORCH_CHECK(slot > 0 || T == 1, "T > 1 rows from an empty layer attend causally on SDPA: the Python loop's");
    const auto& mask = visible(c, slot);
    TORCH_CHECK(stop <= c.ck.size(2), "KV cache full: layer ", i, " needs ", stop, " slots, capacity ",
                c.ck.size(2));
    c.lengths[i] = stop;
    const auto heads = layerskip::linear(layerskip::rms_norm(h, w.attn_norm, eps_), w.qkv,
                                         (Hq_ + 2 * Hkv_) * D_);  // (T, (Hq + 2 Hkv) D)
    auto q = torch::empty({T, Hq_, D_}, h.options());  // (T, Hq, D)
    auto kl = c.ck.select(0, i), vl = c.cv.select(0, i);  // (Hkv, C, D)
    const auto &cos = c.cos.at(w.rope), &sin = c.sin.at(w.rope);
    if (h.scalar_type() == torch::kBFloat16) rope_rows<BF16>(heads, q, kl, vl, cos, sin, c, slot);
    else rope_rows<float>(heads, q, kl, vl, cos, sin, c, slot);
    const auto out = layerskip::attend_rows(q.transpose(0, 1), kl.narrow(1, 0, stop), vl.narrow(1, 0, stop), mask,
                                            scale_);  // (Hq, T, D), a view of (T, Hq, D)
    auto y = layerskip::linear(out.transpose(0, 1).reshape({T, Hq_ * D_}), w.o, h.size(1));  // (T, d)
    add_into(y, h);
    return y;
  }

  // layer_math.mlp: norm, gate/up, SiLU(gate) * up (the kernel's row activation, as layer_math.gated), down,
  // residual: (T, d).
  torch::Tensor mlp(const Layer& w, const torch::Tensor& h) {
    if (!w.gate_up.defined()) return h;
    const int64_t I = w.down.size(1);  // the down matrix's K, plain or packed
    const auto gu = layerskip::linear(layerskip::rms_norm(h, w.mlp_norm, eps_), w.gate_up, 2 * I);  // (T, 2 I)
    const auto act = layerskip::gated_act(gu, false);  // (T, I)
    auto y = layerskip::linear(act, w.down, h.size(1));  // (T, d)
    add_into(y, h);
    return y;
  }

  std::vector<Layer> layers_;
  int64_t Hq_, Hkv_, D_;
  double eps_, scale_;
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
  py::class_<LayerStack>(m, "LayerStack", "a runner's decoder layers, run as one span per call (AVX-512 path)")
      .def(py::init<const py::list&, int64_t, int64_t, int64_t, double, double>(), py::arg("layers"),
           py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("scale"))
      .def("span", &LayerStack::span, "layers [start, split) exactly, then [split, end) under the skip sets: "
           "(the stream after split, after end)");
}
