"""The one wall-budget rule of the GPU lease's commands: nothing new starts once the budget is spent, and a program
is stopped a grace period after it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

COMMAND_BUDGET_S = 240.0
"""Default budget of each device command's work on a GPU (gpu_check's run, gpu_compare's first form): a job's time
limit is this + ``GRACE_S`` + a minute of start-up (docs/GPU.md)."""
GRACE_S = 45.0
"""Seconds a program may run past its budget (a piece started just before it) before it is stopped."""


@dataclass
class Budget:
    """A wall budget counted from ``started``: nothing new starts once ``seconds`` have passed (0: no budget)."""

    seconds: float
    """The budget in seconds (0 = none)."""
    started: float = field(default_factory=time.perf_counter)
    """perf_counter() when it started counting."""

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def over(self, reserve: float = 0.0) -> bool:
        """Whether fewer than ``reserve`` seconds of the budget are left."""
        return self.seconds > 0 and self.elapsed() > self.seconds - reserve

    def left(self) -> float | None:
        """Seconds left, at least 1 (None: no budget): a running step's timeout."""
        return None if self.seconds <= 0 else max(1.0, self.seconds - self.elapsed())

    def limit(self, grace: float = GRACE_S) -> float | None:
        """When a program given this budget is stopped: the budget plus ``grace`` (None: no budget)."""
        return self.seconds + grace if self.seconds > 0 else None
