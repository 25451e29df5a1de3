"""A forward described once: which layers run how (``Program``), over which rows (``Rows``), and what it gives back
(``Output``); the ``Executor`` interface every way of running one satisfies.

A ``Program`` is the layer range ``[start, end)``, the cut ``exact_until`` (layers before it run in full, the rest under
the skip ``plan``), the layers whose input stream a drafter or a verification observes (``observe``) and the head
(none, the LM head, or a reduced-vocabulary draft head). From these it derives, once, the steps that run (layer,
attention?, MLP?) interleaved with the cuts where the stream is kept (``walk``), and the layers whose caches and
counters a run advances. ``Rows`` are the packed rows of one or several sequences (``Segment``: a cache, positions and
a mask each) and their input stream; which executors may take them (``kind``): a decoding step, a one-off forward,
a prompt prefill on BLAS. What a segment's mask means (the last W slots, earlier ones visible; none: causal) and a
sliding window's cut are written here, once, for every executor.

``Runner.run(program, rows)`` asks its executors in order (``infer.model.runner``): each returns an ``Output`` or
``Declined`` with the reason (``static: several sequences``), and the runner then advances the cache lengths and the
layer counters, the same for every executor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from infer.model.kv_cache import KVCache, ints_to_device
from infer.model.plan import LayerPlan
from layerskip_core.families import ModelSpec

STEP = "step"
"""Rows of a decoding step (a draft, a verification): every executor may run them, static shapes included."""
ONCE = "once"
"""Rows whose shapes come once (a prompt, a re-run window): never given a static forward of their own."""
BULK = "bulk"
"""A prompt prefill on torch's matmuls and SDPA (faster for long inputs; nothing compares its rows with
token-by-token ones): the eager loop only."""
KINDS = (STEP, ONCE, BULK)


class Step(NamedTuple):
    """One layer of a program that runs something."""

    layer: int
    attn: bool
    """Whether its attention sublayer runs (writing K/V at the layer's length)."""
    mlp: bool
    """Whether its MLP sublayer runs."""


@dataclass(frozen=True)
class Program:
    """One forward over layers ``[start, end)``: ``[start, exact_until)`` in full, ``[exact_until, end)`` under
    ``plan``; the stream entering ``exact_until`` and each ``observe`` layer is returned beside the last one."""

    start: int
    end: int
    exact_until: int | None = None
    """Default: the plan's exact prefix (the layers before its first skip) within the range; without a plan, ``end``."""
    plan: LayerPlan | None = None
    """Sublayers skipped in ``[exact_until, end)`` (dropped where that range is empty)."""
    observe: tuple[int, ...] = ()
    """Layers in ``[start, end]`` whose input stream is returned (``Output.observed``): the cut points where a drafter
    or a verification observes the stream; the same layers run on the same rows as without them."""
    logits: bool = False
    """Whether the final norm and the LM head run (fp32 (N, V) logits)."""
    vocab: object | None = None
    """A reduced-vocabulary draft head (``infer.model.stack.DraftHead``) scoring the logits instead of the LM head."""

    def __post_init__(self) -> None:
        split = self.exact_until
        if split is None:
            split = self.end if self.plan is None else min(max(self.plan.exact_prefix, self.start), self.end)
        if not 0 <= self.start <= split <= self.end:
            raise ValueError(f"a program needs 0 <= start <= exact_until <= end, got {self.start}, {split}, {self.end}")
        observe = tuple(sorted(set(self.observe)))
        if any(not self.start <= x <= self.end for x in observe):
            raise ValueError(f"observed layers {list(observe)} outside the program's layers [{self.start}, {self.end}]")
        object.__setattr__(self, "exact_until", split)
        object.__setattr__(self, "observe", observe)
        if split >= self.end:
            object.__setattr__(self, "plan", None)
        if not self.logits:
            object.__setattr__(self, "vocab", None)

    @cached_property
    def _layout(self) -> Layout:
        skip_attn, skip_mlp = (self.plan.skip_attn, self.plan.skip_mlp) if self.plan is not None else ((), ())
        return layout(self.start, self.exact_until, self.end, frozenset(skip_attn), frozenset(skip_mlp), self.observe)

    @property
    def steps(self) -> tuple[Step, ...]:
        """The layers that run something, in order (a layer whose both sublayers are skipped is no step)."""
        return self._layout.steps

    @property
    def cuts(self) -> tuple[int, ...]:
        """The layers whose input stream is kept: ``exact_until`` and the observed ones, ascending."""
        return self._layout.cuts

    @property
    def walk(self) -> tuple[Step | int, ...]:
        """The steps in order with the cuts among them: an int ``c`` keeps the stream there (entering layer ``c``)."""
        return self._layout.walk

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Layers whose attention runs: each writes K/V, so each cache's length there grows by its rows."""
        return self._layout.attention

    @property
    def layers_run(self) -> tuple[int, ...]:
        """Layers that run something: each counts the rows (``RunnerCounters.layer_tokens``)."""
        return self._layout.run

    def output(self, hidden: Tensor, kept: dict[int, Tensor], logits: Tensor | None) -> Output:
        """The ``Output`` of a run that ended at ``hidden`` having kept the streams at ``cuts`` in ``kept``."""
        return Output(kept[self.exact_until], hidden, {x: kept[x] for x in self.observe}, logits)


class Layout(NamedTuple):
    """What a program derives from its range, cut, plan and observed layers (``layout``)."""

    steps: tuple[Step, ...]
    cuts: tuple[int, ...]
    walk: tuple[Step | int, ...]
    attention: tuple[int, ...]
    run: tuple[int, ...]


@lru_cache(maxsize=4096)
def layout(start: int, split: int, end: int, skip_attn: frozenset[int], skip_mlp: frozenset[int],
           observe: tuple[int, ...]) -> Layout:
    """A program's steps and cuts, derived once per distinct program: a decode step builds a few programs a token, and
    deriving one over 30 layers took ~60 us where a lookup takes ~1.5 us (a pure function's memo, keyed by value)."""
    steps = []
    for i in range(start, end):
        planned = i >= split
        attn, mlp = not (planned and i in skip_attn), not (planned and i in skip_mlp)
        if attn or mlp:
            steps.append(Step(i, attn, mlp))
    cuts = sorted({split, *observe})
    walk: list[Step | int] = []
    pending = list(cuts)
    for step in steps:
        while pending and pending[0] <= step.layer:
            walk.append(pending.pop(0))
        walk.append(step)
    return Layout(tuple(steps), tuple(cuts), tuple(walk + pending), tuple(s.layer for s in steps if s.attn),
                  tuple(s.layer for s in steps))


@dataclass
class Segment:
    """One sequence's T rows in a forward."""

    cache: KVCache
    """The sequence's own cache: its per-layer lengths say where its keys and values go."""
    positions: Sequence[int] | Tensor
    """RoPE positions of its T new tokens (host ints; a (T,) tensor where the caller holds them on the device)."""
    mask: Tensor | None = None
    """(T, W) bool over the last W attended slots (the W - T before the new ones, then the T new ones), earlier slots
    all visible; None: the new rows are causal."""
    _masks: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """Attention masks by start slot, made once (they depend on nothing else)."""

    @property
    def size(self) -> int:
        return len(self.positions)

    def attention_mask(self, slot: int, device: torch.device) -> Tensor | None:
        """(T, slot + T) bool for the rows written from ``slot``; None where no mask is needed (one row, or causal rows
        from slot 0: the attention's own causal form)."""
        if self.mask is None and (self.size == 1 or slot == 0):
            return None
        if slot not in self._masks:
            self._masks[slot] = visible(self.size, slot, self.mask, device)
        return self._masks[slot]


def visible(T: int, extra: int, mask: Tensor | None, device: torch.device | str = "cpu") -> Tensor:
    """(T, extra + T) bool: which of the last ``extra + T`` slots each of T new rows sees: ``mask`` (T, W) over the
    last W of them, the slots before it all visible; None: causal rows after ``extra`` visible slots."""
    S = extra + T
    if mask is None:
        return torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=extra)  # (T, S)
    W = mask.shape[1]
    if W > S:
        raise ValueError(f"mask covers {W} slots but only {S} exist")
    full = torch.ones(T, S, dtype=torch.bool, device=device)  # (T, S)
    full[:, S - W:] = mask
    return full


def near(positions: Tensor, keys: Tensor, window: int) -> Tensor:
    """(T, S) bool: which keys (their positions ``keys`` (S,)) lie within the sliding window of each query position
    (``positions`` (T,)), as transformers' masks: a query at p sees keys at (p - W, p]."""
    return keys[None, :] > positions[:, None] - window  # (T, S)


def window_mask(spec: ModelSpec, cache: KVCache, i: int, base: Tensor | None, positions: Tensor) -> Tensor | None:
    """Layer ``i``'s mask for T new rows at ``positions`` (T,): ``base`` (``Segment.attention_mask``'s) where the layer
    attends fully; with a sliding window W, the rows' positions are recorded in the cache and keys W or more positions
    before a row are hidden too (``near``), once the layer's slots outnumber W (slot >= position, so
    before that every key is near)."""
    window = spec.window(i)
    if window is None:
        return base
    T, start = positions.shape[0], cache.lengths[i]
    cache.pos[i, start:start + T] = positions
    if start + T <= window:
        return base
    close = near(positions, cache.pos[i, :start + T], window)  # (T, S)
    if base is None and T > 1:  # causal rows from slot 0
        base = visible(T, start, None, positions.device)
    return close if base is None else base & close


@dataclass
class Rows:
    """The packed rows of a forward: ``hidden`` (N, d) holds the segments' rows in order, entering the program's
    first layer."""

    hidden: Tensor
    segments: Sequence[Segment]
    kind: str = STEP
    """``STEP``, ``ONCE`` or ``BULK``: which executors may take the rows."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown rows kind {self.kind!r}; use one of {', '.join(KINDS)}")

    @classmethod
    def one(cls, cache: KVCache, hidden: Tensor, positions: Sequence[int] | Tensor, mask: Tensor | None = None,
            kind: str = STEP) -> Rows:
        """One sequence's T rows (``hidden`` (T, d)) at ``positions`` in ``cache``, with ``mask`` (T, W) or causal."""
        return cls(hidden, (Segment(cache, positions, mask),), kind)

    @property
    def size(self) -> int:
        return self.hidden.shape[0]

    def host_positions(self) -> list[int]:
        """The N rows' positions as host ints."""
        out: list[int] = []
        for s in self.segments:
            out += s.positions.tolist() if isinstance(s.positions, Tensor) else list(s.positions)
        return out

    def device_positions(self, device: torch.device) -> Tensor:
        """(N,) long: the rows' positions on ``device`` (a segment's device tensor as it is; host ints without a
        sync)."""
        if len(self.segments) == 1 and isinstance(self.segments[0].positions, Tensor):
            return self.segments[0].positions
        return ints_to_device(self.host_positions(), device)


@dataclass
class Output:
    """What a program's run returns for the N rows."""

    exact: Tensor
    """(N, d) the stream entering layer ``exact_until`` (before any skip plan)."""
    hidden: Tensor
    """(N, d) the stream after the program's last layer."""
    observed: dict[int, Tensor]
    """(N, d) the stream entering each ``observe`` layer."""
    logits: Tensor | None = None
    """(N, V) fp32 logits after the final norm and LM head (or the draft head), when the program asks."""


@dataclass(frozen=True)
class Declined:
    """An executor's answer to a program and rows it does not run: why (``executor: reason``)."""

    reason: str
    broken: bool = False
    """The executor cannot run anything any more (a failed CUDA graph capture): the runner drops it."""


class Executor(Protocol):
    """One way of running programs. ``run`` computes the ``Output`` (the K/V rows written at each layer's length, the
    cache lengths and counters left to the runner), or returns ``Declined`` having touched nothing."""

    name: str

    def run(self, program: Program, rows: Rows) -> Output | Declined: ...
