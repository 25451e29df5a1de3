"""The decode cycle, once, for 1..B rows: every row's drafter proposes, one packed forward verifies every row, each row
takes its accepted tokens; observers see each cycle's three points without patching anything.

``Engine.step`` runs it over one row, ``BatchEngine.step`` over the batch's running rows, and the transformers entry
(``infer.hf.rows``) over the rows that still need tokens. A row is an engine (its drafter, its stop rules) and the
generation it is advancing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from infer.decode.verify import VerifyRow, verify_rows
from infer.drafters.base import Draft, VerifyOutcome

Row = tuple
"""(engine, generation): an ``infer.decode.engine.Engine`` (its drafter, its stop rules, ``advance``) and the
``Generation`` it is advancing. Named, not imported: the engine builds on this module."""


class CycleObserver:
    """What a measuring tool attaches to an engine's ``observers``: called at the three points of every cycle (on a
    GPU the work is only enqueued there, so a clock records device events, see ``infer.measure.timing``)."""

    def begin(self, rows: Sequence[Row]) -> None:
        """Before the drafters propose."""

    def drafted(self, rows: Sequence[Row], drafts: list[Draft | None]) -> None:
        """After every row's draft, before the verification."""

    def verified(self, rows: Sequence[Row], outcomes: list[VerifyOutcome]) -> None:
        """After the verification, before the rows take their tokens."""

    def advanced(self, rows: Sequence[Row], outcomes: list[VerifyOutcome]) -> None:
        """After every row took its tokens and its drafter's ``update`` ran."""


@torch.no_grad()
def step_rows(rows: Sequence[Row], observers: Sequence[CycleObserver] = (), plain: bool = False) -> list[VerifyOutcome]:
    """One cycle over running rows: every row's drafter proposes (batched per drafter class), one forward verifies
    every row, each row takes its accepted tokens. The rows' timings are the cycle's. ``plain``: a plain step for
    every row, no drafter asked for a draft (``Drafter.skip``; a batch's gate chose it)."""
    for _, gen in rows:
        if gen.done:
            raise ValueError(f"the generation has finished ({gen.finish_reason})")
        gen.state.budget = gen.config.max_new_tokens - len(gen.tokens)
    for o in observers:
        o.begin(rows)
    t0 = time.perf_counter()
    drafts = [engine.drafter.skip(gen.state) for engine, gen in rows] if plain else propose(rows)
    t1 = time.perf_counter()
    for o in observers:
        o.drafted(rows, drafts)
    outcomes = verify_rows([VerifyRow.of(gen.state, draft, gen.processor)
                            for (engine, gen), draft in zip(rows, drafts, strict=True)])
    t2 = time.perf_counter()
    for o in observers:
        o.verified(rows, outcomes)
    for (engine, gen), outcome in zip(rows, outcomes, strict=True):
        engine.advance(gen, outcome, t1 - t0, t2 - t1)
    for o in observers:
        o.advanced(rows, outcomes)
    return outcomes


def propose(rows: Sequence[Row]) -> list[Draft | None]:
    """Every row's draft (or None): several rows grouped by drafter class, each group through the class's
    ``propose_rows`` (packed draft forwards where the drafter has them); one row through its drafter's ``propose``
    (for a drafter that batches, ``propose_rows`` of that one row)."""
    if len(rows) == 1:
        engine, gen = rows[0]
        return [engine.drafter.propose(gen.state)]
    drafts: list[Draft | None] = [None] * len(rows)
    groups: dict[type, list[int]] = {}
    for j, (engine, _) in enumerate(rows):
        groups.setdefault(type(engine.drafter), []).append(j)
    for kind, members in groups.items():
        out = kind.propose_rows([(rows[j][0].drafter, rows[j][1].state) for j in members])
        for j, draft in zip(members, out, strict=True):
            drafts[j] = draft
    return drafts
