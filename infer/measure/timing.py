"""Draft and verify times that mean what they say on a GPU.

The engine splits a cycle's time with ``time.perf_counter`` around the drafters' proposals and the verification;
on CUDA both only enqueue work, so the split follows the host, not the device. :class:`StepClock`, a cycle observer
(``infer.decode.cycle``: attached to the engine, nothing patched), records CUDA events at the cycle's points instead and
reads them once, after the generation (so timing adds no host sync inside it); on a CPU it uses ``perf_counter``,
which is already right there. It cannot split a drafter's own host syncs from its
device work: a draft step that reads the device waits for the verify queued before it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from infer.decode.cycle import CycleObserver


class StepClock(CycleObserver):
    """A cycle observer that records each cycle's draft and verification spans (CUDA events on a GPU, read once
    after the generation; ``perf_counter`` on a CPU) and keeps every row's verification outcomes."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self.spans: dict[str, list] = {"draft": [], "verify": []}
        self.outcomes: dict[int, list] = {}
        """id of a row's stats (the result keeps the same object) -> its outcomes, cycle by cycle."""
        self._marks: list = []

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self, rows) -> None:
        self._marks = [self._mark()]

    def drafted(self, rows, drafts) -> None:
        self._marks.append(self._mark())

    def verified(self, rows, outcomes) -> None:
        start, drafted, done = *self._marks, self._mark()
        self.spans["draft"].append((start, drafted))
        self.spans["verify"].append((drafted, done))
        for (_, gen), outcome in zip(rows, outcomes, strict=True):
            self.outcomes.setdefault(id(gen.stats), []).append(outcome)

    def seconds(self, key: str) -> float:
        """Total seconds under ``key`` ('draft' or 'verify'; synchronises once on CUDA)."""
        spans = self.spans.get(key, [])
        if self.cuda and spans:
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in spans) / 1000.0
        return sum(b - a for a, b in spans)


@contextmanager
def observing(engine, observer: CycleObserver):
    """``observer`` attached to ``engine`` (an ``Engine`` or ``BatchEngine``) inside the block."""
    engine.observers.append(observer)
    try:
        yield observer
    finally:
        engine.observers.remove(observer)


def timed_generate(engine, prompt_ids, config, generator: torch.Generator | None = None):
    """``engine.generate`` as ``(result, verified)``: the stats' ``draft_time`` and ``verify_time`` from a
    :class:`StepClock` on CUDA (on a CPU the engine's own times are kept), and ``verified``, the verification's argmax
    for every output token (greedy; the emitted tokens when sampling), which ``exactness.DivergenceJudge.classify``
    takes."""
    with observing(engine, StepClock(engine.runner.device)) as clock:
        result = engine.generate(prompt_ids, config, generator)
    if clock.cuda:
        result.stats.draft_time = clock.seconds("draft")
        result.stats.verify_time = clock.seconds("verify")
    return result, verified_tokens(result.tokens, clock.outcomes.get(id(result.stats), []))


def verified_tokens(tokens: list[int], outcomes: list) -> list[int]:
    """The verification's argmax for every output token of one generation (greedy; the emitted tokens when
    sampling): the prefill's first token, then each cycle's ``VerifyOutcome`` along its accepted path."""
    verified = tokens[:1] + [t for o in outcomes
                             for t in ([o.target_argmax[p] for p in o.path] if o.target_argmax else o.tokens)]
    return verified[:len(tokens)]


def timed_batch(engine, prompts, config) -> tuple[list, list[list[int]], float]:
    """``BatchEngine.generate`` of ``prompts`` as ``(results, verified, wall seconds)``: ``verified`` per prompt as
    ``timed_generate`` gives it for one (each row's outcomes of every batched cycle), the wall time of the whole
    batch (the results are host lists: the device has finished when the clock stops)."""
    with observing(engine, StepClock(engine.runner.device)) as clock:
        t0 = time.perf_counter()
        results = engine.generate(prompts, config)
        wall = time.perf_counter() - t0
    return results, [verified_tokens(r.tokens, clock.outcomes.get(id(r.stats), [])) for r in results], wall
