"""Scoring of sublayer skip plans, shared by Self-SD (offline search) and SWIFT (online search)."""

from __future__ import annotations

import torch
from torch import Tensor

from infer.drafters.base import DecodeState
from infer.plan import LayerPlan
from infer.runner import Runner


def window_mask(w: int, hidden: int, device) -> Tensor:
    """(w, hidden + w) mask: w re-run tokens skip the ``hidden`` slots before them and see each other causally."""
    hide = torch.zeros(w, hidden, dtype=torch.bool, device=device)
    causal = torch.ones(w, w, dtype=torch.bool, device=device).tril()
    return torch.cat([hide, causal], dim=1)


@torch.no_grad()
def matchness(state: DecodeState, plans: list[LayerPlan], window: int) -> list[float]:
    """Teacher-forced agreement of each plan's argmax with the last ``window`` verified tokens."""
    w = min(window, state.n - 1)
    return matchness_span(state, plans, state.n - w, state.n)


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


def relative_cost(runner: Runner, plan: LayerPlan) -> float:
    """Cost of one draft forward relative to a full forward, by weights read (memory-bound decoding).

    Attention reads 4 d² -ish (q, k, v, o), the MLP 3 d·I, the LM head V·d; skipped sublayers read nothing.
    """
    s = runner.spec
    attn = s.hidden_size * (s.num_heads + 2 * s.num_kv_heads) * s.head_dim + s.num_heads * s.head_dim * s.hidden_size
    mlp = 3 * s.hidden_size * s.intermediate_size
    head = s.vocab_size * s.hidden_size
    full = s.num_layers * (attn + mlp) + head
    run = (s.num_layers - len(plan.skip_attn)) * attn + (s.num_layers - len(plan.skip_mlp)) * mlp + head
    return run / full
