"""Draft only while it pays: measured tokens/s of plain steps against draft-verify cycles.

Speculative decoding pays only when the draft is cheap and accepted often enough; on a small model
on a CPU it often is not (docs/SWIFT.md, "Beyond the paper", has the measured costs). A drafter
that owns a `FallbackGate` reports every decode cycle to it and asks it whether the next cycle
drafts or takes a plain step (``propose`` returns None). Greedy and sampled output stay exact
either way: a plain step is a verification of nothing.

What a gate learned is worth keeping: a fresh gate times plain steps and probes drafting on every
prompt, a cost a short prompt where drafting does not pay cannot earn back. `GateMemory` keeps the
gate's state (and the drafter's measured draft/verify rates) in a small file under the toolkit
cache, one per model (architecture and weight fingerprint), device, dtype, thread count and drafter
settings, so any change of those starts afresh. ``remember`` says what a drafter does with it: ``on`` reads and
writes it, ``read`` only reads it (a benchmark's warm start: every repeat starts from the same state), ``off``
neither (a cold start). A drafter's stats name the state it started from (``start_state``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from layerskip_core import jsonfile
from layerskip_core.errors import UserError
from layerskip_core.packages import cache_root

MEMORY_FORMAT = "layerskip-gate/1"
REMEMBER = ("on", "read", "off")
"""``remember`` values: read and write the toolkit cache's memory, only read it, or neither."""
COLD = "cold"
"""``start_state`` of a drafter that restored nothing."""


def check_remember(value) -> None:
    """Refuse a ``remember`` option other than on, read or off."""
    if value not in REMEMBER:
        raise UserError(f"remember must be one of {', '.join(REMEMBER)} (read: use what earlier commands measured "
                        f"without changing it), got {value!r}")


@dataclass
class RememberOption:
    """The option of every drafter that keeps what it measured across commands (its Config subclasses this)."""

    remember: str = "on"
    """With adaptive, what the gate measured, kept in the toolkit cache per model, device, dtype, threads and these
    settings: on = start from it and save it (``finish``), read = start from it without changing it, off = start
    cold and save nothing."""

    def __post_init__(self) -> None:
        check_remember(self.remember)


class Rate:
    """Exponential moving average of tokens per second over decode cycles."""

    def __init__(self, weight: float = 0.2):
        self.weight, self.tokens, self.seconds, self.cycles = weight, 0.0, 0.0, 0

    def add(self, tokens: int, seconds: float) -> None:
        w = 1.0 if self.cycles == 0 else self.weight
        self.tokens += w * (tokens - self.tokens)
        self.seconds += w * (seconds - self.seconds)
        self.cycles += 1

    @property
    def value(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "seconds": self.seconds, "cycles": self.cycles}

    def load(self, d: dict) -> None:
        self.tokens, self.seconds, self.cycles = float(d["tokens"]), float(d["seconds"]), int(d["cycles"])


class FallbackGate:
    """After every cycle: draft next, or take a plain step?

    Plain steps are timed first (``WARM_PLAIN``), then drafting is probed for ``PROBE`` cycles and
    kept while its tokens/s beats plain steps by ``MARGIN``. Otherwise plain steps resume and drafting
    is probed again after ``recheck`` plain steps, doubling after every failed probe (up to
    ``BACKOFF`` times the interval). No probe, the first included, starts while the caller's cost model
    predicts less than ``bar`` (default ``HOPELESS``; a caller without one passes None: probes follow the schedule).
    A caller whose drafter improves while plain (SWIFT's optimiser) can ask for an early probe.
    """

    WARM_PLAIN = 3
    PROBE = 6
    MARGIN = 0.02
    BACKOFF = 16
    HOPELESS = 0.9

    def __init__(self, recheck_interval: int, enabled: bool = True, bar: float = HOPELESS):
        self.enabled, self.bar = enabled, bar
        self.recheck_interval = self.recheck = recheck_interval
        self.mode = "plain" if enabled else "draft"
        self.mode_cycles = 0
        self.plain, self.drafting = Rate(), Rate()

    def record(self, tokens: int, seconds: float, drafted: bool) -> None:
        """One finished cycle: ``tokens`` emitted in ``seconds``, with or without a draft."""
        (self.drafting if drafted else self.plain).add(tokens, seconds)

    def decide(self, predicted: float | None = None, early_probe: bool = False) -> bool:
        """Choose the next cycle's mode; True when drafting starts a new probe now."""
        if not self.enabled:
            return False
        self.mode_cycles += 1
        if self.mode == "plain":
            hopeful = predicted is None or predicted >= self.bar
            periodic = self.mode_cycles >= self.recheck and hopeful
            first = self.drafting.cycles == 0 and hopeful
            due = first or periodic or (early_probe and self.mode_cycles >= self.WARM_PLAIN)
            if self.plain.cycles >= self.WARM_PLAIN and due:
                self.switch("draft")
                return True
        elif self.mode_cycles >= self.PROBE and self.drafting.value < self.plain.value * (1 + self.MARGIN):
            self.recheck = min(self.recheck * 2, self.recheck_interval * self.BACKOFF)
            self.switch("plain")
        return False

    def switch(self, mode: str) -> None:
        self.mode, self.mode_cycles = mode, 0
        if mode == "draft":
            self.drafting = Rate()  # judge the (possibly changed) drafter on fresh measurements

    def to_dict(self) -> dict:
        return {"mode": self.mode, "mode_cycles": self.mode_cycles, "recheck": self.recheck,
                "plain": self.plain.to_dict(), "drafting": self.drafting.to_dict()}

    def load(self, d: dict) -> None:
        """Continue from a saved state (``to_dict``): same mode, rates and back-off."""
        if not self.enabled or d.get("mode") not in ("plain", "draft"):
            return
        self.mode, self.mode_cycles, self.recheck = d["mode"], int(d["mode_cycles"]), int(d["recheck"])
        self.plain.load(d["plain"])
        self.drafting.load(d["drafting"])


def check_rate(d, name: str) -> None:
    """ValueError unless ``d`` is a ``Rate.to_dict`` with finite, plausible numbers (a cycle takes >= 100 ns)."""
    jsonfile.obj(d, name)
    tokens = jsonfile.number(d["tokens"], f"{name}.tokens", 0, 1e6)
    seconds = jsonfile.number(d["seconds"], f"{name}.seconds", 0, 1e6)
    cycles = jsonfile.integer(d["cycles"], f"{name}.cycles", 0)
    if cycles and tokens and seconds < 1e-7:
        raise ValueError(f"{name} claims {tokens} tokens in {seconds} s, an impossible rate")


def check_memory(d: dict, num_layers: int | None = None) -> None:
    """ValueError or KeyError unless ``d`` holds what ``FallbackGate.to_dict`` and the drafters save, all plausible
    (other keys, e.g. of an earlier version, are not read and not checked); a plan's layers are below ``num_layers``
    (the model the memory is keyed by) when it is given."""
    gate = jsonfile.obj(d["gate"], "'gate'")
    if gate.get("mode") not in ("plain", "draft"):
        raise ValueError(f"gate.mode is {gate.get('mode')!r}, expected 'plain' or 'draft'")
    jsonfile.integer(gate["mode_cycles"], "gate.mode_cycles", 0)
    jsonfile.integer(gate["recheck"], "gate.recheck", 1, 10**9)
    for name in ("plain", "drafting"):
        check_rate(gate[name], f"gate.{name}")
    for name in ("draft_forward", "verify", "opt_step"):
        if name in d:
            check_rate(d[name], name)
    if "shadow" in d:  # the adaptive early exit's acceptance seen on plain steps (infer.drafters.shadow)
        shadow = jsonfile.obj(d["shadow"], "'shadow'")
        seen = jsonfile.number(shadow["seen"], "shadow.seen", 0.0, 1e6)
        jsonfile.number(shadow["good"], "shadow.good", 0.0, seen)
    if "plan" in d:
        plan = jsonfile.obj(d["plan"], "'plan'")
        top = None if num_layers is None else num_layers - 1
        jsonfile.integers(plan["attn"], "plan.attn", 0, top)
        jsonfile.integers(plan["mlp"], "plan.mlp", 0, top)
        jsonfile.number(d["score"], "score", -1.0, 1.0)


class GateMemory:
    """One drafter's learned gate state on disk, keyed by model, device, dtype, threads and drafter settings."""

    def __init__(self, path: Path, writable: bool = True, num_layers: int | None = None,
                 check: Callable[[dict, int | None], None] = check_memory):
        self.path, self.writable, self.num_layers, self.check = path, writable, num_layers, check
        self.loaded = False  # whether ``load`` found a saved state

    @classmethod
    def for_drafter(cls, runner, name: str, config) -> GateMemory | None:
        """The memory of a drafter with ``config`` (its ``remember`` decides reading and writing); None when off.

        The key leaves ``remember`` out, so a ``read`` drafter reads what an ``on`` drafter wrote."""
        if config.remember == "off":
            return None
        settings = {k: v for k, v in dataclasses.asdict(config).items() if k != "remember"}
        key = {"format": MEMORY_FORMAT, "model": runner.identity(), "device": str(runner.device),
               "dtype": str(runner.dtype), "threads": torch.get_num_threads(), "drafter": name, "settings": settings}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
        return cls(cache_root() / "gate" / f"{name}-{digest}.json", writable=config.remember == "on",
                   num_layers=runner.num_layers)

    def sibling(self, scope: str, check: Callable[[dict, int | None], None]) -> GateMemory:
        """The memory of another gate deciding for the same drafter and settings (``scope``: a batch's), in a file
        beside this one, read and written alike, its contents checked by ``check``."""
        return GateMemory(self.path.with_name(f"{self.path.stem}-{scope}.json"), self.writable, self.num_layers, check)

    @property
    def start_state(self) -> str:
        """What a drafter using this memory started from: ``cold``, or ``warm from <file>``."""
        return f"warm from {self.path}" if self.loaded else COLD

    def load(self) -> dict | None:
        """The saved state, or None when there is none; a damaged file is reported in one line and not trusted
        (the drafter starts afresh and this run's state replaces the file when it ends)."""
        if not self.path.exists():
            return None
        try:
            d = jsonfile.read(self.path, "gate memory", MEMORY_FORMAT)
            with jsonfile.checked(self.path, "gate memory"):
                self.check(d, self.num_layers)
        except UserError as e:
            print(f"layerskip: warning: {e}; ignoring it and starting afresh (this run's measurements replace it; "
                  "delete the file to reset the gate)", file=sys.stderr)
            return None
        self.loaded = True
        return d

    def save(self, state: dict) -> None:
        """Write atomically (nothing when only reading); a cache that cannot be written only costs the speed-up of
        remembering."""
        if not self.writable:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            jsonfile.write(self.path, json.dumps({"format": MEMORY_FORMAT} | state) + "\n")
        except OSError as e:
            print(f"layerskip: note: could not keep the drafter's measurements in {self.path} ({e.strerror})",
                  file=sys.stderr)


@dataclass(frozen=True)
class HandedOver:
    """What a drafter gives the caller's gate that takes its choice over (``Drafter.hand_over_gate``)."""

    memory: GateMemory | None
    """The drafter's own memory (remember on or read), beside which the caller keeps what its gate learns
    (``GateMemory.sibling``); None: remember off."""


def hand_over(owner) -> HandedOver | None:
    """``owner``'s gate hands its choice to a caller's (``Drafter.hand_over_gate``): replaced by a disabled one (always
    drafting) and its memory dropped, so that what the caller's gate decided is never saved as this drafter's
    measurements. None when the gate was not enabled (nothing to hand over)."""
    if not owner.gate.enabled:
        return None
    handed = HandedOver(owner.memory)
    owner.gate = FallbackGate(owner.gate.recheck_interval, enabled=False, bar=owner.gate.bar)
    owner.memory = None
    return handed


class GateOwner:
    """What early_exit and dynamic_exit share about their adaptive gate, written once: the gate built from the
    drafter's ``recheck_interval`` and ``adaptive`` options, the memory of earlier commands it starts from (a damaged
    memory file: a cold gate), and ``finish``, which keeps the gate's measurements for the next command. A mixin
    placed before ``Drafter`` in the drafter's bases."""

    gate: FallbackGate
    memory: GateMemory | None
    remembered: dict
    """What the memory held when the drafter started (empty: nothing, or a damaged file)."""

    def init_gate(self, runner, config) -> None:
        """Build ``gate`` and ``memory`` for ``config`` (``memory`` None unless ``config.adaptive``)."""
        self.gate = FallbackGate(config.recheck_interval, enabled=config.adaptive)
        self.memory = GateMemory.for_drafter(runner, self.name, config) if config.adaptive else None
        self.remembered = {}
        if self.memory is not None:
            try:
                self.remembered = self.memory.load() or {}
                self.gate.load(self.remembered.get("gate", {}))
            except (KeyError, TypeError, ValueError):  # a damaged memory file: start afresh
                self.gate = FallbackGate(config.recheck_interval, enabled=True)
                self.remembered = {}

    def kept_state(self) -> dict:
        """What ``finish`` keeps besides the gate (a drafter adds its own)."""
        return {}

    def finish(self) -> None:
        """The last prompt is done: keep the gate's measurements for the next command."""
        if self.memory is not None:
            self.memory.save({"gate": self.gate.to_dict()} | self.kept_state())
