"""SWIFT's scoring of sublayer skip plans: agreement with verified tokens over a window, in draft mode."""

from __future__ import annotations

import torch
from torch import Tensor

from infer.drafters.base import DecodeState
from infer.plan import LayerPlan


def window_mask(w: int, hidden: int, device) -> Tensor:
    """(w, hidden + w) mask: w re-run tokens skip the ``hidden`` slots before them and see each other causally."""
    hide = torch.zeros(w, hidden, dtype=torch.bool, device=device)
    causal = torch.ones(w, w, dtype=torch.bool, device=device).tril()
    return torch.cat([hide, causal], dim=1)


@torch.no_grad()
def matchness_span(state: DecodeState, plans: list[LayerPlan], start: int, end: int) -> list[float]:
    """Fraction of positions in [start, end) where each plan's argmax equals the next verified token.

    ``tokens[start..end]`` (end <= n = cache length; tokens[n] is the pending token, itself the full
    model's choice) are re-run in draft mode at their own positions, appended after the cache and
    masked from their old rows [start, n); the cache is rolled back afterwards.
    """
    runner, cache, n = state.runner, state.cache, state.n
    w = end - start
    if w < 1 or start < 1 or end > n:
        return [0.0 for _ in plans]
    ids = state.ids(start, end)  # (w,)
    target = state.ids(start + 1, end + 1)  # (w,)
    positions = torch.arange(start, end, device=runner.device)
    mask = window_mask(w, n - start, runner.device)  # (w, n - start + w)
    embedded = runner.embed(ids)  # (w, d)
    scores = []
    for plan in plans:
        hidden = runner.forward_layers(cache, embedded, positions, 0, runner.num_layers, plan=plan, mask=mask)
        agree = runner.logits(hidden).argmax(-1) == target  # (w,)
        scores.append(float(agree.float().mean()))
        cache.rollback(n)
    return scores
