"""What the dynamic-exit drafter estimates and how it prices a draft: per candidate exit E and confidence stop t,
how often a draft from E would be proposed and accepted, and how acceptance runs (a good position followed by a
good one), from the positions verification has validated; and the speed-up over plain decoding a chain of k drafts
from E stopped at t is expected to give.

A position is *confident* at stop t when the exit's top token has probability >= t (t = 0: always), and *good* when
it is confident and that token is the one the target emitted there: a draft chain from E with stop t proposes while
positions are confident, and its proposals are accepted while they are good. Drafts are not independent (boiler-
plate runs long, a hard span fails repeatedly), so each (E, t) keeps, besides the share of confident and good
positions, how often a confident (good) position is followed by a confident (good) one: a two-state Markov chain of
each. A chain of k drafts then yields

    tokens(k) = 1 + p1 (1 + p + ... + p^(k-1))          p1 = P(good), p = P(good | previous good)
    forwards(k) = 1 + q1 (1 + q + ... + q^(k-2))        q1 = P(confident), q = P(confident | previous confident)
    proposed(k) = q1 (1 + q + ... + q^(k-1))

and costs ``c_E forwards + verify + slope v_E proposed`` plain steps: a draft forward at E, and verifying 1 + proposed
rows (each extra row runs only the layers the first does, so it costs ``slope`` times ``v_E`` below). LayerSkip's
verification reuses the exact KV and stream the draft forwards computed below E, so where every
verified row went through a draft forward (the chain stopped on confidence: its last forward's token was not
proposed) it runs only layers [E, L) and the head, ``v_E`` of a plain step; where all k drafts were proposed, the
last one still needs every layer, about a plain step. So ``verify = v_E + (1 - v_E) P(all k proposed)``, with
``P(all k proposed) = q1 q^(k-1)`` (1 without a stop).
Without pairs observed yet, p and q fall back to p1 and q1 (independent drafts).
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_SEEN = 4.0
"""Pseudo-positions every (exit, stop) starts from (the prior is worth 4 observed positions), at its exit's prior
P(good) (``RunEstimates`` ``prior``; default ``FLAT_PRIOR``; an exit accepted everywhere still reaches 0.92 with the
default decay)."""
FLAT_PRIOR = 0.1
"""P(good) of every exit of a model whose exits were not trained, before anything is observed: low enough that no
exit is predicted to pay before one is seen to (untrained exits of the default model agree 0.02-0.2 with the last
layer), so one lucky hit of a cheap shallow exit does not make it the choice."""
PRIOR_PAIRS = 1.0
"""Pseudo-pairs the run statistics start from, at the marginal (independent drafts until pairs are seen)."""
AUTO_STOPS = (0.0, 0.5, 0.7, 0.9)
"""Confidence stops chosen among per context by default (0: draft all k tokens)."""


def parse_stops(text: str) -> tuple[float, ...]:
    """``'auto'`` -> AUTO_STOPS; ``'0/0.7'`` -> (0.0, 0.7); each in [0, 1). ValueError says what is wrong."""
    if text == "auto":
        return AUTO_STOPS
    try:
        stops = tuple(sorted({float(p) for p in text.replace(",", "/").split("/")}))
    except ValueError:
        raise ValueError(f"stops must be confidence thresholds separated by '/' (e.g. 0/0.7) or 'auto', "
                         f"got {text!r}") from None
    if not all(0.0 <= s < 1.0 for s in stops):
        raise ValueError(f"stops must each be in [0, 1) (0 = no stop), got {text!r}")
    return stops


@dataclass(frozen=True)
class Choice:
    """What to draft next and what the cost model expects of it."""

    exit: int
    """E to draft from."""
    k: int
    """Most tokens to draft."""
    stop: float
    """Confidence stop of the chain (0: none)."""
    speedup: float
    """Predicted tokens per plain-step cost (1.0 = plain decoding's)."""


@dataclass(frozen=True)
class RunRates:
    """One (exit, stop)'s estimated rates."""

    good: float
    """p1: share of positions whose draft would be proposed and accepted."""
    good_after_good: float
    """p: share of good positions following a good one."""
    confident: float
    """q1: share of positions whose draft would be proposed."""
    confident_after_confident: float
    """q: share of confident positions following a confident one."""


class _Counts:
    """Discounted counts of one (exit, stop): positions, confident, good, and consecutive pairs of them."""

    __slots__ = ("seen", "conf", "good", "after_conf", "conf_conf", "after_good", "good_good", "prior", "last")

    def __init__(self, prior: float = FLAT_PRIOR) -> None:
        for name in self.__slots__[:-2]:
            setattr(self, name, 0.0)
        self.prior = prior  # P(good) before anything is observed
        self.last: tuple[bool, bool] | None = None  # (confident, good) of the last position added

    def add(self, conf: list[bool], good: list[bool], decay: float, continues: bool) -> None:
        """One window of consecutive positions; ``continues``: it starts right after the last window added, so its
        first position pairs with that window's last."""
        prev = self.last if continues else None
        for c, g in zip(conf, good, strict=True):
            self.seen, self.conf, self.good = decay * self.seen + 1, decay * self.conf + c, decay * self.good + g
            if prev is not None:  # a pair with the position before
                self.after_conf = decay * self.after_conf + prev[0]
                self.conf_conf = decay * self.conf_conf + (prev[0] and c)
                self.after_good = decay * self.after_good + prev[1]
                self.good_good = decay * self.good_good + (prev[1] and g)
            prev = (c, g)
        self.last = prev

    def rates(self, stop: float) -> RunRates:
        p1 = (self.good + self.prior * PRIOR_SEEN) / (self.seen + PRIOR_SEEN)
        q1 = 1.0 if stop == 0 else (self.conf + PRIOR_SEEN / 2) / (self.seen + PRIOR_SEEN)
        p = (self.good_good + PRIOR_PAIRS * p1) / (self.after_good + PRIOR_PAIRS)
        q = 1.0 if stop == 0 else (self.conf_conf + PRIOR_PAIRS * q1) / (self.after_conf + PRIOR_PAIRS)
        return RunRates(p1, p, q1, q)


class RunEstimates:
    """Per candidate exit and confidence stop: the discounted counts behind ``RunRates``."""

    def __init__(self, exits: list[int], stops: tuple[float, ...], decay: float, prior: dict[int, float] | None = None):
        """``prior``: each exit's P(good) before anything is observed (default ``FLAT_PRIOR`` for every exit)."""
        self.exits, self.stops, self.decay = exits, stops, decay
        self.counts = {(e, s): _Counts(FLAT_PRIOR if prior is None else prior[e]) for e in exits for s in stops}

    def add(self, exit: int, probs: list[float], hits: list[bool], continues: bool = False) -> None:
        """One window of consecutive verified positions at ``exit``: its top token's probability and whether that
        token was the target's, per position; ``continues``: it starts right after the last window added."""
        for s in self.stops:
            conf = [p >= s for p in probs]
            good = [c and h for c, h in zip(conf, hits, strict=True)]
            self.counts[exit, s].add(conf, good, self.decay, continues)

    def rates(self, exit: int, stop: float) -> RunRates:
        return self.counts[exit, stop].rates(stop)

    def alpha(self) -> dict[int, float]:
        """Each exit's per-token acceptance without a stop (P(good) at stop 0)."""
        return {e: self.rates(e, 0.0).good if 0.0 in self.stops else self.rates(e, self.stops[0]).good
                for e in self.exits}


def _geometric(r: float, n: int) -> float:
    """1 + r + ... + r^(n-1) (0 for n <= 0)."""
    return sum(r ** i for i in range(max(n, 0)))


def predicted_speedup(rates: RunRates, k: int, price: float, slope: float, verify: float = 1.0) -> float:
    """Expected tokens per plain-step cost of a chain of at most k drafts (module docstring)."""
    tokens = 1 + rates.good * _geometric(rates.good_after_good, k)
    forwards = 1 + rates.confident * _geometric(rates.confident_after_confident, k - 1)
    proposed = rates.confident * _geometric(rates.confident_after_confident, k)
    every = rates.confident * rates.confident_after_confident ** (k - 1)  # all k proposed: the last row not reused
    return tokens / (price * forwards + verify + (1 - verify) * every + slope * verify * proposed)


def best_choice(estimates: RunEstimates, prices: dict[int, float], max_k: int, slope: float,
                verify: dict[int, float] | None = None, exits: list[int] | None = None) -> Choice:
    """The (E, k, stop) with the most expected tokens per plain-step cost (``predicted_speedup``);
    ``verify``: each exit's verification price (default 1: a plain step); ``exits``: only among these."""
    best = None
    for (e, s) in estimates.counts:
        if exits is not None and e not in exits:
            continue
        rates, v = estimates.rates(e, s), 1.0 if verify is None else verify[e]
        for k in range(1, max_k + 1):
            speedup = predicted_speedup(rates, k, prices[e], slope, v)
            if best is None or speedup > best.speedup:
                best = Choice(e, k, s, speedup)
    return best
