"""What drafting costs on this model, this machine, this dtype and thread count: measured, never assumed.

A drafter's cost model needs three numbers in units of one plain step (the full model on one token, its final norm
and full LM head): c, one draft forward of one token (any draft forward: an early exit with its draft head, a skip
plan, an exit adapter, a quantized copy); v(T), one verification of T tokens; and the plain step itself. How they
relate depends on the model's shape (Gemma 3 270M's 262144-token head is 63% of a step's bytes, SmolLM2-135M's 21%),
the executor (the fused C++ span or the Python layer loop), the kernel and the machine, so ``measure_costs`` times
them against each other once: a short scratch context is prefilled, then rounds of a plain step, each draft forward
and each verification size, interleaved (drift on a shared machine hits all alike), the median of each round's ratio
kept. The result is kept in the toolkit cache, one record per model (architecture and weight fingerprint), device,
dtype, executor, kernel and thread count, holding v(T) and every draft forward timed so far by name (a name carries
what makes a forward differ: exit, head, dtype); a caller's forwards that the record lacks (or larger T) are timed
and added, so each is paid once (seconds) and a change of model, machine setting or draft measures again.

``plan_costs`` turns it into the ``infer.model.plan.CostModel`` of skip plans (SWIFT, Self-SD's search): a draft
with every sublayer skipped (embedding, final norm, the draft head), with every MLP skipped and with every attention
skipped give the base and each sublayer's price. ``exit_costs`` gives early exits' c_E. The drafters' online timing
(``infer.drafters.gate``) refines these once drafting runs; these are what they predict with before it has.
``realised_cost`` and ``CycleTiming`` are that refinement for dynamic exit: a cycle's cost by weight count as it
happened, and the measured seconds per unit of it against a plain step's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from infer.drafters.chain import EarlyExitForward, PlanForward
from infer.drafters.gate import Rate
from infer.model.kv_cache import KVCache
from infer.model.plan import CostModel, LayerPlan, cycle_speedup, iid_tokens_per_cycle, weights_cost
from infer.model.quant_weights import byte_share
from infer.model.runner import DraftHead, Runner
from layerskip_core import jsonfile
from layerskip_core.errors import UserError
from layerskip_core.packages import cache_root

COSTS_FORMAT = "layerskip-costs/1"
CONTEXT = 96
"""Tokens of the scratch context the forwards are timed after (attention's share at a typical early context)."""
ROUNDS = 5
"""Timed rounds (after one warm-up round); each quantity is the median of its per-round ratios."""
VERIFY_SIZES = (2, 4, 8, 16, 32, 64, 128, 256)
"""Verification sizes timed (up to the most a caller needs); others are interpolated linearly."""

COSTS = ("measured", "weights")
"""The values of ``CostsOption.costs``."""


@dataclass
class CostsOption:
    """The option of every drafter whose cost model decides whether and how to draft (its Config subclasses this)."""

    costs: str = "measured"
    """What the drafter's cost model prices a draft forward and a verification with before its own timing of
    drafting has: measured = this model's costs on this machine, dtype and thread count, timed once (seconds) and
    kept in the toolkit cache (infer.drafters.costs); weights = the share of the weights each reads, a verification
    of any size one step (deterministic; what every model was assumed to cost before)."""

    def __post_init__(self) -> None:
        if self.costs not in COSTS:
            raise UserError(f"costs must be one of {', '.join(COSTS)}, got {self.costs!r}")


DraftForward = Callable[[KVCache, Tensor, int], tuple[Tensor, Tensor]]
"""A draft forward: (cache, token (1,), position) -> (exact stream (1, d), logits (1, V)), as the chain loop calls
it (``infer.drafters.chain``); it may write the cache at ``position``, which is rolled back after each call."""


@dataclass(frozen=True)
class MeasuredCosts:
    """One plain step's seconds, and a verification's and each draft forward's cost in plain steps."""

    step_seconds: float
    """One plain step: the full model on one token after the scratch context (final norm and full LM head)."""
    verify: tuple[float, ...]
    """v(T) for T = 1, 2, ...: a full forward over T tokens, in plain steps (v(1) = 1)."""
    drafts: dict[str, float]
    """c of each draft forward, by name: one draft forward of one token, in plain steps."""
    where: str = ""
    """Where it is kept ('': not kept)."""

    def v(self, tokens: int) -> float:
        """v(T) (beyond the measured sizes: extended at the last measured slope)."""
        if tokens <= len(self.verify):
            return self.verify[max(tokens, 1) - 1]
        slope = self.verify[-1] - self.verify[-2] if len(self.verify) > 1 else 0.0
        return self.verify[-1] + slope * (tokens - len(self.verify))


def _interpolate(points: dict[int, float], top: int) -> tuple[float, ...]:
    """Values at 1..top, linear between the measured sizes (``points``: size -> value, 1 included)."""
    sizes = sorted(points)
    out = []
    for t in range(1, top + 1):
        hi = next((s for s in sizes if s >= t), sizes[-1])
        lo = max((s for s in sizes if s <= t), default=sizes[0])
        out.append(points[lo] if hi == lo else points[lo] + (points[hi] - points[lo]) * (t - lo) / (hi - lo))
    return tuple(out)


def _key(runner: Runner) -> dict:
    return {"format": COSTS_FORMAT, "model": runner.identity(), "device": str(runner.device),
            "dtype": str(runner.dtype), "executor": runner.executor, "kernel": str(getattr(runner, "kernel", "")),
            "threads": torch.get_num_threads(), "context": CONTEXT}


def costs_path(runner: Runner) -> Path:
    """Where the costs measured on ``runner`` (its model, device, dtype, executor, kernel, threads) are kept."""
    digest = hashlib.sha256(json.dumps(_key(runner), sort_keys=True, default=str).encode()).hexdigest()[:20]
    return cache_root() / "costs" / f"{digest}.json"


def _load(path: Path) -> MeasuredCosts | None:
    """What earlier commands measured on this runner; None when absent, or damaged (said in one line)."""
    if not path.exists():
        return None
    try:
        d = jsonfile.read(path, "measured costs", COSTS_FORMAT)
        with jsonfile.checked(path, "measured costs"):
            step = jsonfile.number(d["step_seconds"], "step_seconds", 1e-7, 1e4)
            verify = [jsonfile.number(v, "verify", 1.0, 1e4) for v in d["verify"]]
            drafts = {str(n): jsonfile.number(c, f"drafts.{n}", 0.0, 1e4) for n, c in jsonfile.obj(d["drafts"],
                                                                                                  "drafts").items()}
            if not verify or verify[0] != 1.0:
                raise ValueError("verify must start with v(1) = 1")
    except (UserError, KeyError) as e:
        what = e if isinstance(e, UserError) else f"{path} is not a valid measured costs file: no {e}"
        print(f"layerskip: warning: {what}; measuring again", file=sys.stderr)
        return None
    return MeasuredCosts(step, tuple(verify), drafts, str(path))


def _save(path: Path, costs: MeasuredCosts, runner: Runner) -> str:
    """Keep ``costs`` (a cache that cannot be written only costs measuring again next time)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"format": COSTS_FORMAT, "key": _key(runner), "step_seconds": costs.step_seconds,
                  "verify": list(costs.verify), "drafts": costs.drafts}
        jsonfile.write(path, json.dumps(record, default=str) + "\n")
        return str(path)
    except OSError as e:
        print(f"layerskip: note: could not keep the measured costs in {path} ({e.strerror})", file=sys.stderr)
        return ""


@torch.no_grad()
def _timed_rounds(runner: Runner, drafts: dict[str, DraftForward], sizes: list[int],
                  rounds: int) -> tuple[list[float], dict[str, list[float]]]:
    """Per timed round: the plain step's seconds, and every quantity's ratio to it ('v:T', 'c:name')."""
    cache = runner.new_cache(CONTEXT + max(sizes, default=1) + 8)
    ids = (torch.arange(CONTEXT, device=runner.device) * 7919 + 11) % runner.spec.vocab_size  # (n,) any tokens
    runner.forward(cache, ids)
    token = ids[-1:]  # (1,)

    def clock(run: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        run()
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        seconds = time.perf_counter() - t0
        cache.rollback(CONTEXT)
        return seconds

    steps, ratios = [], {f"v:{T}": [] for T in sizes} | {f"c:{n}": [] for n in drafts}
    for r in range(rounds + 1):
        step = clock(lambda: runner.forward(cache, token))
        times = {f"v:{T}": clock(lambda T=T: runner.forward(cache, token.repeat(T))) for T in sizes}
        times |= {f"c:{n}": clock(lambda f=f: f(cache, token, CONTEXT)) for n, f in drafts.items()}
        if r == 0:
            continue  # warm-up: allocations, first calls
        steps.append(step)
        for name, seconds in times.items():
            ratios[name].append(seconds / step)
    return steps, ratios


def _verify_curve(ratios: dict[str, list[float]], sizes: list[int], top: int) -> tuple[float, ...]:
    """v(1..top) from the timed sizes: medians, at least 1 and never falling as T grows (verifying more tokens
    reads the same weights and computes more; a dip is noise), linear between the sizes."""
    curve, floor = {1: 1.0}, 1.0
    for T in sorted(sizes):
        if T > 1:
            floor = max(floor, statistics.median(ratios[f"v:{T}"]))
            curve[T] = floor
    return _interpolate(curve, top)


def measure_costs(runner: Runner, drafts: dict[str, DraftForward], max_tokens: int, rounds: int = ROUNDS,
                  keep: bool = True, log: Callable[[str], None] | None = None) -> MeasuredCosts:
    """c of each draft forward (``drafts``: name -> forward; a name must say what makes the forward differ, as
    its exit, head and dtype) and v(T) for T = 1..``max_tokens``, in plain steps of ``runner``'s model, timed against
    each other (module docstring). ``keep``: read and extend the toolkit cache's record for this runner (its model,
    device, dtype, executor, kernel and threads): only what it lacks is timed."""
    path = costs_path(runner)
    kept = _load(path) if keep else None
    have = kept.drafts if kept else {}
    missing = {n: f for n, f in drafts.items() if n not in have}
    sizes = [] if kept and len(kept.verify) >= max_tokens else \
        sorted({T for T in VERIFY_SIZES if T < max_tokens} | {max_tokens})
    if not missing and not sizes:
        return kept
    t0 = time.perf_counter()
    steps, ratios = _timed_rounds(runner, missing, sizes, rounds)
    verify = _verify_curve(ratios, sizes, max_tokens) if sizes else kept.verify
    measured = {n: statistics.median(ratios[f"c:{n}"]) for n in missing}
    costs = MeasuredCosts(statistics.median(steps), verify, have | measured)
    where = _save(path, costs, runner) if keep else ""
    seconds = time.perf_counter() - t0
    (log or _stderr)(f"layerskip: measured this model's draft and verification costs once ({seconds:.1f} s"
                     f"{', kept in ' + where if where else ''}): plain step {costs.step_seconds * 1e3:.1f} ms"
                     + "".join(f", c({n}) {c:.3f}" for n, c in measured.items())
                     + (f", v({max_tokens}) {verify[max_tokens - 1]:.2f}" if sizes else ""))
    return dataclasses.replace(costs, where=where)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def head_name(head: DraftHead | None) -> str:
    """What names a draft head in a draft forward's name: its rows and dtype (None: the full head)."""
    return "full" if head is None else f"{head.size}rows-{str(head.linear.dtype).removeprefix('torch.')}"


def plan_costs(runner: Runner, head: DraftHead | None, max_tokens: int, keep: bool = True,
               drafting: Runner | None = None, quant: str | None = None) -> tuple[CostModel, MeasuredCosts]:
    """The measured ``CostModel`` of skip-plan drafts with ``head`` (its draft's head share is already in ``base``:
    ``CostModel.draft(plan)`` with the default head share of 1), and the measurement (a plain step's seconds).
    ``drafting``: the layers the drafts run when not ``runner``'s own (a quantized copy, named by ``quant``)."""
    L = runner.num_layers
    every = frozenset(range(L))
    plans = {"nothing": LayerPlan(L, every, every), "no_mlp": LayerPlan(L, frozenset(), every),
             "no_attn": LayerPlan(L, every, frozenset())}
    tag = head_name(head) + (f"-{quant}" if quant else "")
    exact = drafting is None
    forwards = {f"plan-{n}-{tag}": PlanForward(drafting or runner, p, head, exact) for n, p in plans.items()}
    costs = measure_costs(runner, forwards, max_tokens, keep=keep)
    base, no_mlp, no_attn = (costs.drafts[f"plan-{n}-{tag}"] for n in plans)
    attn, mlp = max(no_mlp - base, 0.0) / L, max(no_attn - base, 0.0) / L
    return CostModel(base, attn, mlp, list(costs.verify[:max_tokens]), "measured"), costs


def exit_costs(runner: Runner, exits: list[int], head: DraftHead | None, max_tokens: int,
               keep: bool = True, drafting: Runner | None = None,
               quant: str | None = None) -> tuple[dict[int, float], MeasuredCosts]:
    """c_E of an early exit's draft forward (layers [0, E), the final norm and ``head``) for each E of ``exits``, and
    the measurement (its v(T)). ``drafting``: the layers the draft runs when not ``runner``'s own (a quantized copy,
    named by ``quant``: int8 / int4), over ``runner``'s cache."""
    tag = head_name(head) + (f"-{quant}" if quant else "")
    exact = drafting is None
    forwards = {f"exit{e}-{tag}": EarlyExitForward(drafting or runner, e, head, exact) for e in exits}
    costs = measure_costs(runner, forwards, max_tokens, keep=keep)
    return {e: costs.drafts[f"exit{e}-{tag}"] for e in exits}, costs


@dataclass(frozen=True)
class PlanPrices:
    """What a skip-plan drafter (SWIFT) expects drafting to cost before its own timing has: a draft under a plan and
    a verification of T tokens, in plain steps."""

    cost: CostModel
    """Base, per-sublayer and verification costs."""
    head_share: float
    """The draft head's share of the LM head to apply at ``CostModel.draft`` (1 where ``base`` is measured with it)."""
    step_seconds: float | None
    """A plain step's measured seconds (None: priced by weights)."""
    byte_share: float = 1.0
    """By weights, a quantized draft's bytes per weight over the model's (``byte_share``); 1 where measured."""

    def speedup(self, plan: LayerPlan, acceptance: float, depth: int) -> float:
        """max over k <= ``depth`` of M(a, k) / (k c + v): measured v(k + 1), or v = 1 by weights (an optimistic
        bound: a verification costs at least a plain step)."""
        c = self.cost.draft(plan, self.head_share) * self.byte_share
        return max(cycle_speedup(iid_tokens_per_cycle(acceptance, k), k, c,
                                 1.0 if self.step_seconds is None else self.cost.verify_cost(k + 1))
                   for k in range(1, depth + 1))

    def seconds(self, tokens: int) -> float:
        """What a forward over ``tokens`` rows (a plan scored on a window) is expected to take; 0 by weights."""
        return 0.0 if self.step_seconds is None else self.cost.verify_cost(tokens) * self.step_seconds


def plan_prices(runner: Runner, head: DraftHead | None, max_tokens: int, measured: bool,
                drafting: Runner | None = None, quant: str | None = None) -> PlanPrices:
    """A skip-plan drafter's prices with ``head``: measured (``plan_costs``; ``drafting``/``quant``: a quantized copy
    drafts, its forwards timed), or by the weights each reads (the head's share of the LM head applied at ``draft``,
    a quantized draft's at its bytes per weight)."""
    if measured:
        cost, costs = plan_costs(runner, head, max_tokens, drafting=drafting, quant=quant)
        return PlanPrices(cost, 1.0, costs.step_seconds)
    share = 1.0 if head is None else head.size / runner.spec.vocab_size
    return PlanPrices(weights_cost(runner.spec, max_tokens), share, None, byte_share(quant, runner.dtype))


@dataclass(frozen=True)
class ExitPrices:
    """An early exit's prices (dynamic exit's cost model), in plain steps: a draft forward at E, the first row of a
    verification that reuses the draft's layers below E (layers [E, L) and the full head), each further row."""

    draft: dict[int, float]
    """c_E: layers [0, E), the final norm and the draft head, one token."""
    verify: dict[int, float]
    """v_E: one verified row that runs only layers [E, L) and the full head."""
    slope: float
    """Each verified row beyond the first: (v(k + 1) - 1) / k at the largest k."""


def measured_exit_prices(runner: Runner, exits: list[int], head: DraftHead | None, max_draft: int,
                         drafting: Runner | None = None, quant: str | None = None) -> ExitPrices:
    """``ExitPrices`` of ``exits`` measured on ``runner`` (``exit_costs``; layer 1 and L - 1 too, whose difference
    prices one layer: the share of a step the reused layers below E save a verification). ``drafting``/``quant``: a
    quantized copy drafts (its forwards timed); its rows are not exact, so a verification reuses nothing (v_E = 1)."""
    L = runner.num_layers if drafting is None else drafting.num_layers  # a copy holds layers [0, its deepest exit)
    ends = sorted({1, max(L - 1, 1), *exits})
    c, costs = exit_costs(runner, ends, head, max_draft + 1, drafting=drafting, quant=quant)
    layer = (c[ends[-1]] - c[1]) / (ends[-1] - 1) if ends[-1] > 1 else 0.0
    verify = {e: 1.0 if drafting is not None else max(1.0 - e * max(layer, 0.0), 0.05) for e in exits}
    return ExitPrices({e: c[e] for e in exits}, verify, max(costs.v(max_draft + 1) - 1.0, 0.0) / max_draft)


# --------------------------------------------------------------------------- by weights (costs=weights)
def exit_prices(spec, exits: list[int], draft_rows: int, shares: tuple[float, float] = (1.0, 1.0)) -> dict[int, float]:
    """Each exit's draft forward as a fraction of a plain step: the weights it reads (E layers and a head of
    ``draft_rows`` rows, each scaled by its bytes per weight over the model's: ``shares``, a quantized draft's
    ``byte_share`` of layers and head) over a plain step's (L layers and the full head); decoding one token is bound
    by them."""
    layer, step = _weights(spec)
    return {e: (e * layer * shares[0] + draft_rows * spec.hidden_size * shares[1]) / step for e in exits}


def verify_prices(spec, exits: list[int], reuse: bool = True) -> dict[int, float]:
    """Each exit's verification (its first row) as a fraction of a plain step: layers [E, L) and the full head,
    since the draft computed the rows' exact KV and stream below E (LayerSkip's reuse); without ``reuse`` (a quantized
    draft: nothing exact) a whole step."""
    layer, step = _weights(spec)
    return {e: ((spec.num_layers - (e if reuse else 0)) * layer + spec.vocab_size * spec.hidden_size) / step
            for e in exits}


def _weights(spec) -> tuple[int, int]:
    """A decoder layer's weight count (attention and MLP, norms included, per family: ``ModelSpec.sublayer_weights``)
    and a plain step's (every layer and the LM head)."""
    layer = sum(spec.sublayer_weights())
    return layer, spec.num_layers * layer + spec.vocab_size * spec.hidden_size


class CycleTiming:
    """Measured cost of drafting: seconds per unit of the cost model's price (plain steps by weight count: the draft
    forwards, the verification and its rows, as a cycle realised them; ``realised_cost``) over a plain step's seconds,
    once both were timed ``MIN_TIMED`` times; 1 before. Weight counts miss what each call costs besides reading
    weights (Python, the sampler, kernel launches, a confidence stop's host reads); this ratio folds that into the
    prediction of every drafting choice, so a chain that stops at once is not taken for as cheap as a plain step."""

    MIN_TIMED = 2
    BOUNDS = (0.5, 3.0)

    def __init__(self, weight: float = 0.2):
        self.drafted, self.plain = Rate(weight), Rate(weight)

    def cycle(self, seconds: float, cost: float) -> None:
        """A drafted cycle took ``seconds`` for a realised cost of ``cost`` plain steps by weight count."""
        if cost > 0:
            self.drafted.add(cost, seconds)  # "tokens" = cost units

    def plain_step(self, seconds: float) -> None:
        """A plain step took ``seconds``."""
        self.plain.add(1, seconds)

    def scale(self) -> float:
        """Measured over weight-count cost of drafting (1 until timed)."""
        if min(self.drafted.cycles, self.plain.cycles) < self.MIN_TIMED:
            return 1.0
        ratio = self.plain.value / self.drafted.value  # (steps/s) / (cost units/s)
        return min(max(ratio, self.BOUNDS[0]), self.BOUNDS[1])


def realised_cost(price: float, verify: float, slope: float, forwards: int, proposed: int) -> float:
    """What a cycle cost by weight count, in plain steps (``predicted_speedup``'s denominator as it happened):
    ``forwards`` draft forwards at ``price`` each, a verification of ``proposed`` + 1 rows that reuses the draft's
    layers below E (``verify``) unless the last proposal had no draft forward of its own (nothing stopped the chain:
    it needs every layer, about a plain step)."""
    every = forwards == proposed  # the chain did not stop on confidence
    return price * forwards + verify + (1 - verify) * every + slope * verify * proposed
