"""The GPU comparison's steps as a pipeline: each command run under the wall budget (stopped at it), its log kept
and merged, its output reused when a stopped run starts again, a failure one line naming its log."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from layerskip_core.errors import UserError
from tools.gpu.budget import Budget
from tools.gpu.compare_settings import CompareSettings

PROG = "gpu_compare"
"""How the pipeline's log lines begin."""


@dataclass
class Step:
    """One step of the run: what ran, how long it took, and whether its output was reused."""

    name: str
    """The step's name (its log is logs/NAME.log)."""
    command: str
    """The command line it ran (or the in-process function)."""
    seconds: float
    """Its wall time."""
    reused: bool = False
    """Whether its output existed already (not run again)."""
    returncode: int = 0
    """Its exit code (-9: stopped at the budget)."""


class OutOfBudget(Exception):
    """The run's wall budget is spent: no further step starts (the message says which did not)."""


class Pipeline:
    """The run's state: output folder, settings, wall budget, the steps done so far and notes for the reader."""

    def __init__(self, out: Path, settings: CompareSettings, env: dict[str, str], quiet: bool = False,
                 budget: Budget | None = None, merged_log: Path | None = None, cwd: Path | None = None):
        self.out, self.s, self.env, self.quiet, self.cwd = out, settings, env, quiet, cwd
        self.merged_log = merged_log
        """One file (in the results folder) every step's log is appended to as the step ends."""
        self.budget = budget or Budget(0.0)
        self.steps: list[Step] = []
        self.notes: list[str] = []

    def check_budget(self, name: str) -> None:
        """Raise OutOfBudget when the budget is spent before step ``name`` starts."""
        if self.budget.over():
            raise OutOfBudget(f"the {self.budget.seconds:.0f} s budget was spent before step {name} "
                              f"({self.budget.elapsed():.0f} s); it and the steps after it did not run")

    def left(self) -> float | None:
        """Seconds of budget left (None: no budget)."""
        return self.budget.left()

    def log(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{PROG}] {msg}", file=sys.stderr, flush=True)

    def note(self, msg: str) -> None:
        if msg not in self.notes:
            self.notes.append(msg)
            self.log(f"note: {msg}")

    def run(self, name: str, argv: list[str], output: Path | None = None, ok_codes: tuple[int, ...] = (0,)) -> int:
        """Run ``argv`` in the repository (skipped when ``output`` exists); a failing step is a UserError."""
        command = shlex.join(argv)
        if output is not None and output.exists():
            self.steps.append(Step(name, command, 0.0, reused=True))
            self.log(f"{name}: reusing {output}")
            return 0
        self.check_budget(name)
        log_file = self.out / "logs" / f"{name}.log"
        log_file.parent.mkdir(parents=True, exist_ok=True)
        self.log(f"{name}: {command}  (output: {log_file})")
        t0 = time.perf_counter()
        with open(log_file, "w") as f:
            try:
                proc = subprocess.run(argv, cwd=self.cwd, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                      timeout=self.left())
            except subprocess.TimeoutExpired:
                self.steps.append(Step(name, command, round(time.perf_counter() - t0, 2), returncode=-9))
                self.merge_log(log_file, self.steps[-1])
                raise OutOfBudget(f"step {name} was stopped at the {self.budget.seconds:.0f} s budget") from None
        seconds = time.perf_counter() - t0
        self.steps.append(Step(name, command, round(seconds, 2), returncode=proc.returncode))
        self.merge_log(log_file, self.steps[-1])
        if proc.returncode not in ok_codes:
            tail = [ln for ln in log_file.read_text(errors="replace").splitlines() if ln.strip()][-3:]
            raise UserError(f"step {name!r} failed (exit {proc.returncode}; {log_file}): "
                            f"{' | '.join(tail) or 'no output'}")
        return proc.returncode

    def merge_log(self, log_file: Path, step: Step, limit: int = 256 * 1024) -> None:
        """Append a finished (or stopped) step's log to ``merged_log`` under a header (its last ``limit`` bytes)."""
        if self.merged_log is None:
            return
        data = log_file.read_bytes()[-limit:].decode("utf-8", errors="replace") if log_file.is_file() else ""
        self.merged_log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.merged_log, "a", encoding="utf-8") as f:
            f.write(f"===== step {step.name}: exit {step.returncode}, {step.seconds:.1f} s\n$ {step.command}\n{data}"
                    + ("" if data.endswith("\n") or not data else "\n"))

    def timed(self, name: str, fn, *args):
        """Run an in-process step and record its wall time."""
        self.check_budget(name)
        t0 = time.perf_counter()
        value = fn(*args)
        self.steps.append(Step(name, f"(in process) {fn.__name__}", round(time.perf_counter() - t0, 2)))
        return value


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def layerskip(*args: str) -> list[str]:
    return [sys.executable, "-m", "layerskip_cli", *args]


def device_flags(s: CompareSettings) -> list[str]:
    """``--device`` and ``--dtype`` of the settings, as every step's command takes them."""
    return ["--device", s.device, "--dtype", s.dtype]
