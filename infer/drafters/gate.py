"""Draft only while it pays: measured tokens/s of plain steps against draft-verify cycles.

Speculative decoding pays only when the draft is cheap and accepted often enough; on a small model
on a CPU it often is not (a 135M model's draft that skips 42 % of its sublayers still costs about
0.65 of a full step, and verifying a few tokens costs 1.4-2.1 steps: docs/SWIFT.md). A drafter that owns a `FallbackGate` reports every decode
cycle to it and asks it whether the next cycle drafts or takes a plain step (``propose`` returns
None). Greedy and sampled output stay exact either way: a plain step is a verification of nothing.
"""

from __future__ import annotations


class Rate:
    """Exponential moving average of tokens per second over decode cycles."""

    def __init__(self, weight: float = 0.2):
        self.weight, self.tokens, self.seconds, self.cycles = weight, 0.0, 0.0, 0

    def add(self, tokens: int, seconds: float) -> None:
        w = 1.0 if self.cycles == 0 else self.weight
        self.tokens += w * (tokens - self.tokens)
        self.seconds += w * (seconds - self.seconds)
        self.cycles += 1

    @property
    def value(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class FallbackGate:
    """After every cycle: draft next, or take a plain step?

    Plain steps are timed first (``WARM_PLAIN``), then drafting is probed for ``PROBE`` cycles and
    kept while its tokens/s beats plain steps by ``MARGIN``. Otherwise plain steps resume and drafting
    is probed again after ``recheck`` plain steps, doubling after every failed probe (up to
    ``BACKOFF`` times the interval), unless the caller's cost model predicts less than ``HOPELESS``.
    A caller whose drafter improves while plain (SWIFT's optimiser) can ask for an early probe.
    """

    WARM_PLAIN = 3
    PROBE = 6
    MARGIN = 0.02
    BACKOFF = 16
    HOPELESS = 0.9

    def __init__(self, recheck_interval: int, enabled: bool = True):
        self.enabled = enabled
        self.recheck_interval = self.recheck = recheck_interval
        self.mode = "plain" if enabled else "draft"
        self.mode_cycles = 0
        self.plain, self.drafting = Rate(), Rate()

    def record(self, tokens: int, seconds: float, drafted: bool) -> None:
        """One finished cycle: ``tokens`` emitted in ``seconds``, with or without a draft."""
        (self.drafting if drafted else self.plain).add(tokens, seconds)

    def decide(self, predicted: float | None = None, early_probe: bool = False) -> bool:
        """Choose the next cycle's mode; True when drafting starts a new probe now."""
        if not self.enabled:
            return False
        self.mode_cycles += 1
        if self.mode == "plain":
            periodic = self.mode_cycles >= self.recheck and (predicted is None or predicted >= self.HOPELESS)
            due = self.drafting.cycles == 0 or periodic or (early_probe and self.mode_cycles >= self.WARM_PLAIN)
            if self.plain.cycles >= self.WARM_PLAIN and due:
                self._switch("draft")
                return True
        elif self.mode_cycles >= self.PROBE and self.drafting.value < self.plain.value * (1 + self.MARGIN):
            self.recheck = min(self.recheck * 2, self.recheck_interval * self.BACKOFF)
            self._switch("plain")
        return False

    def _switch(self, mode: str) -> None:
        self.mode, self.mode_cycles = mode, 0
        if mode == "draft":
            self.drafting = Rate()  # judge the (possibly changed) drafter on fresh measurements
