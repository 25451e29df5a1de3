"""One never-slower gate for a batch: draft or take plain steps for every row, from the batch's measured speed per B.

At B rows a plain cycle already shares one weight stream among B tokens; a drafting cycle verifies B (M + rejected)
rows, arithmetic that a plain cycle does not pay, and on a CPU core a 20-row verification costs about 1.5 plain
8-row cycles (docs/BATCHING.md). Whether drafting pays therefore depends on B, and a row's own gate cannot tell: it
times the batch's cycle, and its memory is keyed without B. So a ``BatchEngine`` whose drafters are adaptive takes
their gates over (``Drafter.hand_over_gate``) and decides for every row at once, per number of running rows, from
the batch's progress and each cycle's seconds (prefill excluded: a joining row's prefill runs between cycles).
Progress is the tokens every row committed while prompts wait for a slot (a row that finishes early makes room for
the next); with none waiting it is B times the least any row committed: the batch ends when its slowest row does,
so tokens that put other rows ahead buy nothing (measured: with 8 rows and no queue, a drafting probe that raised
the batch's tokens per second left its end 12-20% later).

Per B: a steady mode, and now and then a probe of the other one; a probe that does not change the choice doubles the
time to the next one (up to ``BACKOFF`` times). The first B times plain steps, then probes drafting. A B seen for the
first time starts in the mode its nearest measured B chose, without a probe: a batch without a queue ends in a tail
of rows finishing one by one, a few cycles at each B, where a probe would cost more than it could find (and drafting
rows out of step lengthens the tail: the batch's last cycles run the rows that gained least).
Output is unchanged either way: a plain step is a verification of nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infer.drafters.gate import Rate

RECHECK = 32
"""Cycles in the chosen mode before the other one is probed again at the same B (doubling after each probe that did
not change the choice): a batch of short prompts lasts a few hundred cycles, so its gate can change its mind in one."""
BACKOFF = 8
"""At most this many times ``RECHECK`` between probes."""
PROBE = {"plain": 3, "draft": 6}
"""Cycles a probe of each mode runs (drafting varies more from cycle to cycle than plain steps do)."""
MARGIN = 0.02
"""Drafting is chosen only where its tokens per second beat plain steps' by this share."""
CLEAR_LOSS = 0.75
"""A probe of drafting ends after ``SURE`` cycles where its tokens per second are below this share of plain steps':
on a CPU, drafting at B = 8 can run at half the speed of plain steps (docs/BATCHING.md), and in a batch without a
queue a probe's extra cost is not earned back (the last row to finish sets the end)."""
SURE = 1
"""Cycles of a drafting probe before a clear loss ends it: one, since one drafting cycle of 8 rows can cost several
plain cycles."""


@dataclass
class Choice:
    """What the gate knows and does at one B: each mode's measured speed, the mode of the next cycles, and how many
    cycles are left before it reconsiders."""

    mode: str
    """'plain' or 'draft': what the next cycle at this B does."""
    left: int
    """Cycles left in this phase (a probe, or the steady mode)."""
    probing: bool
    """Whether this phase measures ``mode`` to compare it with the other (else the steady mode)."""
    recheck: int = RECHECK
    """Length of the next steady phase."""
    before: str | None = None
    """During a probe, the steady mode it interrupted (the first B's first measurement: plain)."""
    speed: dict[str, Rate] = field(default_factory=lambda: {"plain": Rate(), "draft": Rate()})
    """Tokens per second of the batch's cycles in each mode at this B (moving averages)."""

    @property
    def measured(self) -> bool:
        return all(rate.cycles for rate in self.speed.values())

    def best(self) -> str:
        plain, draft = self.speed["plain"].value, self.speed["draft"].value
        return "draft" if draft > plain * (1 + MARGIN) else "plain"

    def clearly_loses(self) -> bool:
        """Whether this phase is a probe of drafting that has run ``SURE`` cycles far below plain steps' speed."""
        draft, plain = self.speed["draft"], self.speed["plain"]
        return self.probing and self.mode == "draft" and draft.cycles >= SURE and plain.cycles > 0 \
            and draft.value < CLEAR_LOSS * plain.value

    def next_phase(self) -> None:
        """The phase ended: measure a mode this B has not seen, or choose after a probe, or probe after a steady
        phase."""
        unseen = [mode for mode in ("plain", "draft") if not self.speed[mode].cycles]
        if unseen:
            self.mode, self.probing, self.left = unseen[0], True, PROBE[unseen[0]]
        elif self.probing:
            best = self.best()
            kept = best == self.before  # the probe changed nothing: wait twice as long for the next one
            self.recheck = min(self.recheck * 2, RECHECK * BACKOFF) if kept else RECHECK
            self.mode, self.probing, self.left = best, False, self.recheck
        else:
            other = "plain" if self.mode == "draft" else "draft"
            self.speed[other] = Rate()  # judge it on fresh cycles: the drafters and the context have moved on
            self.before, self.mode, self.probing, self.left = self.mode, other, True, PROBE[other]


@dataclass
class BatchGate:
    """Per number of running rows B, whether the batch's next cycle drafts (``drafts``), learned from every cycle
    (``record``)."""

    choices: dict[int, Choice] = field(default_factory=dict)
    """B -> what the gate knows and does at B rows."""

    def choice(self, rows: int) -> Choice:
        """The choice at ``rows`` running rows; a new B starts in the mode its nearest measured B chose, else (the
        first B) timing plain steps, then probing drafting."""
        if rows not in self.choices:
            measured = [b for b, c in self.choices.items() if c.measured]
            if measured:
                near = self.choices[min(measured, key=lambda b: (abs(b - rows), -b))]
                self.choices[rows] = Choice(near.best(), near.recheck, probing=False, recheck=near.recheck)
            else:
                self.choices[rows] = Choice("plain", PROBE["plain"], probing=True, before="plain")
        return self.choices[rows]

    def drafts(self, rows: int) -> bool:
        """Whether the next cycle of ``rows`` running rows asks their drafters for drafts (else plain steps)."""
        return self.choice(rows).mode == "draft"

    def record(self, rows: int, tokens: int, seconds: float, drafted: bool) -> None:
        """A finished cycle of ``rows`` rows: ``tokens`` committed over all rows in ``seconds``."""
        choice = self.choice(rows)
        choice.speed["draft" if drafted else "plain"].add(tokens, seconds)
        choice.left -= 1
        if choice.left <= 0 or choice.clearly_loses():
            choice.next_phase()

    def summary(self) -> dict[int, dict]:
        """Per B: the mode of its next cycle, and the measured tokens per second of plain and drafting cycles
        (0: not measured) with their counts of cycles."""
        return {b: {"mode": c.mode, "plain_tps": round(c.speed["plain"].value, 2),
                    "draft_tps": round(c.speed["draft"].value, 2), "plain_cycles": c.speed["plain"].cycles,
                    "draft_cycles": c.speed["draft"].cycles} for b, c in sorted(self.choices.items())}
