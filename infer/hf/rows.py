"""The rows of a transformers batch, decoded so that every stopping criterion and logits processor sees what plain
``generate`` shows it.

Each row decodes with its own engine (a draft-verify step commits several tokens at once), and the rows that need
tokens step together, one batched cycle (``infer.decode.cycle.step_rows``: one packed verification forward for the rows,
their drafts drafted together); ``lockstep`` then hands
the committed tokens to the stopping criteria one column at a time, as a (B, length) batch, exactly as
``generate``'s loop calls them: criteria that keep state across calls or answer for the whole batch (an evaluation
harness's stop sequences) behave as they do there, and every row stops where plain ``generate`` stops it. Finished
rows are padded when the criteria include an end-of-sequence stop (as ``generate`` pads), and keep decoding
otherwise. ``RowProcessor`` applies the logits processors to one row at any verified position, on a batch of the
row's own shape, so processors configured per row (a repetition penalty that skips each row's padding) read the
row's own settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from infer.decode.cycle import step_rows
from infer.decode.engine import Engine, Generation, GenerationResult


class RowProcessor:
    """transformers' ``LogitsProcessorList`` for row ``row`` of a ``batch``-row input whose left padding is
    ``padding``: an ``infer.decode.processing.PositionProcessor``."""

    def __init__(self, processors, row: int, batch: int, padding: Sequence[int]):
        self.processors, self.row, self.batch, self.padding = processors, row, batch, list(padding)

    def __call__(self, committed: Sequence[int], suffixes: list[list[int]], logits: Tensor) -> Tensor:
        out = []
        for i, suffix in enumerate(suffixes):
            ids = torch.tensor([*self.padding, *committed, *suffix], device=logits.device)  # (n,)
            ids = ids[None].repeat(self.batch, 1)  # (B, n): this row's prefix in every row, read back at `row`
            scores = logits[i:i + 1].float().repeat(self.batch, 1)  # (B, V) fp32, as generate processes
            out.append(self.processors(ids, scores)[self.row])  # (V,)
        return torch.stack(out)  # (T, V)


@dataclass
class RowRun:
    """One row: its engine, its generation, and how many of its tokens went into the output."""

    engine: Engine
    gen: Generation
    used: int = 0
    """Tokens of this row in the output so far (its finished length once ``finished``)."""
    finished: bool = False
    """The stopping criteria ended this row."""
    result: GenerationResult | None = None

    def token(self, t: int) -> int:
        """The row's t-th generated token, stepping the engine until it is committed."""
        fill([self], t)
        self.used = t + 1
        return self.gen.tokens[t]

    def close(self) -> GenerationResult:
        """Finish the generation at the tokens the output holds (its cache goes back to the runner's pool)."""
        if self.result is None:
            if not self.gen.done:
                self.gen.finish_reason = "criterion"
            del self.gen.tokens[self.used:]
            self.result = self.engine.finish(self.gen)
        return self.result


def fill(rows: list[RowRun], t: int) -> None:
    """Step every row that has not committed its t-th token yet, all of them together in one batched cycle
    (``infer.decode.cycle.step_rows``: one packed verification forward), until each has."""
    while short := [row for row in rows if len(row.gen.tokens) <= t]:
        for row in short:
            if row.gen.done:
                raise RuntimeError(f"the engine stopped a row after {len(row.gen.tokens)} tokens "
                                   f"({row.gen.finish_reason}) before the stopping criteria did")
        step_rows([(row.engine, row.gen) for row in short])


def lockstep(rows: list[RowRun], input_ids: Tensor, criteria, pad: int, limit: int, streamer=None) -> Tensor:
    """(B, P + new) sequences: the rows' tokens column by column until the criteria end every row (or ``limit`` new
    tokens); a one-row batch streams each token as it is committed."""
    pads = any(hasattr(c, "eos_token_id") for c in criteria)  # as generate: pad finished rows iff an EOS criterion
    unfinished = [True] * len(rows)
    seq = input_ids
    for t in range(limit):
        fill([row for row, live in zip(rows, unfinished, strict=True) if live or not pads], t)
        column = [row.token(t) if live or not pads else pad for row, live in zip(rows, unfinished, strict=True)]
        seq = torch.cat([seq, torch.tensor(column, dtype=seq.dtype, device=seq.device)[:, None]], 1)  # (B, P + t + 1)
        if streamer is not None:
            streamer.put(torch.tensor(column[:1]))
        done = criteria(seq, None)  # (B,) bool: scores are None, as generate passes them without output_scores
        for r, stop in enumerate(done.tolist()):
            if stop and unfinished[r]:
                unfinished[r] = False
                if pads:
                    rows[r].close()
        if not any(unfinished):
            break
    return seq
