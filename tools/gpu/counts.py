"""What the GPU check counts and times: static forwards built, CUDA graphs captured and dynamo graphs compiled,
kernels per forward (on the forward itself, never a graph replay), and the median time of a call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from infer.model.compiled import count_kernels
from infer.model.program import ONCE, Program, Rows
from infer.model.runner import Runner

COUNTS = ("builds", "captures", "compiles")
"""What the static executor counts (``StaticExecutor.counts``): forwards built, CUDA graphs captured, compiles."""
ATTENTION_WORDS = ("attention", "attn", "flash", "fmha", "sdpa", "softmax", "cudnn")
"""Substrings of the CUDA kernel names counted as attention kernels."""


def compile_count() -> int:
    """Graphs torch.compile (dynamo) has compiled in this process so far (0 where torch does not count them)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graph_counts(runner: Runner) -> dict[str, int]:
    """The static executor's counts so far (zeros on the eager executor)."""
    return runner.static.counts() if runner.static is not None else dict.fromkeys(COUNTS, 0)


@dataclass
class GraphTally:
    """What the static executor built, captured and compiled, in warm-ups and in timed runs."""

    warmup: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    """Counts added by warm-up calls."""
    timed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    """Counts added inside timed calls (should stay 0)."""

    def add(self, before: dict[str, int], warm: dict[str, int], after: dict[str, int]) -> None:
        for key in COUNTS:
            self.warmup[key] += warm[key] - before[key]
            self.timed[key] += after[key] - warm[key]


def timed(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2,
          runner: Runner | None = None, tally: GraphTally | None = None) -> float:
    """Median seconds of ``fn`` after ``warmup`` calls (which build static forwards and capture CUDA graphs);
    with ``runner`` and ``tally``, what was built and captured in each phase is added to ``tally``."""
    before = graph_counts(runner) if runner is not None else None
    for _ in range(warmup):
        fn()
    warm = graph_counts(runner) if runner is not None else None
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    if runner is not None and tally is not None:
        tally.add(before, warm, graph_counts(runner))
    return statistics.median(times)


def kernel_profile(fn: Callable[[], object], device) -> dict:
    """CUDA kernels one call of ``fn`` launches (a forward): how many, and the attention kernels by name (torch's
    profiler). On a CPU the fields are present with a note."""
    if getattr(device, "type", str(device)) != "cuda":
        return {"kernels_per_forward": None, "attention_kernels": [], "kernel_note": "CPU: no CUDA kernels"}
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    attention = sorted({n for n in names if any(w in n.lower() for w in ATTENTION_WORDS)})
    return {"kernels_per_forward": len(names), "attention_kernels": attention,
            "kernel_note": "" if names else "the profiler saw no CUDA kernel (CUPTI unavailable?)"}


@contextmanager
def uncaptured(runner: Runner):
    """Static forwards run as they are inside (compiled, not replayed as CUDA graphs): what a kernel count profiles,
    since CUPTI on CUDA 13.0 reports the kernels of a graph replay wrongly."""
    static = runner.static
    capture = static.capture if static is not None else False
    if static is not None:
        static.capture = False
    try:
        yield
    finally:
        if static is not None:
            static.capture = capture


def kernel_count(fn: Callable[[], object], device: torch.device) -> dict:
    """Kernels one call of ``fn`` launches: CUDA kernels through the profiler (``kernel_profile``); on a CPU a
    stand-in, the top-level operators (``infer.model.compiled.count_kernels``), so the check's
    plumbing runs there too."""
    if device.type == "cuda":
        return kernel_profile(fn, device)
    fn()
    return {"kernels_per_forward": count_kernels(fn, device), "attention_kernels": [],
            "kernel_note": "CPU stand-in: top-level operators, a compiled region counted once"}


def kernels(runner: Runner, P: int, span: Callable[[int, int], Callable[[], object]], device: torch.device) -> dict:
    """Kernels per one-token forward: the static forward uncaptured (compiled where the run compiles) and the eager
    forward, with the check that the static count is at least one kernel per layer (a lower count means the
    profiler missed kernels)."""
    L = runner.num_layers
    with uncaptured(runner):
        found = kernel_count(span(1, L), device)
    one = torch.tensor([10], device=device)  # (1,)
    eager = kernel_count(lambda: runner.forward(runner.new_cache(P + 2), one), device)
    n = found["kernels_per_forward"]
    found |= {"kernels_per_layer": None if n is None else n / L, "kernels_counted_on": "uncaptured static forward",
              "kernels_per_forward_eager": eager["kernels_per_forward"],
              "eager_fused_span": runner.fused is not None,  # a CPU kernel runner: one C++ call
              "attention_kernels_eager": eager["attention_kernels"],
              "kernels_at_least_one_per_layer": None if n is None else n >= L}
    return found


@torch.no_grad()
def kernels_per_layer(runner: Runner, prompt: int = 16) -> float:
    """Kernels per layer of one decode step (one row through every layer, with the LM head) on the runner's
    executors, after two warm-up steps (compiling and capturing happen there, not in the count)."""
    cache = runner.new_cache(max(256, prompt + 64))
    ids = torch.arange(prompt, device=runner.device) % runner.spec.vocab_size
    runner.run(Program(0, runner.num_layers), Rows.one(cache, runner.embed(ids), ids, kind=ONCE))
    one = runner.embed(ids[:1])  # (1, d)
    step_program = Program(0, runner.num_layers, logits=True)

    def step():
        runner.run(step_program, Rows.one(cache, one, [prompt]))
        cache.rollback(prompt)

    step()
    step()
    return count_kernels(step, runner.device) / runner.num_layers
