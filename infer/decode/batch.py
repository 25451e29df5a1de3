"""Batched self-speculative decoding: many prompts in one engine, each row accepting its own number of drafted tokens.

``BatchEngine`` decodes a list of prompts ``batch_size`` at a time. Each row is a sequence with its own KV cache
(its own per-layer lengths, so early exit's shallow layers run ahead per row), its own ``DecodeState`` and its own
drafter (drafters keep per-sequence state: an adapter's cache, Self-SD's threshold, SWIFT's plan search); a cycle
(``infer.decode.cycle``) asks every row's drafter for a draft at once (``Drafter.propose_rows``: early exit and Self-SD
draft all rows in one packed forward per draft step), verifies every row in one packed target forward
(``infer.decode.verify``), reads the host once for all greedy rows, and accepts and rolls back per row (ragged). A row
that finishes (EOS, stop string, max tokens) leaves the batch at once and the next prompt of the queue takes its slot;
the prompts taking slots in the same round prefill together (``infer.decode.prefill``: packed forwards where that is
exact).

Each row's output is what a fresh ``Engine`` gives that prompt alone: greedy output identical, token for token (in
fp32 on a CPU bitwise: the small-matmul kernel's rows do not depend on the batch); sampling draws from each row's own
generator, seeded with the config's seed as ``Engine`` seeds one prompt, and every prompt meets a fresh drafter (a
slot's drafter is finished and replaced when the next prompt takes the slot), so a row samples exactly what that
prompt samples alone, whatever the batch size, its place in the batch and when the other rows finish. Drafters whose
choices come from measured time (an adaptive gate, dynamic_exit's ``calibrate``, SWIFT's fallback to plain steps)
are the exception: what they draft, and so which random draws a row makes, depends on the clock (docs/BATCHING.md).
``carry_state=True`` keeps a slot's drafter over the prompts it takes in turn instead (a stream per slot: which
state a prompt meets then depends on the schedule).

With adaptive drafters (early exit's and dynamic exit's ``adaptive``, SWIFT's default) and more than one row, one gate
decides for the whole batch (``infer.decode.batch_gate``): the rows' drafters hand their gates over, and each cycle
either takes a plain step for every row or drafts at most k tokens a row, per number of running rows, from a cost
model fitted to the batch's cycles and their measured speed: whether drafting pays, and how far, depends on B, which a
row's own gate cannot see.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from infer.decode.batch_gate import BatchGate, CycleClock, check_batch_memory
from infer.decode.cycle import CycleObserver, step_rows
from infer.decode.engine import DecodeConfig, Engine, Generation, GenerationResult, start_rows, token_ids
from infer.decode.processing import PositionProcessor
from infer.drafters.base import Drafter, VerifyOutcome
from infer.drafters.gate import HandedOver
from infer.model.kv_cache import capacity_bucket
from infer.model.runner import Runner
from layerskip_core.errors import UserError

GIB = 1024 ** 3


def kv_bytes(runner: Runner, capacity: int) -> int:
    """Bytes of one sequence's KV cache of ``capacity`` positions: 2 (K, V) x L x H_kv x capacity x D x dtype size."""
    s = runner.spec
    return 2 * s.num_layers * s.num_kv_heads * capacity * s.head_dim * torch.empty(0, dtype=runner.dtype).element_size()


def available_bytes(device: torch.device) -> int | None:
    """Memory free for new caches on ``device`` (CUDA: free device memory; CPU: the kernel's MemAvailable), or None
    when it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class BatchEngine:
    """Decodes prompts in batches of ``batch_size`` rows, one drafter per row slot (``make_drafter()`` builds each);
    every row's output equals a fresh ``Engine``'s for that prompt alone (see the module docstring).

    Each prompt meets a fresh drafter: when a slot takes its next prompt, its drafter's ``finish`` runs and a new one
    is built (``carry_state=True``: the slot's drafter carries on, as an ``Engine``'s does over a prompt stream).
    ``close()`` (or leaving a ``with`` block) runs every remaining slot drafter's ``finish`` once.
    """

    def __init__(self, runner: Runner, make_drafter: Callable[[], Drafter], batch_size: int,
                 eos_token_ids: Sequence[int] = (), decode: Callable[[list[int]], str] | None = None,
                 carry_state: bool = False):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise UserError(f"batch size must be an integer >= 1, got {batch_size!r}")
        self.runner, self.batch_size, self.carry_state = runner, batch_size, carry_state
        self.make_engine = lambda: Engine(runner, make_drafter(), eos_token_ids, decode)
        if batch_size > 1 and runner.executor != "eager":
            print(f"layerskip: note: batched decoding runs its packed forwards on the eager executor (the "
                  f"{runner.executor} executor serves one row at a time)", file=sys.stderr)
        self.slots = [self.make_engine() for _ in range(batch_size)]
        """One engine (one drafter) per row of the batch."""
        handed = self.take_gates(self.slots)
        memory = next((h.memory for h in handed if h.memory is not None), None)
        self.gate: BatchGate | None = BatchGate(memory=None if memory is None else memory.sibling(
            "batch", check_batch_memory)) if handed else None
        """With adaptive drafters and more than one row: the batch's one gate, which took the rows' gates over
        (``infer.decode.batch_gate``), starting from what it kept beside their memory in earlier commands (none with
        ``remember=off``); None: each drafter gates itself, or does not."""
        self.clock = CycleClock()
        """Times each cycle's two phases for the gate."""
        self.cold = False
        """Whether the next cycle is the first after a prefill (its verification left out of the gate's fit)."""
        self.used: set[int] = set()
        """Slots (indices) whose drafter has decoded a prompt: the next prompt there gets a fresh one."""
        self.observers: list[CycleObserver] = []
        """What sees every batched cycle (measurement: ``infer.measure.timing``)."""

    def __enter__(self) -> BatchEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Decoding is over: every slot drafter's ``finish`` runs (once), and the batch's gate keeps what it learned."""
        for engine in self.slots:
            engine.close()
        if self.gate is not None:
            self.gate.save()

    def check_memory(self, prompts: Sequence[Sequence[int]], config: DecodeConfig) -> int:
        """Refuse, in one line, a batch whose KV caches do not fit: at most ``batch_size`` rows hold a cache at once,
        each of ``capacity_bucket(prompt + max_new_tokens + lookahead + slack)`` positions; returns the bytes."""
        caps = sorted((capacity_bucket(self.slots[0].cache_length(len(p), config.max_new_tokens)) for p in prompts),
                      reverse=True)[:self.batch_size]
        need = sum(kv_bytes(self.runner, c) for c in caps)
        free = available_bytes(self.runner.device)
        if free is not None and need > free:
            raise UserError(f"the batch's KV caches need {need / GIB:.2f} GiB ({len(caps)} rows of up to {caps[0]} "
                            f"positions) but {free / GIB:.2f} GiB is free on {self.runner.device}; lower the batch "
                            "size or --max-new-tokens")
        return need

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int] | torch.Tensor], config: DecodeConfig | None = None,
                 generators: Sequence[torch.Generator] | None = None,
                 processors: Sequence[PositionProcessor | None] | None = None,
                 on_result: Callable[[int, GenerationResult], None] | None = None) -> list[GenerationResult]:
        """Decode every prompt (token ids); results in the prompts' order. ``generators``: one per prompt (default:
        each a new one from ``config.sampling``'s seed); ``processors``: logits processing per prompt
        (``infer.decode.processing``); ``on_result(i, result)``: called as each prompt finishes (in the order they
        finish), so a caller can write it out before the rest are done."""
        config = DecodeConfig() if config is None else config
        if not isinstance(config, DecodeConfig):
            raise UserError(f"config must be a DecodeConfig (or None), not {type(config).__name__}")
        prompts = [token_ids(p) for p in prompts]
        if not prompts:
            raise UserError("no prompts to decode")
        for prompt in prompts:
            self.slots[0].check_prompt(prompt, config)
        self.check_memory(prompts, config)
        results: list[GenerationResult | None] = [None] * len(prompts)
        queue, free, live = deque(range(len(prompts))), list(self.slots), []
        while queue or live:
            joining = []
            while queue and free:
                i, engine = queue.popleft(), self.fresh(free.pop(0))
                generator = None if generators is None else generators[i]
                processor = None if processors is None else processors[i]
                joining.append((i, engine, engine.admit(prompts[i], config, generator, processor=processor)))
            if joining:  # the rows taking free slots prefill together (``infer.decode.prefill``)
                start_rows([(engine, gen) for _, engine, gen in joining])
                live += joining
                self.cold = True
            for i, engine, gen in [row for row in live if row[2].done]:
                results[i] = engine.finish(gen)
                free.append(engine)
                if on_result is not None:
                    on_result(i, results[i])
            live = [row for row in live if not row[2].done]
            if live:
                self.step([(engine, gen) for _, engine, gen in live], queued=bool(queue))
        return results

    def fresh(self, engine: Engine) -> Engine:
        """The slot of ``engine`` ready for its next prompt: the same engine the first time or with ``carry_state``,
        else its drafter finished and the slot's engine replaced by a new one (a fresh drafter)."""
        slot = next(j for j, e in enumerate(self.slots) if e is engine)
        if slot in self.used and not self.carry_state:
            engine.close()
            engine = self.slots[slot] = self.make_engine()
            self.take_gates([engine])
        self.used.add(slot)
        return engine

    def take_gates(self, engines: Sequence[Engine]) -> list[HandedOver]:
        """With more than one row, the batch's gate decides plain steps for these engines' drafters
        (``Drafter.hand_over_gate``); what those with an adaptive gate handed over (empty: none had one)."""
        if self.batch_size == 1:
            return []
        handed = [engine.drafter.hand_over_gate() for engine in engines]
        return [h for h in handed if h is not None]

    def step(self, rows: Sequence[tuple[Engine, Generation]], queued: bool = True) -> list[VerifyOutcome]:
        """One cycle over running rows (``infer.decode.cycle.step_rows``), seen by ``observers``; with the batch's
        gate, a cycle of plain steps for every row or of drafts capped where it chose so, and the cycle timed and
        shown to it. ``queued``: prompts wait for a slot (the gate weighs the tokens of every row; else B times the
        advance of the row that has advanced least, which sets when the batch ends)."""
        if self.gate is None:
            return step_rows(rows, self.observers)
        self.gate.horizon = None if queued else max(gen.config.max_new_tokens - len(gen.tokens) for _, gen in rows)
        drafting, cap = self.gate.drafts(len(rows)), self.gate.cap(len(rows))
        for _, gen in rows:
            gen.state.draft_cap = cap
        least, t0 = min(len(gen.tokens) for _, gen in rows), time.perf_counter()
        outcomes = step_rows(rows, [*self.observers, self.clock], plain=not drafting)
        seconds = time.perf_counter() - t0
        progress = sum(len(o.tokens) for o in outcomes) if queued else \
            len(rows) * (min(len(gen.tokens) for _, gen in rows) - least)
        detail, self.cold = self.clock.detail(outcomes, self.cold), False
        self.gate.record(len(rows), progress, seconds, drafting, detail)
        return outcomes
