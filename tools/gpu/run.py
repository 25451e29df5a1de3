"""One GPU check run: its settings (full on a GPU, tiny on a CPU), the state carried from part to part, and a part
run under its own budget, its failure recorded and an optional package's absence a note."""

from __future__ import annotations

import gc
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from infer.model.compiled import StepCache
from tools.gpu.budget import COMMAND_BUDGET_S, Budget
from tools.gpu.counts import compile_count

PART_BUDGETS_S = {"shapes": 150.0, "greedy": 25.0, "checks": 20.0, "train": 20.0, "rest": 25.0}
"""Each part's own wall budget on a GPU (seconds from the part's start; no new piece of it starts after it). They
rest on estimates, not measurements on a GPU (docs/GPU.md, "Budgets")."""
OPTIONAL = ("accelerate", "optuna", "datasets", "wandb", "gguf", "deepspeed", "peft")
"""Packages a lease command runs without: a missing one is a recorded note, not a failure."""


@dataclass(frozen=True)
class Settings:
    """How much the run measures: full on a GPU, tiny on a CPU."""

    tiny: bool
    """4-layer stand-ins of the shapes and a few tokens."""
    prompt_len: int
    """Prompt tokens of the timed decoding."""
    new_tokens: int
    """Tokens per timed generation (the exactness part generates twice as many on a CPU)."""
    repeats: int
    """Timed generations per measurement (median)."""
    verify_sizes: tuple[int, ...]
    """T of the verification cost v(T)."""
    spread_sizes: tuple[int, ...]
    """T of the one-row vs many-row spread."""
    spread_prompt_lengths: tuple[int, ...]
    """Lengths of the seeded prompts the spread is measured after."""
    budget_s: float
    """Wall budget in seconds: nothing new starts after it (0 = no budget)."""
    part_budgets_s: dict = field(default_factory=dict)
    """Each part's own budget in seconds from its start (a missing part or 0 = none)."""

    @classmethod
    def for_run(cls, tiny: bool, budget_s: float | None = None) -> Settings:
        if tiny:
            return cls(True, 8, 8, 1, (1, 2, 4, 8), (2, 3, 4, 8), (9,), budget_s or 0.0)
        return cls(False, 32, 64, 3, tuple(range(1, 33)), tuple(range(2, 33)), (5, 9, 14),
                   COMMAND_BUDGET_S if budget_s is None else budget_s, dict(PART_BUDGETS_S))


@dataclass
class Run:
    """What one check run carries from part to part."""

    device: torch.device
    """Where everything runs."""
    settings: Settings
    """How much it measures."""
    started: float = field(default_factory=time.perf_counter)
    """perf_counter() at the start."""
    notes: list[str] = field(default_factory=list)
    """Cut pieces and other remarks, in order (also printed under the table)."""
    backend: str | None = None
    """The compile backend of our static forwards (None: not compiled)."""
    result: dict = field(default_factory=dict)
    """The result so far (``save`` writes it)."""
    saver: Callable[[dict], None] | None = None
    """Writes the result (after every piece)."""
    part_name: str | None = None
    """The part running now."""
    part_started: float = 0.0
    """perf_counter() at its start."""

    def __post_init__(self):
        self.steps = StepCache(self.backend or "inductor")
        """Compiled steps shared by every runner of one geometry, dtype and device in this run."""
        self.graphs_at_start = compile_count()
        """Dynamo's graph count when the run started."""

    @property
    def executor(self) -> str:
        """The executor the check decodes with: CUDA graphs on CUDA, their uncaptured static forwards elsewhere."""
        return "graphs" if self.device.type == "cuda" else "static"

    @property
    def compile(self) -> StepCache | bool:
        """What runners get as ``compile``: the run's shared ``StepCache`` when compiling, else False."""
        return self.steps if self.backend else False

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def budgets(self) -> tuple[Budget, Budget]:
        """(the run's budget, the running part's)."""
        part = self.settings.part_budgets_s.get(self.part_name or "", 0.0)
        return Budget(self.settings.budget_s, self.started), Budget(part, self.part_started)

    def over_budget(self, reserve: float = 0.0) -> bool:
        """Whether fewer than ``reserve`` seconds are left of the run's budget or of the running part's."""
        return any(b.over(reserve) for b in self.budgets())

    def cut(self, piece: str, reserve: float = 0.0) -> bool:
        """True (with a note saying so) when ``piece`` must not start: the budget, less ``reserve``, is spent."""
        if not self.over_budget(reserve):
            return False
        part = self.budgets()[1].seconds
        self.notes.append(f"{piece} cut: under {reserve:.0f} s left of the {self.settings.budget_s:.0f} s run budget "
                          f"or of part {self.part_name}'s {part:.0f} s (at {self.elapsed():.0f} s)")
        return True

    def save(self) -> None:
        self.result["seconds"] = self.elapsed()
        self.result["compiles"] = compile_counts(self)
        if self.saver is not None:
            self.saver(self.result)


def compile_counts(run: Run) -> dict:
    """Dynamo graphs compiled in this process (``transformers``' static-cache compiles included) and ours (the
    shared steps): in all and per step set (runners of one geometry, dtype and device share one)."""
    return {"dynamo_graphs": compile_count() - run.graphs_at_start,
            "ours": run.steps.compiles, "per_step_set": run.steps.counts(), "backend": run.backend}


def part(name: str, fn: Callable[[], dict], run: Run, into: str | None = None, grad: bool = False) -> None:
    """Run one part under its own budget (``PART_BUDGETS_S``): its numbers merge into the result (or its ``into``
    section; an exception is recorded under ``errors``); its start offset, seconds, budget and dynamo graph compiles
    go under ``parts``; the result is saved. Parts run under ``torch.no_grad()``, the engine's grad mode (``grad``:
    with grad, for training)."""
    result = run.result
    record = {"start_s": round(run.elapsed(), 2), "budget_s": run.settings.part_budgets_s.get(name, 0.0)}
    result.setdefault("parts", {})[name] = record
    if Budget(run.settings.budget_s, run.started).over():
        run.notes.append(f"part {name} cut: the {run.settings.budget_s:.0f} s run budget was spent "
                         f"({run.elapsed():.0f} s)")
        record |= {"seconds": 0.0, "compiles": 0, "cut": True}
        run.save()
        return
    t0, graphs = time.perf_counter(), compile_count()
    run.part_name, run.part_started = name, t0
    try:
        with torch.set_grad_enabled(grad):
            found = fn()
        (result.setdefault(into, {}) if into else result).update(found)
    except Exception as e:  # one part's failure must not lose the others' numbers
        missing = optional_missing(e)
        if missing:  # an optional package this image lacks: a note, not a failure
            run.notes.append(f"part {name} skipped: {missing} is not installed")
        else:
            result.setdefault("errors", {})[name] = error_text(e)
            print(f"gpu_check: part {name} failed:\n{traceback.format_exc()}", file=sys.stderr)
    free(run.device)  # after the except clause: the exception's frames (and their tensors) are gone by now
    record |= {"seconds": round(time.perf_counter() - t0, 2), "compiles": compile_count() - graphs,
               "cut": any(n.startswith(("part " + name + " cut",)) or f"of part {name}'s" in n for n in run.notes)}
    run.part_name = None
    run.save()


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def error_text(e: BaseException) -> str:
    """One line: the exception and where it was raised."""
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    at = f" at {Path(where.filename).name}:{where.lineno}" if where else ""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}{at}"


def optional_missing(error: BaseException) -> str | None:
    """The optional package whose absence raised ``error`` (None when it is something else)."""
    if isinstance(error, ModuleNotFoundError) and error.name:
        root = error.name.split(".")[0]
        return root if root in OPTIONAL else None
    return None


def optional_in(error: str) -> str | None:
    """The optional package (``OPTIONAL``) a recorded error says is missing, if any."""
    found = re.search(r"No module named '([\w.]+)'|requires? (?:the )?`?(\w+)`? (?:library|package)", error)
    name = found and (found.group(1) or found.group(2)).split(".")[0].lower()
    return name if name in OPTIONAL else None
