"""Quantized draft weights: a matrix in int8 / int4 with the call interface of ``infer.model.weights.Linear``, a
decoder layer's copy in them, and a runner's quantized copy of its layers for drafts (issue 64).

Only drafts read these: verification always runs the model's own weights, so a quantized draft changes what is
proposed, never the output. The format and the kernel are ``infer.kernels.quant``'s (docs/KERNELS.md, "Quantized
draft weights"): int8 per output row, int4 in symmetric groups of 64 with bf16 scales; the activations stay in the
model's dtype (fp32 or bf16; an fp16 model's rows are widened to fp32 for the product), the arithmetic in fp32, and
row t of a T-row product is bitwise the 1-row product (batch invariant, as the model's own matmuls).

Names a drafter's ``draft_dtype`` takes (``QUANT_DTYPES``): ``int8`` (every draft matrix int8) and ``int4`` (the
layers int4, the draft head int8: an int4 head cost the default model's drafts 4 points of agreement for 3% of an
int4 draft's bytes, measured in docs/KERNELS.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from infer import kernels
from infer.kernels import quant
from infer.kernels.quant import QuantScheme, QuantWeight
from infer.model.weights import LayerWeights, Linear
from layerskip_core.errors import UserError

QUANT_DTYPES = ("int8", "int4")
"""The draft dtypes that quantize the draft's weights (``infer.drafters.base.DRAFT_DTYPES``)."""
HEAD_SCHEME = {"int8": "int8", "int4": "int8"}
"""The scheme of the draft head (the reduced-vocabulary LM head copy drafts score with) per draft dtype."""
_FLOATS = (torch.float32, torch.bfloat16)
"""Activation dtypes the quantized matmul takes as they are (others are widened to fp32 and narrowed back)."""


class QuantLinear:
    """y = x @ dequantize(Wq)^T (+ b): ``Linear``'s call interface (``__call__(x, bulk)``, ``rows``, ``weight``,
    ``nbytes``, ``shape``, ``dtype``, ``bias``) over a quantized copy of W (out, in), so the layer loop and the draft
    head run it unchanged. ``dtype`` is the activations' (the model's): a call's rows and result are in it.

    ``kernel`` is None (no float panels: the prefill's packing rule sees a matmul off the float kernel); the fused
    executor reads the codes instead (``matrix``); ``act_kernel`` is the kernel module whose row-invariant MLP
    activation (``infer.model.layer_math.gated``) follows this matrix where the model's would use it."""

    kernel = None

    def __init__(self, weight: Tensor, bias: Tensor | None, scheme: QuantScheme | str, kernel, dtype: torch.dtype):
        self.qw: QuantWeight = quant.quantize(weight, scheme)
        self.shape = tuple(weight.shape)  # (out, in)
        self.dtype = dtype
        self.bias = None if bias is None else bias.to(dtype)
        self.act_kernel = kernel if kernels.supports(kernel, dtype) and weight.device.type == "cpu" else None
        # the kernel's operator, called directly (``quant.matmul``'s checks and lookups cost ~50 us a call)
        self._op = quant.kernel_op() if self.qw.layout == "panels" else None
        self._args = (self.qw.codes, self.qw.scales, self.shape[0], self.qw.scheme.bits, self.qw.scheme.group)

    @property
    def scheme(self) -> QuantScheme:
        return self.qw.scheme

    @property
    def weight(self) -> Tensor:
        """W as the codes stand for it (out, in), in ``dtype`` (a new tensor each time: for checks, not a step)."""
        return quant.dequantize(self.qw).to(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes one call reads: codes and scales (and the bias)."""
        return self.qw.nbytes + (0 if self.bias is None else self.bias.nbytes)

    def __call__(self, x: Tensor, bulk: bool = False) -> Tensor:
        if self._op is not None and x.dim() == 2 and x.dtype in _FLOATS and x.device.type == "cpu":
            y = self._op(x, *self._args)  # (T, out)
        else:
            y = quant.matmul(x if x.dtype in _FLOATS else x.float(), self.qw).to(x.dtype)  # (T, out)
        return y if self.bias is None else y + self.bias

    def rows(self, ids: Tensor) -> Tensor:
        """Rows ``ids`` (T,) of W as the codes stand for it: (T, in)."""
        return F.embedding(ids, self.weight)

    def matrix(self) -> tuple[Tensor, Tensor, int, int, int] | None:
        """What the fused executor (``layer_span.cpp``) multiplies by, the very call ``__call__`` makes: (codes,
        scales, bits, group, in) in the kernel's panel layout; None where the codes are not on the kernel here."""
        if self._op is None:
            return None
        return self.qw.codes, self.qw.scales, self.qw.scheme.bits, self.qw.scheme.group, self.shape[1]


def check_widths(layers: list[LayerWeights], name: str, what: str = "the model") -> None:
    """Refuse, in one line, a draft dtype ``name`` whose scheme does not fit a matrix of ``layers`` (int4's groups
    must divide every input width), naming the matrix, its width, the group and what to use instead."""
    scheme = quant.scheme_named(name)
    if scheme.bits != 4:
        return
    for w in layers:
        for matrix, m in (("self_attn.q/k/v_proj", w.qkv), ("self_attn.o_proj", w.o), ("mlp.gate/up_proj", w.gate_up),
                          ("mlp.down_proj", w.down)):
            if m is not None and m.shape[1] % scheme.group:
                raise UserError(f"draft dtype {name}: {what}'s {matrix} has input width {m.shape[1]}, which int4's "
                                f"groups of {scheme.group} do not divide; use --draft-dtype int8 (or bf16) for it")


def quant_linear(m: Linear | None, scheme: str, kernel, dtype: torch.dtype) -> QuantLinear | None:
    """A quantized copy of ``m`` (None stays None)."""
    return None if m is None else QuantLinear(m.weight, m.bias, scheme, kernel, dtype)


def quant_layer(w: LayerWeights, scheme: str, kernel, dtype: torch.dtype) -> LayerWeights:
    """A copy of layer ``w`` whose matrices are quantized by ``scheme`` (activations in ``dtype``); its norms are the
    model's own tensors (a few KB: read as they are)."""
    def q(m: Linear | None) -> QuantLinear | None:
        return quant_linear(m, scheme, kernel, dtype)

    return LayerWeights(w.attn_norm, q(w.qkv), q(w.o), w.mlp_norm, q(w.gate_up), q(w.down), w.q_norm, w.k_norm,
                        w.post_attn_norm, w.post_mlp_norm)


def quantized(runner, name: str, end: int | None = None):
    """A runner over quantized copies of ``runner``'s layers [0, ``end``) (default all) by draft dtype ``name``, with
    its final norm, in its dtype, its RoPE tables, embedding and head: made once per runner, scheme and end
    (``Runner.derived``), each layer quantized once per runner and scheme (``Runner.quant_layers``), so copies of
    several ends share their layers. Its caches have the model's layout and dtype, so a draft may run it over the
    model's own cache (``infer.drafters.quant_draft``). It runs on the fused executor where the model's would
    (``infer.model.fused_span``: the quantized matmul in C++), else eagerly (the static forwards trace float matrices
    only)."""
    end = runner.num_layers if end is None else end

    def layer(i: int) -> LayerWeights:
        key = (name, i)
        if key not in runner.quant_layers:
            runner.quant_layers[key] = quant_layer(runner.layers[i], name, runner.kernel, runner.dtype)
        return runner.quant_layers[key]

    def build():
        copy = runner.over_layers([layer(i) for i in range(end)], runner.final_norm)
        copy.static = None  # static / captured forwards trace matmuls the quantized kernel does not offer
        return copy

    return runner.derived(f"quant {name} {end}", build)


def copy_nbytes(layers: list[LayerWeights]) -> int:
    """Bytes a draft reads of ``layers``' matrices per token (quantized or float)."""
    return sum(m.nbytes for w in layers for m in (w.qkv, w.o, w.gate_up, w.down) if m is not None)


def byte_share(name: str | None, dtype: torch.dtype, head: bool = False) -> float:
    """Bytes a draft reads per weight in draft dtype ``name`` over the model's (``dtype``) bytes per weight: 1 for a
    float draft (None), int8 1 byte (+ a 4-byte scale a row, not counted), int4 half a byte + a 2-byte scale per 64
    (``head``: the draft head's scheme, ``HEAD_SCHEME``). What the cost models scale a draft's weight count by."""
    if name is None:
        return 1.0
    scheme = quant.scheme_named(HEAD_SCHEME[name] if head else name)
    per_weight = 1.0 if scheme.bits == 8 else 0.5 + 2.0 / scheme.group
    return per_weight / dtype.itemsize
