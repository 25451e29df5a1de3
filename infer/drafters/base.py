"""The drafter protocol: what every drafter gives the engine and gets back from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from infer.kv_cache import ints_to_device

if TYPE_CHECKING:
    from infer.kv_cache import KVCache
    from infer.runner import Runner
    from infer.sampling import SamplingConfig


@dataclass
class Draft:
    """Proposed tokens, as a chain or a tree hanging off the pending token (tree position 0).

    Tree positions 1..m are the drafted nodes in topological order. The drafter also tells the
    engine which cache rows it already computed exactly, so verification skips that work.
    """

    tokens: Tensor
    """(m,) drafted token ids for tree positions 1..m."""
    parents: list[int] | None = None
    """Parent tree position of each drafted node (0 = pending token); None means a chain."""
    q: Tensor | None = None
    """(m, V) draft distribution each node was drawn from (sampling); None = deterministic."""
    exact_layers: int = 0
    """E: cache layers [0, E) already hold exact KV for tree positions [0, h) (h = len(hidden))."""
    hidden: Tensor | None = None
    """(h, d) residual stream at the input of layer E for tree positions [0, h); chain order."""

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class VerifyOutcome:
    """What one verification step decided (given to ``Drafter.update``)."""

    draft: Draft | None
    """The draft that was verified (None for a plain autoregressive step)."""
    path: list[int]
    """Tree positions of the accepted path, starting with the pending token (0)."""
    tokens: list[int]
    """Tokens appended to the output by this step: accepted drafts, then the bonus token."""
    start: int
    """Sequence index of the pending token (= cache length before the step)."""
    target_argmax: list[int] = field(default_factory=list)
    """Full model's argmax at each tree position (greedy decoding only)."""
    exit_hidden: Tensor | None = None
    """(T, d) residual stream entering layer ``draft.exact_layers`` at every verified tree position, as verification
    used it (the draft's rows, then those verification computed); None for a plain step or E = 0."""

    @property
    def accepted(self) -> int:
        return len(self.path) - 1

    @property
    def drafted(self) -> int:
        return 0 if self.draft is None else self.draft.size


@dataclass
class DecodeState:
    """The engine's view of one sequence being decoded, shared with the drafter."""

    runner: Runner
    cache: KVCache
    sampling: SamplingConfig
    generator: torch.Generator
    tokens: list[int]
    """Prompt followed by every generated token, including the pending one."""
    prompt_len: int
    n: int = 0
    """tokens[:n] are in the cache (all layers); tokens[n] is the pending token."""
    budget: int = 0
    """How many more tokens may be appended (accepted drafts + bonus) before max_new_tokens."""
    eos: frozenset[int] = frozenset()
    """Token ids that end the generation (empty when it does not stop at EOS): a draft chain stops after one."""
    depth: int | None = None
    """Layers of the target (the model's count, or a lossy target exit's; None: the model's count)."""

    def __post_init__(self) -> None:
        if self.depth is None:
            self.depth = getattr(self.runner, "num_layers", None)  # stand-in runners of unit tests may have none

    @property
    def pending(self) -> int:
        return self.tokens[self.n]

    def ids(self, start: int, end: int) -> Tensor:
        """tokens[start:end] as a (end - start,) long tensor on the runner's device (a pinned copy: no host sync)."""
        return ints_to_device(self.tokens[start:end], self.runner.device)


class Drafter(Protocol):
    """One way to propose tokens; the engine verifies them losslessly.

    A drafter may write anything into the cache beyond ``state.n`` in layers >= its
    ``Draft.exact_layers``: verification rolls those layers back before it writes.
    """

    name: str
    drafts: bool
    """False for a drafter that never proposes (plain decoding): only such a drafter may decode a lossy target.
    Optional: drafters without it are taken to draft."""

    @property
    def lookahead(self) -> int:
        """Most cache slots past the pending token one ``propose``/``update`` may write."""
        ...

    def start(self, state: DecodeState) -> None:
        """A new sequence has been prefilled (state.n = prompt length)."""

    def propose(self, state: DecodeState) -> Draft | None:
        """Draft tokens after the pending one, or None for a plain autoregressive step."""

    def update(self, state: DecodeState, outcome: VerifyOutcome) -> None:
        """Learn from a verification (the cache now holds state.n exact rows)."""

    def stats(self) -> dict:
        """Drafter-specific statistics for the result (e.g. optimisation time); no side effects."""

    def finish(self) -> None:
        """Decoding with this drafter is over (called once by its owner): save plans or learned state.
        Optional: callers skip drafters that have no ``finish``."""
