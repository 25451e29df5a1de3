"""Skip plans: which sublayers of the model run, the unit every layer-skipping drafter works with.

One home for what `layerskip search` (Self-SD's offline search) and SWIFT's online optimiser share:

- ``LayerPlan`` and plan files (``PlanFile``);
- the search space (``PlanSpace``: one optuna encoding of the 2L skip choices), uniform plans
  (``uniform_plan``: skips spread evenly over the inner layers) and SWIFT's odd-layer start (``odd_inner_plan``);
- one cost model of draft-verify decoding (``CostModel``, ``iid_tokens_per_cycle``,
  ``cycle_speedup``, ``weights_cost``), used by the search, SWIFT's fallback prediction and the bench.

The agreement scorers, which run the model, live in ``infer.drafters.skipping``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from layerskip_core import inputs, jsonfile
from layerskip_core.cli import check_output_file
from layerskip_core.errors import UserError
from layerskip_core.jsonfile import integer, integers
from layerskip_core.models import ModelSpec


@dataclass(frozen=True)
class LayerPlan:
    """A sublayer skip set over ``num_layers`` decoder layers.

    A skipped attention or MLP sublayer is replaced by the identity on the residual stream
    (its residual branch contributes nothing). Early exit is not expressed here: the runner
    takes a layer range, so ``LayerPlan`` stays about sublayers only.
    """

    num_layers: int
    """Number of decoder layers of the model the plan is for."""
    skip_attn: frozenset[int] = frozenset()
    """Indices of layers whose attention sublayer is skipped."""
    skip_mlp: frozenset[int] = frozenset()
    """Indices of layers whose MLP sublayer is skipped."""

    def __post_init__(self) -> None:
        """Refuse booleans, fractions and out-of-range indices (ValueError) rather than rounding them."""
        integer(self.num_layers, "num_layers", 1)
        for name in ("skip_attn", "skip_mlp"):
            values = getattr(self, name)
            if isinstance(values, str | bytes) or not hasattr(values, "__iter__"):
                raise ValueError(f"{name} must be a set of layer indices, not {type(values).__name__}")
            indices = [integer(i, f"{name} index", 0) for i in values]
            object.__setattr__(self, name, frozenset(indices))
        bad = sorted(i for i in self.skip_attn | self.skip_mlp if not 0 <= i < self.num_layers)
        if bad:
            raise ValueError(f"layer indices {bad} out of range for a {self.num_layers}-layer model")

    @classmethod
    def full(cls, num_layers: int) -> LayerPlan:
        """The plan that runs everything."""
        return cls(num_layers)

    @property
    def num_skipped(self) -> int:
        return len(self.skip_attn) + len(self.skip_mlp)

    @property
    def skip_ratio(self) -> float:
        """Fraction of the 2L sublayers that are skipped."""
        return self.num_skipped / (2 * self.num_layers)

    @property
    def is_full(self) -> bool:
        return self.num_skipped == 0

    @property
    def exact_prefix(self) -> int:
        """Number of leading layers that skip nothing: their KV, and the hidden state entering the
        first layer after them, are exactly the full model's (a draft hands both to verification)."""
        return min(self.skip_attn | self.skip_mlp, default=self.num_layers)

    def to_dict(self) -> dict:
        return {"num_layers": self.num_layers, "skip_attn": sorted(self.skip_attn),
                "skip_mlp": sorted(self.skip_mlp)}

    @classmethod
    def from_dict(cls, d: dict) -> LayerPlan:
        unknown = set(d) - {"num_layers", "skip_attn", "skip_mlp"}
        if unknown:
            raise ValueError(f"unknown plan keys {sorted(unknown)}")
        return cls(integer(d["num_layers"], "num_layers", 1), integers(d.get("skip_attn", []), "skip_attn"),
                   integers(d.get("skip_mlp", []), "skip_mlp"))

    def describe(self) -> str:
        attn = ",".join(map(str, sorted(self.skip_attn))) or "-"
        mlp = ",".join(map(str, sorted(self.skip_mlp))) or "-"
        return f"skip attn[{attn}] mlp[{mlp}] ({self.skip_ratio:.0%} of sublayers)"


PLAN_FORMAT = "layerskip-plan/1"
MAKE_ONE = "make one with `layerskip search` or `layerskip plan import`"
FULL_HEAD = "full"
"""``PlanFile.draft_head['vocab']`` of a plan found drafting with the full LM head."""


def head_record(head) -> dict:
    """What a plan file records of the draft head a plan was found (and is to be drafted) with: the full head, or the
    ids of a reduced-vocabulary head (``infer.model.runner.DraftHead``, or None for the full head; a head over every
    id, a quantized draft's copy of the full head, is the full head)."""
    if head is None or head.size == head.vocab_size:
        return {"vocab": FULL_HEAD}
    return {"vocab": head.size, "ids": [int(i) for i in head.ids.tolist()]}


@dataclass
class PlanFile:
    """A skip plan on disk, tied to the model it was found for (shared by self_sd and swift)."""

    plan: LayerPlan
    """The sublayer skip set."""
    model: dict
    """Identity of the model (``Runner.identity()``): architecture numbers and a weight fingerprint."""
    task: str = ""
    """What the plan was searched on (data name), e.g. 'humaneval'."""
    objective: dict | None = None
    """Name and value of the search objective, e.g. {'name': 'speed', 'value': 1.31}."""
    search: dict | None = None
    """Search settings and statistics (sampler, trials, seed, wall time, ...)."""
    source: str = ""
    """Which tool wrote it: 'self_sd' search or a 'swift' stream."""
    draft_head: dict | None = None
    """The draft head the plan was scored with (``head_record``); None in files that predate the record."""

    @property
    def draft_ids(self) -> list[int] | None:
        """The token ids of the recorded reduced-vocabulary head; None for the full head or no record."""
        return None if self.draft_head is None else self.draft_head.get("ids")

    def to_dict(self) -> dict:
        return {"format": PLAN_FORMAT, "source": self.source, "model": self.model, "task": self.task,
                "plan": self.plan.to_dict(), "skip_ratio": self.plan.skip_ratio, "objective": self.objective,
                "search": self.search, "draft_head": self.draft_head}

    def save(self, path) -> None:
        """Write atomically (a temporary file renamed into place); a head's id list stays on one line."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        d = self.to_dict()
        ids = (d["draft_head"] or {}).get("ids")
        if ids is not None:
            d["draft_head"] = d["draft_head"] | {"ids": "@ids@"}
        text = json.dumps(d, indent=2)
        if ids is not None:
            text = text.replace('"@ids@"', json.dumps(ids, separators=(",", ":")))
        jsonfile.write(path, text + "\n")  # a temporary file of its own: concurrent savers never mix

    @classmethod
    def load(cls, path) -> PlanFile:
        """Read and validate a plan file; anything wrong is one UserError naming the file."""
        d = jsonfile.read(path, "plan file", PLAN_FORMAT, MAKE_ONE)
        with jsonfile.checked(path, "plan file", MAKE_ONE):
            plan = LayerPlan.from_dict(jsonfile.obj(d["plan"], "'plan'"))
            for key in ("objective", "search"):
                if d.get(key) is not None:
                    jsonfile.obj(d[key], repr(key))
            return cls(plan, jsonfile.obj(d["model"], "'model'"), jsonfile.text(d.get("task", ""), "'task'"),
                       d.get("objective"), d.get("search"), jsonfile.text(d.get("source", ""), "'source'"),
                       _draft_head(d.get("draft_head")))

    def check_model(self, identity: dict, path: str = "the plan") -> None:
        """Refuse a plan made for another model (architecture or weights differ) or another depth."""
        diff = {k: (self.model.get(k), v) for k, v in identity.items() if self.model.get(k) != v}
        if diff:
            what = ", ".join(f"{k}: plan has {a}, model has {b}" for k, (a, b) in diff.items())
            raise UserError(f"{path} was made for another model ({what}); search a plan for this model with "
                            "`layerskip search`")
        check_depth(self.plan, identity["num_layers"], path)


def check_depth(plan: LayerPlan, num_layers: int, what: str = "the plan") -> None:
    """Refuse a plan for another number of layers than the model's ``num_layers``."""
    if plan.num_layers != num_layers:
        raise UserError(f"{what} is a plan for {plan.num_layers} layers; the model has {num_layers} "
                        "(search a plan for this model with `layerskip search`)")


def check_plan_option(plan, drafter: str) -> None:
    """Before any model loads: ``plan`` is a LayerPlan, or the path of an existing file (not a folder)."""
    if isinstance(plan, LayerPlan):
        return
    if not isinstance(plan, str | os.PathLike):
        raise UserError(f"{drafter}: plan must be the path of a plan file or a LayerPlan, not {type(plan).__name__}")
    path = Path(plan).expanduser()
    if path.is_dir():
        raise UserError(f"{drafter}: plan {path} is a folder; give the path of a plan file (.json) inside it")
    try:
        inputs.check(path, "plan file", MAKE_ONE)  # exists, and is no FIFO, device or socket
    except UserError as e:
        raise UserError(f"{drafter}: {e}") from None


def check_save_plan_option(path: str | None) -> None:
    """Before decoding: ``save_plan`` (None = not asked for) names a file that can be written (not a folder, not in
    an unwritable place); an existing file is written over, as the Python API asks."""
    if path:
        check_output_file(path, "--save-plan", force=True)


def plan_for(plan, identity: dict) -> LayerPlan:
    """The plan to run on the model of ``identity``: a LayerPlan as given, or a plan file read and refused unless it
    was made for this model; either refused when made for another depth."""
    if isinstance(plan, LayerPlan):
        check_depth(plan, identity["num_layers"])
        return plan
    plan_file = PlanFile.load(plan)
    plan_file.check_model(identity, str(plan))
    return plan_file.plan


def _draft_head(d) -> dict | None:
    """A plan file's ``draft_head`` checked: None, the full head, or N distinct ids."""
    if d is None:
        return None
    if not isinstance(d, dict) or "vocab" not in d:
        raise ValueError("'draft_head' must be an object with a 'vocab' entry")
    if d["vocab"] == FULL_HEAD:
        return {"vocab": FULL_HEAD}
    ids = integers(d.get("ids", []), "'draft_head' ids", 0)
    if not ids or len(set(ids)) != d["vocab"]:
        raise ValueError("'draft_head' must list its 'vocab' distinct non-negative token 'ids'")
    return {"vocab": len(ids), "ids": ids}


# --------------------------------------------------------------------------- search space
WARM_RATIOS = (0.15, 0.3, 0.45)
"""Skip ratios of the uniform plans that warm-start a search free to choose how many sublayers to skip."""


def _spread(m: int, n: int) -> list[int]:
    """n indices evenly spread over range(m) (centred: the i-th is int((i + 1/2)·m/n))."""
    return sorted({min(m - 1, int((i + 0.5) * m / n)) for i in range(n)})


def inner_layers(num_layers: int) -> list[int]:
    """Layers 1..L-2: the first and last layer are kept by uniform plans and by SWIFT (all layers when L < 3)."""
    return list(range(1, num_layers - 1)) or list(range(num_layers))


def uniform_plan(num_layers: int, n_skip: int, kinds: tuple[str, ...] = ("attn", "mlp")) -> LayerPlan:
    """``n_skip`` sublayers of ``kinds`` spread evenly over layers 1..L-2, in the interleaved order
    attn 1, mlp 1, attn 2, ... (all of them when there are fewer than ``n_skip``)."""
    slots = [(kind, layer) for layer in inner_layers(num_layers) for kind in kinds]
    chosen = [slots[j] for j in _spread(len(slots), min(n_skip, len(slots)))]
    return LayerPlan(num_layers, frozenset(i for kind, i in chosen if kind == "attn"),
                     frozenset(i for kind, i in chosen if kind == "mlp"))


def odd_inner_plan(num_layers: int) -> LayerPlan:
    """Attention and MLP of every odd layer 1, 3, 5, ... below L-1: SWIFT's starting plan (its evaluation code
    initialises the skip set to ``range(1, L - 1, 2)`` for both sublayer kinds, whatever the skip ratio)."""
    odd = frozenset(range(1, num_layers - 1, 2))
    return LayerPlan(num_layers, odd, odd)


class PlanSpace:
    """The skip choices as optuna parameters ``attn.<l>`` / ``mlp.<l>`` (True = skip): the one encoding of
    `layerskip search` (every layer, any number of skips or exactly round(skip_ratio·2L)) and of SWIFT's online
    optimiser (``keep_ends``: layers 1..L-2 only, exactly ``n_skip``).

    With an exact count the sampler still proposes a yes/no per sublayer, and a deterministic repair adds
    skips (inner deep layers first) or drops them (shallow layers first) until the count is right, so
    the plan stays a function of the proposal.
    """

    def __init__(self, num_layers: int, skip_ratio: float | None = None, *, keep_ends: bool = False,
                 n_skip: int | None = None):
        self.num_layers = num_layers
        self.layers = inner_layers(num_layers) if keep_ends else list(range(num_layers))
        self.names = [f"attn.{i}" for i in self.layers] + [f"mlp.{i}" for i in self.layers]
        if n_skip is None and skip_ratio is not None:
            n_skip = round(skip_ratio * 2 * num_layers)
            if not 1 <= n_skip <= len(self.names) - 1:
                raise UserError(f"--skip-ratio {skip_ratio} skips {n_skip} of the {2 * num_layers} sublayers; "
                                "choose a ratio that skips at least one and not all")
        if n_skip is not None and not 1 <= n_skip <= len(self.names):
            raise ValueError(f"cannot skip {n_skip} of {len(self.names)} sublayers")
        self.n_skip = n_skip

    def distributions(self) -> dict:
        """The optuna distribution of every parameter (for ``study.ask`` and ``create_trial``)."""
        import optuna  # optional and slow to import: only optimisers need it

        return {name: optuna.distributions.CategoricalDistribution([False, True]) for name in self.names}

    def suggest(self, trial) -> LayerPlan:
        """The plan of an optuna trial inside ``study.optimize``."""
        return self.decode({name: trial.suggest_categorical(name, [False, True]) for name in self.names})

    def decode(self, params: dict) -> LayerPlan:
        """The plan of a parameter set (repaired to exactly ``n_skip`` skips when the count is fixed)."""
        skip = [bool(params[name]) for name in self.names]
        if self.n_skip is not None:
            skip = self._repair(skip)
        chosen = {name for name, s in zip(self.names, skip, strict=True) if s}
        return LayerPlan(self.num_layers, frozenset(i for i in self.layers if f"attn.{i}" in chosen),
                         frozenset(i for i in self.layers if f"mlp.{i}" in chosen))

    def _repair(self, skip: list[bool]) -> list[bool]:
        """Add or drop skips until exactly ``n_skip``: add in inner deep layers first, drop in shallow ones first."""
        L, n = self.num_layers, len(self.layers)
        where = {layer: p for p, layer in enumerate(self.layers)}
        deep_first = dict.fromkeys(list(range(L - 2, 0, -1)) + [L - 1, 0])  # first and last layers at the end
        order = [j for layer in deep_first if layer in where for j in (where[layer], n + where[layer])]
        skip = list(skip)
        extra = sum(skip) - self.n_skip
        for j in order if extra < 0 else order[::-1]:
            if extra < 0 and not skip[j]:
                skip[j], extra = True, extra + 1
            elif extra > 0 and skip[j]:
                skip[j], extra = False, extra - 1
            if extra == 0:
                break
        return skip

    def params(self, plan: LayerPlan) -> dict:
        """optuna parameters that make ``suggest``/``decode`` return ``plan`` (enqueued or told trials)."""
        return ({f"attn.{i}": i in plan.skip_attn for i in self.layers}
                | {f"mlp.{i}": i in plan.skip_mlp for i in self.layers})

    def uniform_plans(self) -> list[LayerPlan]:
        """Warm starts: skips spread evenly over layers 1..L-2 (attention+MLP, attention only, MLP only)."""
        L = self.num_layers
        ratios = WARM_RATIOS if self.n_skip is None else (self.n_skip / (2 * L),)
        plans: list[LayerPlan] = []
        for r in ratios:
            n = self.n_skip if self.n_skip is not None else max(1, round(r * 2 * L))
            shapes = [("attn", "mlp")] + ([("attn",), ("mlp",)] if n <= len(inner_layers(L)) else [])
            for kinds in shapes:
                plan = uniform_plan(L, n, kinds)
                if self.n_skip is not None and plan.num_skipped != self.n_skip:
                    continue
                if plan not in plans and not plan.is_full:
                    plans.append(plan)
        return plans


# --------------------------------------------------------------------------- costs
@dataclass
class CostModel:
    """Costs relative to one full single-token forward (final norm + LM head included)."""

    base: float
    """Embedding, final norm and LM head: what a draft costs with every sublayer skipped."""
    attn: float
    """One attention sublayer."""
    mlp: float
    """One MLP sublayer."""
    verify: list[float]
    """verify[T-1]: one full forward over T tokens (T = 1 .. k+1)."""
    source: str = "weights"
    """'measured' (timed before the search) or 'weights' (weights read)."""

    def draft(self, plan: LayerPlan, head_share: float = 1.0) -> float:
        """One draft forward under ``plan``; ``head_share``: the share of the LM head a reduced draft vocabulary
        scores (its ``base`` is taken as the head's)."""
        L = plan.num_layers
        return self.base * head_share + (L - len(plan.skip_attn)) * self.attn + (L - len(plan.skip_mlp)) * self.mlp

    def verify_cost(self, tokens: int) -> float:
        return self.verify[min(tokens, len(self.verify)) - 1]

    def to_dict(self) -> dict:
        return {"source": self.source, "base": round(self.base, 4), "attn": round(self.attn, 5),
                "mlp": round(self.mlp, 5), "verify": [round(v, 3) for v in self.verify]}


def iid_tokens_per_cycle(acceptance: float, k: int) -> float:
    """Expected tokens per draft-verify cycle of k drafts with i.i.d. per-token acceptance a (Leviathan et al.
    2023, Thm 3.8): (1 - a^(k+1)) / (1 - a), k + 1 when a = 1."""
    return k + 1.0 if acceptance >= 1.0 else (1 - acceptance ** (k + 1)) / (1 - acceptance)


def cycle_speedup(tokens_per_cycle: float, draft_forwards: float, draft_cost: float, verify_cost: float) -> float:
    """Speed-up of draft-verify cycles over plain steps: tokens per cycle / (f·c + v), costs in plain-step units.

    f draft forwards of cost c and a verification of cost v per cycle (means, or totals over many cycles:
    the ratio is the same). The one cost model of skip-plan drafting: the search's replay, SWIFT's
    fallback prediction and the bench's expected speed-up are all this ratio.
    """
    return tokens_per_cycle / (draft_forwards * draft_cost + verify_cost)


def weights_cost(s: ModelSpec, max_tokens: int) -> CostModel:
    """Memory-bound costs: proportional to the weights each part reads; verification costs one forward.

    Attention reads its q, k, v and o projections, the MLP 3·d·I (each with its family's norms:
    ``ModelSpec.sublayer_weights``), the LM head V·d.
    """
    attn, mlp = s.sublayer_weights()
    head = s.vocab_size * s.hidden_size
    full = s.num_layers * (attn + mlp) + head
    return CostModel(head / full, attn / full, mlp / full, [1.0] * max_tokens, "weights")
