"""Agreement of sublayer skip plans with verified tokens: how often a plan's draft argmax equals the token the
full model chose, scored by re-running a window of verified tokens under the plan in one masked forward.

One scorer, two views of the KV a re-run window token attends to (``kv``), because the two optimisers
model two different drafts:

- ``"draft"`` (SWIFT's matchness, Xia et al. 2025): the window is re-run as one draft-mode chain. Each
  token sees the context before the window (exact) and the draft-mode rows of the window tokens before
  it; the window's old (exact) rows are hidden. What ``swift`` optimises online.
- ``"exact"`` (the model objective of ``layerskip search``): each token sees the exact rows of the
  window tokens before it and only its own draft-mode row, as the first draft after a verification
  does; the search replays chain drafting over these per-position outcomes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from infer.drafters.base import DecodeState
from infer.model.plan import LayerPlan
from infer.model.program import ONCE, Program, Rows

KV_VIEWS = ("draft", "exact")


def rerun_mask(w: int, hidden: int, device, kv: str = "draft") -> Tensor:
    """(w, hidden + w) mask of w window tokens appended after a cache whose last ``hidden`` rows (>= w) start
    with the window's own old rows: 'draft' hides those rows and lets the new rows see each other causally;
    'exact' lets window token i see the old rows of the i window tokens before it and its own new row."""
    if kv == "draft":
        old = torch.zeros(w, hidden, dtype=torch.bool, device=device)
        new = torch.ones(w, w, dtype=torch.bool, device=device).tril()
    elif kv == "exact":
        old = torch.ones(w, hidden, dtype=torch.bool, device=device).tril(-1)  # exact rows [start, start + i)
        new = torch.eye(w, dtype=torch.bool, device=device)  # the draft-mode row it writes itself
    else:
        raise ValueError(f"kv must be one of {KV_VIEWS}, got {kv!r}")
    return torch.cat([old, new], dim=1)


@dataclass
class Window:
    """Verified tokens [start, end) of a cache holding n rows, ready to be scored under plans."""

    cache: object
    """The KV cache (rolled back to ``n`` rows after every plan)."""
    n: int
    """Rows of the cache that stay."""
    positions: Tensor
    """(w,) positions of the window tokens."""
    target: Tensor
    """(w,) the verified token that follows each window token."""
    mask: Tensor
    """(w, n - start + w) attention mask of the chosen KV view."""
    inputs: list[Tensor]
    """inputs[l]: (w, d) exact input of layer l; only the embeddings unless the layer inputs were kept."""


@torch.no_grad()
def verified_window(runner, cache, n: int, start: int, tokens: Tensor, target: Tensor, kv: str,
                    layer_inputs: bool = False) -> Window:
    """A window over ``tokens`` (w,) at positions [start, start + w) (start + w <= n), each to predict ``target``.

    ``layer_inputs`` runs the full model over the window once and keeps every layer's exact input,
    so that scoring a plan starts at its first skipped layer (worth it when many plans are scored).
    """
    w = len(tokens)
    positions = torch.arange(start, start + w, device=runner.device)
    inputs = [runner.embed(tokens)]  # (w, d)
    if layer_inputs:
        exact = rerun_mask(w, n - start, runner.device, "draft")  # the full model in draft view is exact
        L = runner.num_layers
        out = runner.run(Program(0, L, observe=tuple(range(1, L))), Rows.one(cache, inputs[0], positions, exact, ONCE))
        inputs += [out.observed[layer] for layer in range(1, L)] + [out.hidden]
        cache.rollback(n)
    return Window(cache, n, positions, target, rerun_mask(w, n - start, runner.device, kv), inputs)


@torch.no_grad()
def agreement(runner, window: Window, plan: LayerPlan, vocab=None) -> tuple[Tensor, Tensor]:
    """(agree (w,) bool, top1 (w,)): does the plan's draft argmax equal the verified token; its top-1 probability.
    ``vocab``: the reduced-vocabulary draft head the plan drafts with (``infer.model.runner.DraftHead``), if any."""
    first = min(plan.exact_prefix, len(window.inputs) - 1)  # layers before it skip nothing: their output is exact
    rows = Rows.one(window.cache, window.inputs[first], window.positions, window.mask, ONCE)
    hidden = runner.run(Program(first, runner.num_layers, plan=plan), rows).hidden  # (w, d)
    window.cache.rollback(window.n)
    logits = runner.logits(hidden, vocab)  # (w, V)
    return logits.argmax(-1) == window.target, torch.softmax(logits, -1).amax(-1)


def matchness_span(state: DecodeState, plans: list[LayerPlan], start: int, end: int, vocab=None,
                   runner=None) -> list[float]:
    """SWIFT's matchness: fraction of positions in [start, end) where each plan's argmax (draft view) equals the
    next verified token (``vocab``: scored with that reduced-vocabulary draft head, as the drafts are; ``runner``:
    the layers the drafts run, default the model's: a quantized copy over the model's cache).

    ``tokens[start..end]`` (end <= n = cache length; tokens[n] is the pending token, itself the full
    model's choice) are re-run at their own positions after the cache; the cache is rolled back afterwards.
    """
    if end - start < 1 or start < 1 or end > state.n:
        return [0.0 for _ in plans]
    runner = runner or state.runner
    window = verified_window(runner, state.cache, state.n, start, state.ids(start, end), state.ids(start + 1, end + 1),
                             "draft")
    return [float(agreement(runner, window, plan, vocab)[0].float().mean()) for plan in plans]
