"""What the static executor (``infer.model.graphs``) and the compiled layer steps (``infer.model.compiled``) use of
a model's forward. ``infer.model.runner.Runner`` satisfies it; naming it here keeps those modules below the runner,
which builds its executor from them, instead of importing the runner back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from infer.model.kv_cache import KVCache
    from infer.model.plan import LayerPlan
    from infer.model.weights import LayerWeights
    from layerskip_core.models import ModelSpec


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

    def fall_back_to_eager(self, reason: str) -> None: ...
