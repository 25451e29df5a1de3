"""A decoder layer's math, written once for every model family and every forward kind.

The one eager layer loop (``infer.model.loop``: one sequence or packed rows), the static forwards
(``infer.model.graphs``) and their compiled steps (``infer.model.compiled``) all call these functions, so what a family
adds to Llama's layer (``layerskip_core.models.Family``: the (1 + w) norm, the embedding scale, q/k norms, norms after
attention and MLP, GELU-tanh, the attention scale, per-layer RoPE tables, final logit softcapping; a sliding window is a
mask, ``infer.model.program``'s) lives here and survives any rebuild of a layer loop. Each function takes the model's
``ModelSpec`` and a layer's ``LayerWeights``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from infer.model.weights import LayerWeights, Linear, rms_norm
from layerskip_core.errors import UserError
from layerskip_core.families import DEFAULT_ROPE, NO_ROPE, ModelSpec


def norm(x: Tensor, weight: Tensor, spec: ModelSpec) -> Tensor:
    """RMSNorm over the last dim in the family's flavour: Llama's w * normed.to(dtype), or Gemma's
    (normed * (1 + w)).to(dtype) in fp32 (``weight`` then holds 1 + w in fp32: ``infer.model.weights.norm_weight``)."""
    if not spec.family.norm_offset:
        return rms_norm(x, weight, spec.rms_norm_eps)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, spec.rms_norm_eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + spec.rms_norm_eps)
    return (x32 * weight).to(x.dtype)


def embed_scale(spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> Tensor | None:
    """The embedding multiplier (sqrt(hidden) rounded to the model dtype, as transformers' Gemma 3), or None."""
    if not spec.family.embed_scale:
        return None
    return torch.tensor(spec.hidden_size ** 0.5).to(device, dtype)


def softcap(logits: Tensor, spec: ModelSpec) -> Tensor:
    """c * tanh(logits / c) where the family caps its final logits; else the logits as they are."""
    cap = spec.final_softcap
    return logits if cap is None else torch.tanh(logits / cap) * cap


def qkv_rope(spec: ModelSpec, w: LayerWeights, hidden: Tensor, cos: Tensor, sin: Tensor,
             bulk: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """A layer's attention norm, fused q/k/v projection, q/k norms and RoPE (``cos``/``sin`` (T, 1, D): the layer's
    table rows; the identity table for a layer without RoPE): (Hq, T, D), (Hkv, T, D), (Hkv, T, D)."""
    T, D, Hq, Hkv = hidden.shape[0], spec.head_dim, spec.num_heads, spec.num_kv_heads
    x = norm(hidden, w.attn_norm, spec)  # (T, d)
    heads = w.qkv(x, bulk).view(T, Hq + 2 * Hkv, D)  # (T, Hq + 2 Hkv, D): one view, sliced below (few small ops)
    qk = heads[:, :Hq + Hkv]  # (T, Hq + Hkv, D)
    if w.q_norm is not None:  # per-head norms before RoPE (Qwen3, Gemma 3)
        qk = torch.cat([norm(qk[:, :Hq], w.q_norm, spec), norm(qk[:, Hq:], w.k_norm, spec)], 1)  # (T, Hq + Hkv, D)
    # RoPE on q and k at once: rotate_half(x) * sin == roll(x, D/2) * [-sin_lo, sin_hi]; the in-place product and
    # sum compute qk * cos + roll * sin bitwise as before, with two temporaries fewer
    qk = (qk * cos).add_(qk.roll(D // 2, dims=-1).mul_(sin))  # (T, Hq + Hkv, D)
    qk = qk.transpose(0, 1)  # (Hq + Hkv, T, D)
    q, k = qk[:Hq], qk[Hq:]  # (Hq, T, D), (Hkv, T, D): slices (Tensor.split is Python, ~10 calls deeper)
    v = heads[:, Hq + Hkv:].transpose(0, 1)  # (Hkv, T, D)
    return q, k, v


def attention_out(spec: ModelSpec, w: LayerWeights, hidden: Tensor, out: Tensor, bulk: bool = False) -> Tensor:
    """The attention sublayer's end: output projection of ``out`` (T, Hq D), the post-attention norm where the
    family has one, the residual: (T, d)."""
    y = w.o(out, bulk)  # (T, d)
    if w.post_attn_norm is not None:
        y = norm(y, w.post_attn_norm, spec)
    return y.add_(hidden)  # hidden + y bitwise (a sum is commutative), into y's fresh memory


def mlp(spec: ModelSpec, w: LayerWeights, hidden: Tensor, bulk: bool = False) -> Tensor:
    """A layer's MLP sublayer with its residual (pre-norm, gated activation, post-norm where the family has one):
    (T, d) -> (T, d); a layer without an MLP passes it through."""
    if w.gate_up is None:
        return hidden
    x = norm(hidden, w.mlp_norm, spec)  # (T, d)
    y = w.down(gated(spec, w.gate_up, w.gate_up(x, bulk)), bulk)  # (T, d)
    if w.post_mlp_norm is not None:
        y = norm(y, w.post_mlp_norm, spec)
    return y.add_(hidden)  # hidden + y bitwise, into y's fresh memory


def gated(spec: ModelSpec, gate_up: Linear, gu: Tensor) -> Tensor:
    """The gated MLP's act(gate) * up of the gate/up output ``gu`` (T, 2 I): (T, I). Where ``gate_up`` runs on the
    kernel, the kernel's activation (``gated_act``: each row alone, its tail in the same vector code), so a row's bits
    do not depend on T or on the threads; torch's F.silu / F.gelu compute a stretch's last elements by another code
    path and split a large tensor among threads mid-row (docs/KERNELS.md, "Where the exactness contract holds").
    Elsewhere (torch's matmul, autograd, ``torch.compile`` tracing) torch's functions."""
    gelu = spec.family.activation != "silu"
    kernel = gate_up.kernel or getattr(gate_up, "act_kernel", None)  # a quantized draft matrix's: its kernel module
    if (kernel is not None and gu.dtype == gate_up.dtype and gu.device.type == "cpu" and hasattr(kernel, "gated_act")
            and not (torch.is_grad_enabled() and gu.requires_grad) and not torch.compiler.is_compiling()):
        return kernel.gated_act(gu, gelu)  # (T, I)
    gate, up = gu.chunk(2, dim=-1)  # (T, I) each
    act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)  # (T, I)
    return act.mul_(up)


# --------------------------------------------------------------------------- RoPE tables
def rope_inv_freq(config, spec: ModelSpec, table: str) -> tuple[Tensor, float]:
    """(inverse frequencies (D/2,), attention scaling) of one RoPE table: ``NO_ROPE`` is all zeros (cos 1, sin 0:
    the identity, bitwise), ``DEFAULT_ROPE`` the config's ``rope_parameters``, a layer type's (Gemma 3) its own."""
    dim = spec.head_dim
    if table == NO_ROPE:
        return torch.zeros(dim // 2), 1.0
    params = getattr(config, "rope_parameters", None) or {}
    layer_type = None if table == DEFAULT_ROPE else table
    if layer_type is not None:
        params = params.get(layer_type) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type == "dynamic":
        raise UserError("dynamic RoPE scaling is not supported by the runner")
    # transformers-internal (its module moves between releases): imported only for scaled RoPE variants
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, **kwargs)
    return inv_freq.float().cpu(), float(scale)


def rope_table(inv_freq: Tensor, scale: float, n: int) -> tuple[Tensor, Tensor]:
    """(cos, sin) (n, D) fp32 for positions [0, n); sin carries the sign of the roll form (see ``qkv_rope``)."""
    pos = torch.arange(n, dtype=torch.float)
    freqs = pos[:, None] * inv_freq[None, :]  # (n, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (n, D)
    half = emb.shape[-1] // 2
    sin = emb.sin() * scale
    sin[:, :half] = -sin[:, :half]  # rotate_half(x) * sin == roll(x, half) * signed sin
    return emb.cos() * scale, sin
