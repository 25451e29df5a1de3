"""What SWIFT's looking for a plan may cost: bounded by what drafting could gain on this model.

Looking costs twice: the optimiser's scoring forwards over the context window, and probes (the gate's drafting cycles
with a plan the cost model expects to pay). Both used to be budgeted as if drafting could pay anywhere: a probe
started at a predicted 0.9x (below what the gate keeps), the optimiser took a flat 3 % of plain time however far its
best plan was from paying, and a probe lifted the share to 25 % of the drafter's whole history, plain time included.
On Gemma 3 270M (matchness 0.1-0.2 where 0.35 is needed) that cost 7-9 % of a 64-token prompt. Now (docs/SWIFT.md,
"The cost of looking"):

- a probe starts only when the cost model predicts drafting clears the gate (``PROBE_BAR``, the gate's own margin);
- each mode's share applies to the time spent in that mode: plain time earns the plain share, drafting time the
  drafting share, so a probe earns only its own time's share;
- the plain share is ``fallback_opt_budget`` for the first look, then in proportion to how far the best plan's
  matchness has come towards the matchness that would clear the gate (``needed_matchness``), at least
  ``LOOK_FLOOR`` (the search must go on to find anything), at most ``fallback_opt_budget``;
- the drafting share is ``opt_budget`` at most, and at most the fraction of time drafting saves, 1 - 1/S, from the
  measured (else predicted) speed-up S: optimisation never spends more than drafting gains, and never less than
  the plain share.
"""

from __future__ import annotations

from collections.abc import Callable

from infer.drafters.gate import FallbackGate

PROBE_BAR = 1.0 + FallbackGate.MARGIN
"""SWIFT's bar for a probe: the cost model's predicted speed-up must clear the gate (drafting is kept only when it
beats plain steps by the gate's ``MARGIN``); a probe predicted below it costs its cycles and is expected to lose."""
LOOK_FLOOR = 0.01
"""Least share of plain time the optimiser may take once a plan was scored (the search must go on to improve)."""


def needed_matchness(speedup: Callable[[float], float | None], bar: float = PROBE_BAR,
                     tolerance: float = 1e-3) -> float | None:
    """The least matchness at which ``speedup`` (the cost model, increasing with matchness) reaches ``bar``, by
    bisection; None when even matchness 1 does not (no plan with this draft cost can pay)."""
    top = speedup(1.0)
    if top is None or top < bar:
        return None
    lo, hi = 0.0, 1.0
    while hi - lo > tolerance:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if (speedup(mid) or 0.0) >= bar else (mid, hi)
    return hi


def plain_share(fallback: float, best: float, needed: float | None, floor: float = LOOK_FLOOR) -> float:
    """The optimiser's share of plain time: ``fallback`` before any plan was scored (``best`` < 0: the first look);
    then ``fallback`` times the best matchness over the ``needed`` one, within [``floor``, ``fallback``] (the floor
    when no matchness pays)."""
    if best < 0:
        return fallback
    progress = 0.0 if needed is None else min(best / max(needed, 1e-9), 1.0)
    return min(fallback, max(floor, fallback * progress))


def draft_share(opt_budget: float, plain: float, speedup: float | None) -> float:
    """The optimiser's share of drafting time: ``opt_budget`` at most, and at most 1 - 1/``speedup`` (what drafting
    at that speed-up saves), never below the ``plain`` share; ``opt_budget`` when no speed-up is known."""
    if speedup is None or speedup <= 0:
        return opt_budget
    return max(plain, min(opt_budget, 1.0 - 1.0 / speedup))


def within(spent: float, step: float, shares: tuple[float, float], plain_time: float, draft_time: float,
           drafting: bool) -> bool:
    """Whether a step of ``step`` seconds keeps ``spent`` + ``step`` within what each mode's time earns at its share
    (``shares``: plain, drafting; ``plain_time`` and ``draft_time`` hold each mode's decoding and optimisation), the
    step itself at the current mode's share (``drafting``)."""
    plain, draft = shares
    earned = plain * plain_time + draft * draft_time + (draft if drafting else plain) * step
    return spent + step <= earned
