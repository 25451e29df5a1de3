"""A model's layers and head as the executors run them: ``Stack`` (the runner is one), draft heads, counters.

``Stack`` holds what every executor of a forward reads (the spec, the layers' weights, the final norm and LM head,
the RoPE tables, the small-matmul kernel, the counters) and the pieces of math they share (embedding, RoPE rows,
head). ``infer.model.runner.Runner`` is a ``Stack`` that also loads weights, keeps caches, draft heads and derived
runners, and runs programs; the executors below it (``infer.model.loop``, ``infer.model.graphs``,
``infer.model.fused_span``) take a ``Stack``, so none of them imports the runner back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from infer.model import layer_math
from infer.model.quant_weights import QuantLinear
from infer.model.weights import LayerWeights, Linear
from layerskip_core.families import ModelSpec


@dataclass
class RunnerCounters:
    """How many token-rows each layer has processed (for tests and profiling)."""

    layer_tokens: list[int] = field(default_factory=list)
    lm_head_tokens: int = 0

    def reset(self) -> None:
        self.layer_tokens = [0] * len(self.layer_tokens)
        self.lm_head_tokens = 0


class Stack:
    """The layers and head a forward runs over, and the math every executor shares. Its fields are set by the runner
    (``Runner.__init__``, ``Runner.own_layers``)."""

    spec: ModelSpec
    """The layers' spec: family, shapes, per-layer windows and RoPE tables."""
    dtype: torch.dtype
    device: torch.device
    kernel: object
    """The small-matmul kernel module (``infer.kernels``), or None (torch's matmuls)."""
    layers: list[LayerWeights]
    final_norm: Tensor
    lm_head: Linear
    embed_w: Tensor | None
    """The embedding (None: tied to the LM head, whose rows it reads)."""
    embed_scale: Tensor | None
    rope_rows: list[int]
    """Per layer: its row in the RoPE tables (``rope``, ``rope_tables``)."""
    counters: RunnerCounters
    _cos: list[Tensor]
    """Per RoPE table: (n, D) cos over the positions [0, n)."""
    _sin: list[Tensor]
    """Per RoPE table: (n, D) sin, with the sign of the roll form folded in."""

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def rope_tables(self) -> tuple[list[Tensor], list[Tensor]]:
        """(cos, sin): K (n, D) tables each, one per RoPE table."""
        return self._cos, self._sin

    def embed(self, ids: Tensor) -> Tensor:
        x = self.lm_head.rows(ids) if self.embed_w is None else F.embedding(ids, self.embed_w)  # (T,) -> (T, d)
        return x if self.embed_scale is None else x * self.embed_scale

    def rope(self, positions: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """(cos, sin) at ``positions`` (T,) on the device: K tensors (T, 1, D) each, one per RoPE table (layer i reads
        table ``rope_rows[i]``; each its own tensor, so compiled steps see no storage offset that differs by table);
        sin has the sign of the roll form folded in."""
        return [c[positions][:, None] for c in self._cos], [s[positions][:, None] for s in self._sin]

    def head(self, hidden: Tensor, vocab: DraftHead | None = None) -> Tensor:
        """Final norm + LM head in fp32, without counting (the runner counts); with ``vocab``, only its N rows of the
        head run and the other logits are -inf."""
        h = layer_math.norm(hidden, self.final_norm, self.spec)  # (T, d)
        if vocab is not None:
            return vocab.logits(h)  # (T, V)
        return layer_math.softcap(self.lm_head(h.to(self.lm_head.dtype)).float(), self.spec)  # (T, V)

    def qkv_rope(self, w: LayerWeights, hidden: Tensor, cos: Tensor, sin: Tensor,
                 bulk: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """A layer's attention norm, q/k/v projection, q/k norms and RoPE (``layer_math.qkv_rope``; ``cos``/``sin``
        (T, 1, D): the layer's table): (Hq, T, D), (Hkv, T, D), (Hkv, T, D)."""
        return layer_math.qkv_rope(self.spec, w, hidden, cos, sin, bulk)

    def mlp(self, w: LayerWeights, hidden: Tensor, bulk: bool = False) -> Tensor:
        """A layer's MLP sublayer with its residual (``layer_math.mlp``): (T, d) -> (T, d)."""
        return layer_math.mlp(self.spec, w, hidden, bulk)


class DraftHead:
    """The LM head restricted to N token ids (a reduced-vocabulary draft head), built once per runner and ids.

    Its weight is a gathered copy of the N rows of the shared head (the model's own head, tied or not, is
    untouched); ``logits`` scores only those N ids and returns them at their places in the full vocabulary,
    with -inf elsewhere, so everything downstream (argmax, softmax, sampling, token trees) sees a proper
    draft distribution that is zero outside the subset. Verification never uses it. With ``quant`` (a scheme name of
    ``infer.kernels.quant``) the copy is quantized, its products in the model's dtype (``QuantLinear``).
    """

    def __init__(self, stack: Stack, ids: Tensor, key: str, dtype: torch.dtype | None = None,
                 quant: str | None = None):
        self.ids = ids.to(stack.device, torch.long)  # (N,) sorted, unique
        self.key = key  # identifies the ids, the dtype and the scheme (static forwards are keyed by it)
        self.vocab_size = stack.spec.vocab_size
        self.spec = stack.spec  # its final logit softcapping
        rows = stack.lm_head.rows(self.ids).to(dtype or stack.dtype)  # (N, d)
        # a copy, in ``dtype`` or quantized: only drafts read it
        self.linear = Linear(rows, None, stack.kernel) if quant is None else \
            QuantLinear(rows, None, quant, stack.kernel, stack.dtype)

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    def logits(self, normed: Tensor) -> Tensor:
        """(T, d) final-normed hidden -> (T, V) fp32 logits, -inf outside the subset."""
        sub = layer_math.softcap(self.linear(normed.to(self.linear.dtype)).float(), self.spec)  # (T, N)
        full = sub.new_full((sub.shape[0], self.vocab_size), float("-inf"))  # (T, V)
        return full.index_copy_(1, self.ids, sub)
