"""What the layers below the runner use of a model's forward, and the values a forward takes and gives.

``ForwardModel``: the runner's decoding forward, piece by piece, as the one layer loop (``infer.model.packed``), the
static executor (``infer.model.graphs``) and the compiled layer steps (``infer.model.compiled``) call it;
``infer.model.runner.Runner`` satisfies it. ``Segment`` (one sequence's rows in a packed forward) and ``SpanOutput``
(what a span returns) are the values those forwards pass. Naming them here keeps those modules below the runner,
which builds its executor and layer loop from them, instead of importing the runner back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from infer.model.kv_cache import KVCache
from infer.model.plan import LayerPlan
from infer.model.weights import LayerWeights, Linear
from layerskip_core.models import ModelSpec


@dataclass
class Segment:
    """One sequence's T rows in a packed forward."""

    cache: KVCache
    """The sequence's own cache: its per-layer lengths say where its keys and values go."""
    positions: Sequence[int] | Tensor
    """RoPE positions of its T new tokens (host ints; a (T,) tensor where the caller holds them on the device)."""
    mask: Tensor | None = None
    """(T, W) bool over the last W attended slots, as ``Runner.forward_layers`` takes it (None: causal)."""

    @property
    def size(self) -> int:
        return len(self.positions)


@dataclass
class SpanOutput:
    """What ``Runner.span`` returns for the T tokens of one call."""

    exact: Tensor
    """(T, d) residual stream at the input of layer ``exact_until`` (before any skip plan)."""
    hidden: Tensor
    """(T, d) residual stream after the last layer of the span."""
    logits: Tensor | None = None
    """(T, V) fp32 logits after the final norm and LM head, when asked for."""


class VocabHead(Protocol):
    """A reduced-vocabulary draft head, as the executor keys it."""

    key: str


class LayerCounts(Protocol):
    """Token-rows processed per layer and by the LM head."""

    layer_tokens: list[int]
    lm_head_tokens: int


class ForwardModel(Protocol):
    """The runner's decoding forward, piece by piece."""

    spec: ModelSpec
    device: torch.device
    dtype: torch.dtype
    layers: list[LayerWeights]
    lm_head: Linear
    kernel: object
    """The small-matmul kernel module (``infer.kernels``), or None (torch's matmuls)."""
    counters: LayerCounts
    rope_rows: list[int]
    """Per layer: its row in the RoPE tables ``rope`` returns."""

    @property
    def num_layers(self) -> int: ...

    def rope(self, positions: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """(cos, sin): K tensors (T, 1, D) each, one per RoPE table."""

    def qkv_rope(self, w: LayerWeights, hidden: Tensor, cos: Tensor, sin: Tensor,
                 bulk: bool = False) -> tuple[Tensor, Tensor, Tensor]: ...

    def mlp(self, w: LayerWeights, hidden: Tensor, bulk: bool = False) -> Tensor: ...

    def head(self, hidden: Tensor, vocab: VocabHead | None = None) -> Tensor: ...

    def embed(self, ids: Tensor) -> Tensor: ...

    def new_cache(self, capacity: int) -> KVCache: ...

    def forward_layers(self, cache: KVCache, hidden: Tensor, positions: Tensor, start: int = 0,
                       end: int | None = None, plan: LayerPlan | None = None,
                       mask: Tensor | None = None, bulk: bool = False) -> Tensor: ...

    def span(self, cache: KVCache, hidden: Tensor, positions: list[int], start: int, end: int,
             **options: Any) -> Any: ...

    def span_rows(self, segments: Sequence[Segment], hidden: Tensor, start: int, split: int, end: int,
                  plan: LayerPlan | None = None, logits: bool = False,
                  vocab: VocabHead | None = None) -> SpanOutput: ...

    def attn_mask(self, start_slot: int, T: int, mask: Tensor | None) -> Tensor | None:
        """(T, start_slot + T) bool; None where no mask is needed."""

    def window_mask(self, cache: KVCache, i: int, base: Tensor | None, positions: Tensor) -> Tensor | None:
        """Layer ``i``'s mask for new rows at ``positions``: ``base``, cut to the layer's sliding window if any."""

    def cached_attention(self, i: int, cache: KVCache, q: Tensor, k: Tensor, v: Tensor,
                         attn_mask: Tensor | None, scale: float | None = None, bulk: bool = False) -> Tensor:
        """Write k, v at layer ``i``'s length in ``cache``, then attend q over the layer's filled slots."""

    def fall_back_to_eager(self, reason: str) -> None: ...
