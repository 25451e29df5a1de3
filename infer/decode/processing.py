"""Logits processing at every verified position: what lets a prefix-dependent rule (a repetition penalty, a
banned n-gram, a minimum length, a caller's own processor) run inside a draft-verify loop and stay lossless.

Plain decoding scores one position per forward, after the whole prefix before it. Verification scores a tree of
positions at once; position i's prefix is the committed sequence (prompt, generated tokens, the pending token)
followed by the drafted tokens on the path from the root to i. A ``PositionProcessor`` is called once per
verification with that committed sequence, each position's drafted suffix and the target's logits, and returns the
processed scores; the engine then picks (greedy: argmax) or samples (softmax of the scores) from those, so the
output equals plain decoding with the same processing, and sampling is exact against the processed distribution.
Drafts are proposed from the drafter's own (unprocessed) logits: that only changes how many are accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch import Tensor

from infer.decode.acceptance import TreeShape
from infer.model.sampling import SamplingConfig

PROCESSED = SamplingConfig(temperature=1.0)
"""How the target samples from processed scores: softmax of the scores as they are (the processor has applied any
temperature, top-k or top-p itself)."""


class PositionProcessor(Protocol):
    """Processes the target's logits at tree positions (see the module docstring)."""

    def __call__(self, committed: Sequence[int], suffixes: list[list[int]], logits: Tensor) -> Tensor:
        """``committed``: prompt + generated tokens + the pending token; ``suffixes[i]``: the drafted tokens from the
        root to position i (empty for the root); ``logits`` (T, V). Returns the processed (T, V) scores."""
        ...


def tree_suffixes(tree: TreeShape, tokens: list[int]) -> list[list[int]]:
    """Each tree position's drafted suffix: the tokens on the path from the root (excluded) to it (included).

    ``tokens``: the host token of every tree position (position 0, the pending token, is not part of a suffix)."""
    suffixes: list[list[int]] = [[]]
    for i, parent in enumerate(tree.parents, start=1):
        suffixes.append(suffixes[parent] + [tokens[i]])
    return suffixes


def process_tree(processor: PositionProcessor, committed: Sequence[int], tree: TreeShape, ids: Tensor,
                 logits: Tensor) -> Tensor:
    """(T, V) processed scores of the T tree positions whose tokens are ``ids`` (T,) (one host read of ``ids``)."""
    suffixes = tree_suffixes(tree, ids.tolist()) if tree.size > 1 else [[]]
    return processor(committed, suffixes, logits)
