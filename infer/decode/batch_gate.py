"""One never-slower gate for a batch: per B, plain steps or drafts of at most k tokens for every row, from a cost
model fitted to the batch's own cycles and checked against their measured speed.

At B rows a plain cycle already shares one weight stream among B tokens; a drafting cycle of k drafts verifies up to
B (k + 1) rows, arithmetic that a plain cycle does not pay: on a CPU core a 20-row verification costs about 1.5 plain
8-row cycles (docs/BATCHING.md). So whether drafting pays, and how far, depends on B: the draft length that pays
shrinks as B grows (Su et al. 2023, "The Synergy of Speculative Decoding and Batching"; Liu et al. 2024, SmartSpec),
and a row's own gate cannot tell: it times the batch's cycle, and its memory is keyed without B. So a
``BatchEngine`` whose drafters are adaptive takes their gates over (``Drafter.hand_over_gate``) and decides for every
row at once, per number of running rows, and caps every row's draft at k tokens (``DecodeState.draft_cap``).

What it fits, from every cycle (prefill excluded: a joining row's prefill runs between cycles):
- the seconds of a cycle's verification (and the rows' bookkeeping) as a line in the rows it verifies,
  a + b T (plain cycles give T = B, drafting cycles T = the drafted tokens plus B);
- one draft forward's seconds at B rows (the draft phase over its longest chain);
- the per-token acceptance a of the rows' chains (accepted over tested positions, the i.i.d. estimate),
and predicts tokens per second at cap k: B M(a, k) / (k d + a + b B (k + 1)) with M(a, k) = (1 - a^(k+1)) / (1 - a)
(Leviathan et al. 2023), against B / (a + b B) for plain steps; with no prompt waiting, M is the slowest row's
advance over the tokens it has left (``slowest_row_tokens``: the batch ends with that row).

Per B: a steady mode, and now and then a probe of the other (ended at once where no row drafts: their drafters' own cost
models declined, as dynamic exit's do where its exits do not pay); a probe that does not change the choice doubles the
time to the next one (up to ``BACKOFF`` times). The first B times plain steps first, then scouts: one drafting cycle at
k = 1, which costs about what it gains (measured at B = 8: two plain cycles' time for 1.7-1.9 tokens a row, where the
drafters' own k = 6 cost five), and gives the fit its second point and the acceptance. Where the model then finds no k
that beats plain steps by ``MARGIN`` the probe ends there; else drafting runs at the best k, measured, and is kept only
where its measured speed beats plain steps'. While it drafts, k follows the model each cycle. A B seen for the first
time starts from the model's prediction (else from its nearest measured B), without a probe: a batch without a queue
ends in a tail of rows finishing one by one, a few cycles at each B.

Progress is the tokens every row committed while prompts wait for a slot (a row that finishes early makes room for
the next); with none waiting it is B times the advance of the least-advanced row: the batch ends when its slowest row
does. Output is unchanged either way: a plain step is a verification of nothing, a capped draft a shorter one.

What the gate learned is kept for the next command beside the drafters' own memory (``BatchGate.memory``, their
``remember`` option): a remembered B starts in the mode and at the cap it ended in, without a probe, which is where a
probe costs most (at B = 8 the first draft fills the rows' copied prefixes and the scouts verify twice the rows).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

from infer.decode.cycle import CycleObserver
from infer.drafters.base import VerifyOutcome
from infer.drafters.gate import COLD, GateMemory, Rate, check_rate
from infer.model.plan import iid_tokens_per_cycle
from layerskip_core import jsonfile

RECHECK = 32
"""Cycles in the chosen mode before the other one is probed again at the same B (doubling after each probe that did
not change the choice): a batch of short prompts lasts a few hundred cycles, so its gate can change its mind in one."""
BACKOFF = 8
"""At most this many times ``RECHECK`` between probes."""
PROBE = {"plain": 3, "draft": 6}
"""Cycles a probe of each mode runs (drafting varies more from cycle to cycle than plain steps do), the scout's
included."""
SCOUT = 2
"""Drafting cycles at k = 1 that open a probe of drafting: they give the cost model what it predicts with (two: the
first draft of a command can pay for touching its weights, 0.1 s against 0.02 s measured at B = 4)."""
MARGIN = 0.02
"""Drafting is chosen only where its tokens per second (measured, or predicted at the best k) beat plain steps' by
this share."""
CLEAR_LOSS = 0.75
"""Without a cost model (cycles recorded without their detail): a probe of drafting ends after ``SURE`` cycles where
its tokens per second are below this share of plain steps'."""
SURE = 1
"""Cycles of a drafting probe before a clear loss ends it."""
MOST_DRAFTS = 8
"""The largest cap the model considers (a drafter drafts no more than its own k whatever the cap)."""
RECENT = 4
"""Drafting cycles at one B whose fastest draft forward prices the next (a shared machine's noise only adds time)."""
DECAY = 0.9
"""Weight an older cycle keeps in the fits at each new one: the costs move with the context, the acceptance with the
text."""


@dataclass(frozen=True)
class CycleDetail:
    """What one cycle of the batch showed the cost model (``detail_of``)."""

    draft_seconds: float
    """The draft phase (every row's drafter proposing; a plain cycle's near nothing)."""
    rest_seconds: float
    """The verification and the rows taking their tokens."""
    verified: int
    """Tokens verified over every row: each row's drafted tokens plus its pending one."""
    chain: int
    """The longest drafted chain (draft forwards the phase ran; 0: a plain cycle)."""
    accepted: int
    """Drafted tokens accepted over every row (along each row's chain)."""
    tested: int
    """Drafted positions tested over every row: the accepted ones and each chain's first rejected one."""
    cold: bool = False
    """The first cycle after a prefill (the prompts' forward left the caches cold: 0.09 s against 0.07 measured at
    B = 8): its verification is left out of the line, which it would raise at its B."""


def chain_length(outcome: VerifyOutcome) -> int:
    """Drafted tokens on the chain of ``outcome``'s draft (a tree's siblings hang off it)."""
    draft = outcome.draft
    if draft is None or draft.parents is None:
        return outcome.drafted
    return next((j for j, parent in enumerate(draft.parents) if parent != j), len(draft.parents))


def detail_of(outcomes: Sequence[VerifyOutcome], draft_seconds: float, rest_seconds: float,
              cold: bool = False) -> CycleDetail:
    """A cycle's detail from its outcomes and its two phases' seconds (``cold``: the first after a prefill)."""
    chains = [chain_length(o) for o in outcomes]
    accepted = [min(o.accepted, m) for o, m in zip(outcomes, chains, strict=True)]
    tested = sum(a + (a < m) for a, m in zip(accepted, chains, strict=True))
    return CycleDetail(draft_seconds, rest_seconds, sum(o.drafted + 1 for o in outcomes), max(chains, default=0),
                       sum(accepted), tested, cold)


def slowest_row_tokens(acceptance: float, k: int, rows: int, horizon: int | None) -> float:
    """Tokens per cycle of the slowest of ``rows`` rows over the ``horizon`` tokens each has left, drafting at most k
    tokens a cycle with i.i.d. per-token acceptance a; without a horizon (a queue refills the rows) the mean,
    M(a, k). A row's advance over n cycles is a sum of n i.i.d. advances (mean M, variance s^2: about normal), and the
    slowest of B such rows falls about z_B s sqrt(n) short of n M (z_B: Blom's estimate of the largest of B standard
    normals, 1.03 at B = 4, 1.43 at B = 8); the batch ends when its slowest row does. At a = 0.63, k = 1, B = 8 and
    61 tokens left: 1.52 against M = 1.63."""
    mean = iid_tokens_per_cycle(acceptance, k)
    if horizon is None or horizon <= 0 or rows < 2:
        return mean
    accepted = mean - 1  # E[Y], Y the accepted drafts: P(Y >= j) = a^j for j <= k
    variance = max(sum((2 * j - 1) * acceptance ** j for j in range(1, k + 1)) - accepted ** 2, 0.0)
    z = NormalDist().inv_cdf((rows - 0.375) / (rows + 0.25))
    cycles = horizon / mean
    return horizon / (cycles + z * math.sqrt(variance * cycles) / mean)


@dataclass
class Line:
    """seconds = a + b x, least squares over the points seen, each older one weighing ``DECAY`` times less."""

    sums: list[float] = field(default_factory=lambda: [0.0] * 5)
    """Decayed sums of 1, x, y, x^2, x y."""

    def add(self, x: float, y: float) -> None:
        self.sums = [DECAY * s + v for s, v in zip(self.sums, (1.0, x, y, x * x, x * y), strict=True)]

    def at(self, x: float) -> float | None:
        """The line at ``x``; None until points at two different x (a slope below 0, noise, is taken as 0)."""
        w, sx, sy, sxx, sxy = self.sums
        if w == 0:
            return None
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var < 1e-6 * max(mx * mx, 1.0):
            return None
        slope = max((sxy / w - mx * my) / var, 0.0)
        return my + slope * (x - mx)


@dataclass
class CostFit:
    """The batch's cost model (the module docstring): verification line, draft forwards per B, acceptance."""

    verify: Line = field(default_factory=Line)
    """Seconds of a cycle's verification and bookkeeping against the tokens it verified."""
    draft: dict[int, deque] = field(default_factory=dict)
    """B -> seconds of one draft forward over B rows in the last ``RECENT`` drafting cycles at B."""
    acceptance: list[float] = field(default_factory=lambda: [0.0, 0.0])
    """Decayed accepted and tested positions."""

    def add(self, rows: int, d: CycleDetail) -> None:
        if not d.cold:
            self.verify.add(d.verified, d.rest_seconds)
        if d.chain:
            self.draft.setdefault(rows, deque(maxlen=RECENT)).append(d.draft_seconds / d.chain)
        if d.tested:
            self.acceptance = [DECAY * self.acceptance[0] + d.accepted, DECAY * self.acceptance[1] + d.tested]

    def draft_seconds(self, rows: int) -> float | None:
        """One draft forward over ``rows`` rows: measured at that B, else at the nearest B measured."""
        if not self.draft:
            return None
        return min(self.draft[min(self.draft, key=lambda b: (abs(b - rows), -b))])

    def best(self, rows: int, horizon: int | None = None) -> tuple[int, float] | None:
        """The cap k (0: plain steps) with the most predicted tokens per second at ``rows`` rows, and its ratio to
        plain steps'; None until the model can predict. ``horizon``: tokens the slowest row has left where no prompt
        waits (the batch ends with it: ``slowest_row_tokens``), None with a queue."""
        plain, draft = self.verify.at(rows), self.draft_seconds(rows)
        accepted, tested = self.acceptance
        if plain is None or draft is None or tested < 1 or plain <= 0:
            return None
        a = accepted / tested
        best_k, best = 0, 1.0
        for k in range(1, MOST_DRAFTS + 1):
            seconds = k * draft + self.verify.at(rows * (k + 1))
            ratio = slowest_row_tokens(a, k, rows, horizon) * plain / seconds
            if ratio > best:
                best_k, best = k, ratio
        return (best_k, best) if best > 1 + MARGIN else (0, best)


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
    cap: int | None = None
    """Most tokens a row drafts in the next drafting cycle (None: each drafter's own)."""
    scouting: int = 0
    """Scout cycles (k = 1) left before the model chooses this probe's k."""
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

    def start_probe(self, mode: str) -> None:
        self.mode, self.probing, self.left = mode, True, PROBE[mode]
        self.scouting = SCOUT if mode == "draft" else 0
        if self.scouting:
            self.cap = 1

    def settle(self, mode: str) -> None:
        """A probe ended: ``mode`` is kept, and the next probe waits twice as long where it changed nothing."""
        kept = mode == self.before
        self.recheck = min(self.recheck * 2, RECHECK * BACKOFF) if kept else RECHECK
        self.mode, self.probing, self.left, self.scouting = mode, False, self.recheck, 0

    def next_phase(self) -> None:
        """The phase ended: measure a mode this B has not seen, or choose after a probe, or probe after a steady
        phase."""
        unseen = [mode for mode in ("plain", "draft") if not self.speed[mode].cycles]
        if unseen:
            self.start_probe(unseen[0])
        elif self.probing:
            self.settle(self.best())
        else:
            other = "plain" if self.mode == "draft" else "draft"
            self.speed[other] = Rate()  # judge it on fresh cycles: the drafters and the context have moved on
            self.before = self.mode
            self.start_probe(other)

    def follow(self, model: tuple[int, float] | None) -> None:
        """After a drafting cycle: the cap the model predicts best; a probe whose scout finds nothing that pays ends,
        and so does a steady drafting phase the model no longer expects to pay. Without a model (nothing drafted
        to learn from yet) the drafters' own k is measured after the scout."""
        if self.mode != "draft":
            return
        if self.scouting:
            self.scouting -= 1
            if self.scouting:
                return
            if model is None:
                self.cap = None
        if model is None:
            return
        if model[0]:
            self.cap = model[0]
            return
        if not self.probing:
            self.before = "draft"  # a steady drafting phase ends: a change, not a probe that found nothing
        self.settle("plain")


@dataclass
class BatchGate:
    """Per number of running rows B, whether the batch's next cycle drafts (``drafts``) and at most how far
    (``cap``), learned from every cycle (``record``), and kept for the next command in ``memory`` (``save``)."""

    choices: dict[int, Choice] = field(default_factory=dict)
    """B -> what the gate knows and does at B rows."""
    fit: CostFit = field(default_factory=CostFit)
    """The cost model of the batch's cycles (every B together)."""
    horizon: int | None = None
    """Tokens the slowest running row has left when no prompt waits for a slot (the batch ends with that row: the
    model then weighs drafting by the slowest row's advance, ``slowest_row_tokens``); None while prompts wait. The
    engine sets it before each cycle."""
    memory: GateMemory | None = None
    """Where what the gate learned is kept across commands (beside the drafters' own memory, keyed as it is by model,
    device, dtype, threads and drafter settings): a B it remembers starts in the mode and at the cap it ended in,
    without a probe, and the cost model starts from the remembered fit. None: remember off."""

    def __post_init__(self) -> None:
        if self.memory is None:
            return
        try:
            saved = self.memory.load()
            if saved is not None:
                self.restore(saved["batch"])
        except (KeyError, TypeError, ValueError):  # checked on load; anything else unreadable: start afresh
            self.choices, self.fit = {}, CostFit()

    @property
    def start_state(self) -> str:
        """What the gate started from: ``cold``, or ``warm from <file>``."""
        return COLD if self.memory is None else self.memory.start_state

    def save(self) -> None:
        """Keep what the gate learned for the next command (nothing without a memory, or a read-only one)."""
        if self.memory is not None and self.choices:
            self.memory.save({"batch": self.to_dict()})

    def to_dict(self) -> dict:
        choices = {str(b): {"mode": c.mode, "cap": c.cap, "recheck": c.recheck, "plain": c.speed["plain"].to_dict(),
                            "draft": c.speed["draft"].to_dict()} for b, c in self.choices.items() if c.measured}
        fit = self.fit
        return {"choices": choices, "fit": {"verify": fit.verify.sums, "acceptance": fit.acceptance,
                                            "draft": {str(b): list(d) for b, d in fit.draft.items()}}}

    def restore(self, d: dict) -> None:
        """Continue from ``to_dict``'s state (checked by ``check_batch_memory``): each remembered B in the mode and at
        the cap it ended in, for its recheck interval before the next probe."""
        for b, c in d["choices"].items():
            choice = Choice(c["mode"], int(c["recheck"]), probing=False, recheck=int(c["recheck"]), cap=c["cap"])
            choice.speed["plain"].load(c["plain"])
            choice.speed["draft"].load(c["draft"])
            self.choices[int(b)] = choice
        fit = d["fit"]
        self.fit.verify.sums = [float(x) for x in fit["verify"]]
        self.fit.acceptance = [float(x) for x in fit["acceptance"]]
        self.fit.draft = {int(b): deque((float(x) for x in v), maxlen=RECENT) for b, v in fit["draft"].items()}

    def choice(self, rows: int) -> Choice:
        """The choice at ``rows`` running rows; a new B starts where the model predicts (else in the mode its
        nearest measured B chose), else (the first B) timing plain steps, then probing drafting."""
        if rows not in self.choices:
            measured = [b for b, c in self.choices.items() if c.measured]
            model = self.fit.best(rows, self.horizon) if measured else None
            if model is not None:
                mode = "draft" if model[0] else "plain"
                self.choices[rows] = Choice(mode, RECHECK, probing=False, cap=model[0] or None)
            elif measured:
                near = self.choices[min(measured, key=lambda b: (abs(b - rows), -b))]
                self.choices[rows] = Choice(near.best(), near.recheck, probing=False, recheck=near.recheck,
                                            cap=near.cap)
            else:
                self.choices[rows] = Choice("plain", PROBE["plain"], probing=True, before="plain")
        return self.choices[rows]

    def drafts(self, rows: int) -> bool:
        """Whether the next cycle of ``rows`` running rows asks their drafters for drafts (else plain steps)."""
        return self.choice(rows).mode == "draft"

    def cap(self, rows: int) -> int | None:
        """Most tokens each row drafts in the next cycle of ``rows`` rows (None: its drafter's own)."""
        return self.choice(rows).cap

    def record(self, rows: int, tokens: int, seconds: float, drafted: bool, detail: CycleDetail | None = None) -> None:
        """A finished cycle of ``rows`` rows: ``tokens`` of progress in ``seconds``; ``detail``: what the cost
        model learns from it (None: the gate compares measured speeds only)."""
        choice = self.choice(rows)
        choice.speed["draft" if drafted else "plain"].add(tokens, seconds)
        choice.left -= 1
        if detail is not None:
            self.fit.add(rows, detail)
        if drafted and detail is not None and not detail.chain and choice.probing:
            choice.settle("plain")  # no row drafted: their drafters' own cost models declined at this B
            return
        if drafted:
            choice.follow(None if detail is None else self.fit.best(rows, self.horizon))
            if choice.mode == "plain":  # the model ended the drafting phase
                return
        if choice.left <= 0 or (detail is None and choice.clearly_loses()):
            choice.next_phase()

    def summary(self) -> dict[int, dict]:
        """Per B: the mode of its next cycle and its cap, and the measured tokens per second of plain and drafting
        cycles (0: not measured) with their counts of cycles."""
        return {b: {"mode": c.mode, "cap": c.cap, "plain_tps": round(c.speed["plain"].value, 2),
                    "draft_tps": round(c.speed["draft"].value, 2), "plain_cycles": c.speed["plain"].cycles,
                    "draft_cycles": c.speed["draft"].cycles} for b, c in sorted(self.choices.items())}


def check_batch_memory(d: dict, num_layers: int | None = None) -> None:
    """ValueError or KeyError unless ``d`` holds what ``BatchGate.save`` keeps, all plausible (``GateMemory.load``
    then reports the file in one line and the gate starts afresh)."""
    batch = jsonfile.obj(d["batch"], "'batch'")
    for b, c in jsonfile.obj(batch["choices"], "batch.choices").items():
        jsonfile.integer(int(b) if b.isdigit() else b, "a batch size", 1)
        c = jsonfile.obj(c, f"batch.choices.{b}")
        if c.get("mode") not in ("plain", "draft"):
            raise ValueError(f"batch.choices.{b}.mode is {c.get('mode')!r}, expected 'plain' or 'draft'")
        if c["cap"] is not None:
            jsonfile.integer(c["cap"], f"batch.choices.{b}.cap", 1, MOST_DRAFTS)
        jsonfile.integer(c["recheck"], f"batch.choices.{b}.recheck", 1, RECHECK * BACKOFF)
        check_rate(c["plain"], f"batch.choices.{b}.plain")
        check_rate(c["draft"], f"batch.choices.{b}.draft")
    fit = jsonfile.obj(batch["fit"], "batch.fit")
    if not isinstance(fit["verify"], list) or len(fit["verify"]) != 5:
        raise ValueError("batch.fit.verify must be a list of 5 numbers")
    for j, x in enumerate(fit["verify"]):
        jsonfile.number(x, f"batch.fit.verify[{j}]", -1e12, 1e12)
    if not isinstance(fit["acceptance"], list) or len(fit["acceptance"]) != 2:
        raise ValueError("batch.fit.acceptance must be a list of 2 numbers")
    tested = jsonfile.number(fit["acceptance"][1], "batch.fit.acceptance[1]", 0, 1e9)
    jsonfile.number(fit["acceptance"][0], "batch.fit.acceptance[0]", 0, tested)
    for b, seconds in jsonfile.obj(fit["draft"], "batch.fit.draft").items():
        jsonfile.integer(int(b) if b.isdigit() else b, "a batch size", 1)
        if not isinstance(seconds, list) or not 0 < len(seconds) <= RECENT:
            raise ValueError(f"batch.fit.draft.{b} must be a list of 1 to {RECENT} numbers")
        for x in seconds:
            jsonfile.number(x, f"batch.fit.draft.{b}", 0, 1e3)


class CycleClock(CycleObserver):
    """Times a cycle's draft phase and the rest (the verification and the rows taking their tokens)."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def begin(self, rows) -> None:
        self.marks = [time.perf_counter()]

    def drafted(self, rows, drafts) -> None:
        self.marks.append(time.perf_counter())

    def advanced(self, rows, outcomes) -> None:
        self.marks.append(time.perf_counter())

    def detail(self, outcomes: Sequence[VerifyOutcome], cold: bool = False) -> CycleDetail:
        start, drafted, done = self.marks
        return detail_of(outcomes, drafted - start, done - drafted, cold)
