"""Whether a generation's drafting paid: what plain decoding would have cost, estimated from the run's own statistics.

A drafter whose drafts the target mostly rejects (an exit that was never trained to draft) is slower than plain
decoding, and nothing else in a generation's output says so. The draft-verify cost model (``infer.model.plan``:
a cycle of k̄ draft forwards of cost c and one verification of cost v, in plain-step units, produces M tokens)
needs the time of one plain step, which the run gives without running plain decoding again: where the adaptive
gate timed plain steps itself (``infer.drafters.gate``: a drafter's ``tps_plain``), its measured rate; otherwise
the run's verification time per verification, since verifying T >= 1 tokens costs at least one plain step
(``weights_cost``'s v(T) = 1: every weight is read once either way). That step makes the estimate of plain decoding
its largest, so a verdict of 'slower' holds for any v(T) above one step. Drafting counts as measurably slower below
``FallbackGate.HOPELESS``, the gate's own bar for a drafter not worth probing, over at least ``MIN_VERIFICATIONS``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from infer.decode.engine import GenerationStats
from infer.drafters.gate import FallbackGate
from infer.model.plan import cycle_speedup

MIN_VERIFICATIONS = 8
"""Fewer verifications than this (over the generations judged together) are too few to judge."""
SLOWER = FallbackGate.HOPELESS
"""An estimated speed-up below this is reported as slower than plain decoding."""


@dataclass(frozen=True)
class Verdict:
    """Drafting's estimated speed-up over plain decoding for some generations, and what it rests on."""

    speedup: float
    """Estimated tokens/s of the drafting run over plain decoding's (the cost model's M / (k̄·c + v))."""
    verifications: int
    """Verifications (draft-verify cycles, plain steps included) over the generations."""
    drafted: int
    """Draft tokens proposed."""
    accepted: int
    """Draft tokens accepted."""
    draft_share: float
    """Share of the decoding time spent drafting."""
    step_source: str
    """Where a plain step's time came from: 'the gate's timed plain steps' or 'this run's verifications'."""

    @property
    def slower(self) -> bool:
        """Measurably slower than plain decoding (``SLOWER``)."""
        return self.speedup < SLOWER

    def describe(self) -> str:
        """``about 0.31x plain decoding (estimated from 40 verifications: 4 of 200 drafted tokens accepted, ...)``."""
        return (f"about {self.speedup:.2f}x plain decoding (estimated from this run's {self.verifications} "
                f"verifications: {self.accepted} of {self.drafted} drafted tokens accepted, drafting "
                f"{self.draft_share:.0%} of the time; a plain step timed from {self.step_source})")


def plain_step(stats: Sequence[GenerationStats]) -> tuple[float, str] | None:
    """(seconds of one plain step, where it came from) for ``stats``; None when nothing was verified."""
    timed = [s.drafter.tps_plain for s in stats if (getattr(s.drafter, "tps_plain", None) or 0) > 0]
    if timed:
        return len(timed) / sum(timed), "the gate's timed plain steps"
    calls = sum(s.verify_calls for s in stats)
    verify = sum(s.verify_time for s in stats)
    return (verify / calls, "this run's verifications") if calls and verify > 0 else None


def judge(stats: Sequence[GenerationStats]) -> Verdict | None:
    """The verdict on generations decoded one at a time (``stats``); None when they drafted nothing, verified too
    few times to judge, or carry no timings."""
    calls = sum(s.verify_calls for s in stats)
    drafted = sum(s.drafted for s in stats)
    forwards = sum(getattr(s.drafter, "draft_forwards", 0) for s in stats)
    step = plain_step(stats)
    if not drafted or calls < MIN_VERIFICATIONS or step is None:
        return None
    seconds, source = step
    draft = sum(s.draft_time + s.update_time for s in stats)
    verify = sum(s.verify_time for s in stats)
    tokens = sum(max(s.new_tokens - 1, 0) for s in stats)  # the first token comes from the prefill either way
    per_cycle = forwards / calls if forwards else 1.0  # a drafter that counts no forwards: its drafting per cycle
    c = draft / (forwards or calls) / seconds
    speedup = cycle_speedup(tokens / calls, per_cycle, c, verify / calls / seconds)
    return Verdict(speedup, calls, drafted, sum(s.accepted for s in stats),
                   draft / (draft + verify) if draft + verify > 0 else 0.0, source)
