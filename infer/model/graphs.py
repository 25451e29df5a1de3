"""Static-shape decoding forwards, compiled on CUDA and captured as CUDA graphs.

A CUDA graph replays recorded kernels with one launch if every shape and buffer address stays the same, so
these forwards have static shapes (as gpt-fast's): positions, each layer's window start and the new rows'
attention pattern travel in one int64 ``meta`` buffer (copied from pinned memory, no host sync; the host keeps
the authoritative ``KVCache.lengths``); attention runs over the cache capacity with a mask, one additive mask
per group of layers with the same window start; T rows are padded up to a bucket, and padded rows see only the
prefix and themselves, writing K/V past the new length, which the host length marks free.

The executor takes a program (``infer.model.program``) over one sequence's rows of a decoding step (``STEP``); its
steps and cuts are the program's, its masks the segment's (``program.visible``) laid over the cache capacity. A static
forward per ``SpanKey`` and cache: it is captured on its first use, or its ``PLAN_CAPTURE_AFTER``-th
when it runs a skip plan (SWIFT tries many plans briefly); the least recently used plan forwards are dropped
first. The executor's ``builds``, ``captures`` and ``compiles`` count what a benchmark must keep out of its
timed region. Host syncs: none in a draft step or a verification forward (outputs are cloned on the device).
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import torch
from torch import Tensor

from infer.model.attention import group_mask
from infer.model.compiled import LayerSteps, StepCache
from infer.model.kv_cache import KVCache
from infer.model.plan import LayerPlan
from infer.model.program import STEP, Declined, Output, Program, Rows, near, visible
from infer.model.stack import Stack

BUCKETS = (1, 2, 4, 8, 16, 32)
"""Row counts a static forward is padded up to; larger calls run eagerly."""
MAX_SPANS = 512
"""Static forwards (and graphs) kept per cache: every shape of a run (buckets x window widths x draft and verify
spans) fits; beyond it the least recently used plan forward goes first, then the least recently used."""
EXTRA_BUCKETS = (1, 2, 4, 8, 16, 32)
"""Window columns before the new rows (a tree verification's already-computed prefix) are padded up to one of
these (the added columns are visible context either way), so trees of varying depth share static forwards."""
CAPTURE_AFTER = 1
"""Uses after which a forward without a skip plan is captured: its first (the shapes of a run are few and fixed)."""
PLAN_CAPTURE_AFTER = 3
"""Uses after which a skip-plan forward is captured: a plan SWIFT drafts with for a step or two is never captured
(static until then); candidate plans its optimiser scores never come here (they run eagerly)."""


@dataclass(frozen=True)
class SpanKey:
    """Everything that fixes a static forward's shapes and kernels."""

    rows: int
    """Bucket: the padded row count."""
    extra: int
    """Window columns before the new rows' own slots (W - T for a (T, W) mask; 0 = causal)."""
    start: int
    """First layer."""
    split: int
    """Layers [start, split) run exactly; [split, end) under the plan."""
    end: int
    """One past the last layer."""
    plan: tuple | None
    """(skipped attention layers, skipped MLP layers) of the plan, sorted; None = no plan."""
    logits: bool
    """Whether the final norm and LM head run."""
    vocab: str | None = None
    """Key of the reduced-vocabulary draft head scoring the logits (None: the full LM head)."""
    groups: tuple[int, ...] = ()
    """For each attention layer run, in order, the first of them with the same window start and sliding window:
    layers of a group share one attention mask (computed once per forward, not once per layer)."""
    observe: tuple[int, ...] = ()
    """Layers whose input stream the forward also returns (``Program.observe``)."""


def bucket(rows: int, buckets: tuple[int, ...] = BUCKETS) -> int | None:
    """Smallest bucket holding ``rows`` (None when none does)."""
    return next((b for b in buckets if b >= rows), None)


def plan_key(plan: LayerPlan | None) -> tuple | None:
    if plan is None:
        return None
    return tuple(sorted(plan.skip_attn)), tuple(sorted(plan.skip_mlp))


def padded_window(rows: int, T: int, extra: int, mask: Tensor | None) -> Tensor:
    """(rows, extra + rows) int64: which window slots each (padded) row sees.

    Window column c is slot ``window_start + c``; the T real rows own columns [extra, extra + T).
    Real rows follow ``mask`` (T, extra + T), or are causal when it is None; padded rows see themselves.
    """
    W = extra + rows
    out = torch.zeros(rows, W, dtype=torch.long)  # (rows, W)
    out[:T, :extra + T] = visible(T, extra, None if mask is None else mask.cpu()).long()  # (T, extra + T)
    pad = torch.arange(T, rows)
    out[pad, extra + pad] = 1
    return out


class StaticSpan:
    """One static forward: its input buffers, and on CUDA its captured graph and output buffers."""

    def __init__(self, stack: Stack, key: SpanKey, program: Program):
        # no reference to the cache: the executor's table is keyed by it weakly (a graph dies with its cache)
        self.stack, self.key, self.program = stack, key, program
        d, L = stack.spec.hidden_size, stack.num_layers
        W = key.extra + key.rows
        self.hidden = torch.zeros(key.rows, d, dtype=stack.dtype, device=stack.device)  # (rows, d)
        self.meta = torch.zeros(key.rows + L + key.rows * W, dtype=torch.long, device=stack.device)
        self.uses = 0
        """Calls so far."""
        self.graph = None
        """The captured CUDA graph (None until captured)."""
        self.outputs: tuple[Tensor | None, ...] | None = None
        """The captured forward's outputs (``static_forward``'s: the last stream, the logits, the kept streams)."""

    def compute(self, cache: KVCache, steps: LayerSteps) -> tuple[Tensor | None, ...]:
        return static_forward(self.stack, cache, self.hidden, self.meta, self.key, self.program, steps)

    def capture(self, cache: KVCache, steps: LayerSteps, pool) -> None:
        """Warm up (and compile) on a side stream, then record the forward into the executor's shared memory pool
        (PyTorch's documented recipe). The caller has made the runner's device current."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up writes the same K/V rows the replay will write
                self.compute(cache, steps)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.outputs = self.compute(cache, steps)
        self.graph = graph

    def run(self, cache: KVCache, executor: StaticExecutor) -> tuple[Tensor | None, ...]:
        self.uses += 1
        if not executor.capture:
            return self.compute(cache, executor.steps)
        after = CAPTURE_AFTER if self.key.plan is None else PLAN_CAPTURE_AFTER
        if self.graph is None and self.uses >= after:
            self.capture(cache, executor.steps, executor.graph_pool())
            executor.captures += 1
        if self.graph is None:
            return self.compute(cache, executor.steps)
        self.graph.replay()
        # replays overwrite the output buffers: hand out copies (device-side, no sync)
        return tuple(None if t is None else t.clone() for t in self.outputs)


SEVERAL = Declined("static: several sequences (their shapes vary with the batch)")
NOT_A_STEP = Declined("static: not a decoding step (a prompt, a re-run window: shapes that come once)")
TOO_MANY_ROWS = Declined(f"static: more rows than the largest bucket ({BUCKETS[-1]})")
NARROW_MASK = Declined("static: a mask narrower than its rows")
NO_ROOM = Declined("static: the padded rows do not fit the window or the cache")


class StaticExecutor:
    """Runs the programs of decoding steps over one sequence as static-shape forwards: their layers compiled when
    ``compile`` (True, or a ``StepCache`` whose compiled steps runners share), captured as CUDA graphs when
    ``capture``. Its counters should stop growing once a warm-up has run every shape a workload uses (the runner's
    pooled caches keep the forwards): ``builds`` (static forwards set up), ``captures`` (graphs recorded),
    ``compiles`` (graphs inductor compiled)."""

    def __init__(self, stack: Stack, capture: bool, compile: bool | StepCache = False,
                 buckets: tuple[int, ...] = BUCKETS):
        self.stack, self.capture, self.buckets = stack, capture, buckets
        self.max_spans = MAX_SPANS
        """Static forwards kept per cache."""
        self.steps = compile.steps(stack) if isinstance(compile, StepCache) else LayerSteps(bool(compile))
        """The per-layer steps (compiled or not) every static forward runs: a ``StepCache``'s, shared with the other
        runners of the same model geometry, dtype and device, or this executor's own."""
        self._spans: WeakKeyDictionary = WeakKeyDictionary()  # cache -> OrderedDict[SpanKey, StaticSpan]
        self._pool = None
        self.builds = self.captures = 0

    @property
    def name(self) -> str:
        return "graphs" if self.capture else "static"

    @property
    def compile(self) -> bool:
        return self.steps.compile

    @property
    def compiles(self) -> int:
        return self.steps.compiles

    def counts(self) -> dict[str, int]:
        """{"builds", "captures", "compiles"} so far: a benchmark takes them before and after its timed region."""
        return {"builds": self.builds, "captures": self.captures, "compiles": self.compiles}

    def spans(self, cache: KVCache | None = None) -> list[StaticSpan]:
        """The static forwards kept for ``cache`` (default: for every live cache), least recently used first."""
        tables = list(self._spans.values()) if cache is None else [self._spans.get(cache, {})]
        return [span for table in tables for span in table.values()]

    def clear(self) -> None:
        self._spans = WeakKeyDictionary()

    def graph_pool(self):
        """One CUDA-graph memory pool shared by every graph of this runner (they replay one at a time, and each
        graph's outputs stay allocated, so a later capture reuses only memory no live graph reads)."""
        if self._pool is None and self.stack.device.type == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def run(self, program: Program, rows: Rows) -> Output | Declined:
        """The program as a static forward over one sequence's rows of a decoding step, or why not (the rows' kind,
        several sequences, too many rows, a window that does not fit); a failed capture declines for good."""
        if rows.kind != STEP:
            return NOT_A_STEP
        if len(rows.segments) != 1:
            return SEVERAL
        prepared = self._prepare(program, rows)
        if isinstance(prepared, Declined):
            return prepared
        entry, cache, T = prepared
        try:
            with _on_device(self.stack.device, self.capture):
                hidden, head, *kept = entry.run(cache, self)
        except RuntimeError as e:
            if not self.capture:
                raise
            return Declined(f"graphs: capture failed ({str(e).splitlines()[0] if str(e) else type(e).__name__})",
                            broken=True)
        return program.output(hidden[:T], {c: x[:T] for c, x in zip(program.cuts, kept, strict=True)},
                              None if head is None else head[:T])

    def _prepare(self, program: Program, rows: Rows) -> tuple[StaticSpan, KVCache, int] | Declined:
        """The static forward for ``program`` over the rows, its inputs copied in: (it, the cache, T), or why not."""
        seg = rows.segments[0]
        cache, mask, T = seg.cache, seg.mask, rows.size
        padded = bucket(T, self.buckets)
        extra = 0 if mask is None else mask.shape[1] - T
        if padded is None:
            return TOO_MANY_ROWS
        if extra < 0:
            return NARROW_MASK
        attn = program.attention_layers
        extra, mask, window_starts = self._window(cache, attn, extra, mask, padded)
        if window_starts is None:
            return NO_ROOM  # the padded rows would not fit: let the eager path raise or run
        slide = self.stack.spec.window
        groups = tuple(next(j for j in attn if (window_starts[j], slide(j)) == (window_starts[i], slide(i)))
                       for i in attn)
        vocab = program.vocab
        key = SpanKey(padded, extra, program.start, program.exact_until, program.end, plan_key(program.plan),
                      program.logits, None if vocab is None else vocab.key, groups, program.observe)
        entry = self._entry(cache, key, program)
        positions = rows.host_positions()
        pos = positions + [positions[-1]] * (padded - T)
        meta = torch.cat([torch.tensor(pos + window_starts, dtype=torch.long),
                          padded_window(padded, T, extra, mask).flatten()])  # (rows + L + rows * W,)
        if entry.meta.is_cuda:
            meta = meta.pin_memory()
        entry.meta.copy_(meta, non_blocking=True)
        entry.hidden[:T].copy_(rows.hidden)
        return entry, cache, T

    def _window(self, cache: KVCache, attn: tuple[int, ...], extra: int, mask: Tensor | None,
                rows: int) -> tuple[int, Tensor | None, list[int] | None]:
        """(extra, mask (T, extra + T), window starts): a window of ``extra`` earlier columns widened to its
        ``EXTRA_BUCKETS`` size where the cache allows (the added columns are slots before the window, visible
        either way), with each layer's window start; starts None when even the unpadded window does not fit."""
        padded = bucket(extra, EXTRA_BUCKETS) if extra else None
        if padded is not None and padded != extra:
            starts = self._window_starts(cache, attn, padded, rows)
            if starts is not None:
                T = mask.shape[0]
                pad = torch.ones(T, padded - extra, dtype=torch.bool)  # (T, padded - extra)
                return padded, torch.cat([pad, mask.cpu()], 1), starts  # mask (T, padded + T)
        return extra, mask, self._window_starts(cache, attn, extra, rows)

    def _window_starts(self, cache: KVCache, attn: tuple[int, ...], extra: int, rows: int) -> list[int] | None:
        """Each attention layer's window start (the last ``extra`` slots before the new rows), or None when the
        window would start before slot 0 or the padded rows would run past the capacity."""
        starts = [0] * self.stack.num_layers
        for i in attn:
            starts[i] = cache.lengths[i] - extra
            if starts[i] < 0 or starts[i] + extra + rows > cache.capacity:
                return None
        return starts

    def _entry(self, cache: KVCache, key: SpanKey, program: Program) -> StaticSpan:
        spans = self._spans.setdefault(cache, OrderedDict())
        entry = spans.get(key)
        if entry is None:
            entry = spans[key] = StaticSpan(self.stack, key, program)
            self.builds += 1
            while len(spans) > self.max_spans:
                old = next((k for k in spans if k.plan is not None), next(iter(spans)))  # plan forwards first
                del spans[old]
        spans.move_to_end(key)
        return entry


def _on_device(device: torch.device, capture: bool):
    """Make ``device`` the current CUDA device while capturing or replaying (streams, pools and graphs follow the
    current device, not a tensor's: without this a runner on cuda:1 would capture on cuda:0's streams)."""
    return torch.cuda.device(device) if capture and device.type == "cuda" else nullcontext()


def static_forward(stack: Stack, cache: KVCache, hidden: Tensor, meta: Tensor, key: SpanKey, program: Program,
                   steps: LayerSteps) -> tuple[Tensor | None, ...]:
    """The padded forward itself, the program's walk over only device tensors and Python constants, so it can be
    captured: (the last stream, the logits or None, the stream at each of the program's cuts)."""
    rows, L = key.rows, stack.num_layers
    W = key.extra + rows
    inputs = hidden  # (rows, d): the static forward's own input buffer
    positions = meta[:rows]  # (rows,)
    window_starts = meta[rows:rows + L]  # (L,)
    window = meta[rows + L:].view(rows, W).bool()  # (rows, W)
    cos, sin = stack.rope(positions)  # K x (rows, 1, D) each: one per RoPE table
    slots = torch.arange(cache.capacity, device=hidden.device)  # (C,)
    offsets = key.extra + torch.arange(rows, device=hidden.device)  # (rows,): new rows' window columns
    groups = stack.spec.num_heads // stack.spec.num_kv_heads
    leaders = iter(key.groups)
    masks: dict[int, Tensor] = {}
    kept: list[Tensor] = []
    for item in program.walk:
        if type(item) is int:  # the input buffer itself is refilled by the next call: a stream kept there is copied
            kept.append(hidden.clone() if hidden is inputs else hidden)
            continue
        i, w = item.layer, stack.layers[item.layer]
        if item.attn:
            leader = next(leaders)
            if cache.pos is not None and stack.spec.window(i) is not None:  # the new rows' positions, per layer
                cache.pos[i].index_copy_(0, window_starts[i] + offsets, positions)
            if leader not in masks:  # (G rows, C): one additive mask per group of layers
                seen = _visible(window_starts[leader], window, slots)  # (rows, C)
                if stack.spec.window(leader) is not None:  # sliding: keys at (p - W, p] of each row's position p
                    seen = seen & near(positions, cache.pos[leader], stack.spec.window(leader))
                masks[leader] = group_mask(seen, groups, stack.dtype)
            r = stack.rope_rows[i]
            hidden = steps.attention(stack, w, hidden, cos[r], sin[r], window_starts[i], offsets, masks[leader],
                                     cache.k[i], cache.v[i], steps.compile)  # writes slots window_starts[i] + offsets
        if item.mlp:
            hidden = steps.mlp(stack, w, hidden, steps.compile)
    if hidden is inputs:  # no layer ran (a plan skipping every sublayer): the stream is the input buffer
        hidden = hidden.clone()
    return (hidden, stack.head(hidden, program.vocab) if key.logits else None, *kept)


def _visible(window_start: Tensor, window: Tensor, slots: Tensor) -> Tensor:
    """(rows, C) bool: the slots before the window, plus the window slots each row's mask allows."""
    W = window.shape[1]
    rel = slots - window_start  # (C,): slot index relative to the window
    inside = (rel >= 0) & (rel < W)  # (C,)
    return (window[:, rel.clamp(0, W - 1)] & inside) | (rel < 0)  # (rows, C)
