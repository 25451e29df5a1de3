"""Draft and verify times that mean what they say on a GPU.

The engine splits a cycle's time with ``time.perf_counter`` around the drafter's ``propose`` and the verification;
on CUDA both only enqueue work, so the split follows the host, not the device. :class:`StepClock` records CUDA events
around them instead and reads the events once, after the generation (so timing adds no host sync inside it); on a
CPU it uses ``perf_counter``, which is already right there. It cannot split a drafter's own host syncs from its
device work: a draft step that reads the device waits for the verify queued before it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class StepClock:
    """``timed(key, fn)`` wraps ``fn`` so every call's span is recorded under ``key``; ``seconds(key)`` sums them."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self.spans: dict[str, list] = {}

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def timed(self, key: str, fn: Callable) -> Callable:
        spans = self.spans.setdefault(key, [])

        def run(*args, **kwargs):
            start = self._mark()
            try:
                return fn(*args, **kwargs)
            finally:
                spans.append((start, self._mark()))
        return run

    def seconds(self, key: str) -> float:
        """Total seconds under ``key`` (synchronises once on CUDA)."""
        spans = self.spans.get(key, [])
        if self.cuda and spans:
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in spans) / 1000.0
        return sum(b - a for a, b in spans)


def timed_generate(engine, prompt_ids, config, generator: torch.Generator | None = None):
    """``engine.generate`` as ``(result, verified)``: the stats' ``draft_time`` and ``verify_time`` from a
    :class:`StepClock` on CUDA (the drafter's ``propose``, and the rest of each ``step``; on a CPU the engine's own
    times are kept), and ``verified``, the verification's argmax for every output token (greedy; the emitted tokens
    when sampling), which ``exactness.DivergenceJudge.classify`` takes."""
    clock = StepClock(engine.runner.device)
    outcomes = []
    step = engine.step

    def recorded(gen):
        outcome = step(gen)
        outcomes.append(outcome)
        return outcome
    if clock.cuda:
        engine.drafter.propose = clock.timed("draft", engine.drafter.propose)  # instance attributes, removed below
    engine.step = clock.timed("step", recorded)
    try:
        result = engine.generate(prompt_ids, config, generator)
    finally:
        del engine.step
        if clock.cuda:
            del engine.drafter.propose
    if clock.cuda:
        draft = clock.seconds("draft")
        result.stats.draft_time = draft
        result.stats.verify_time = clock.seconds("step") - draft - result.stats.update_time  # update: host, approx.
    return result, verified_tokens(result.tokens, outcomes)


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
    outcomes: dict[int, list] = {}  # id of a row's stats (the result keeps the same object) -> its outcomes
    step = engine.step

    def recorded(rows):
        found = step(rows)
        for (_, gen), outcome in zip(rows, found, strict=True):
            outcomes.setdefault(id(gen.stats), []).append(outcome)
        return found
    engine.step = recorded
    try:
        t0 = time.perf_counter()
        results = engine.generate(prompts, config)
        wall = time.perf_counter() - t0
    finally:
        del engine.step
    return results, [verified_tokens(r.tokens, outcomes.get(id(r.stats), [])) for r in results], wall
