"""Skip plans: which sublayers of the model run, the unit every layer-skipping drafter works with.

One home for what `layerskip search` (Self-SD's offline search) and SWIFT's online optimiser share:

- ``LayerPlan`` and plan files (``PlanFile``);
- the search space (``PlanSpace``: one optuna encoding of the 2L skip choices) and uniform plans
  (``uniform_plan``: skips spread evenly over the inner layers);
- one cost model of draft-verify decoding (``CostModel``, ``iid_tokens_per_cycle``,
  ``cycle_speedup``, ``weights_cost``), used by the search, SWIFT's fallback prediction and the bench.

The agreement scorers, which run the model, live in ``infer.drafters.skipping``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from core.errors import UserError

if TYPE_CHECKING:  # infer.runner imports this module
    from infer.runner import Runner


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
        object.__setattr__(self, "skip_attn", frozenset(int(i) for i in self.skip_attn))
        object.__setattr__(self, "skip_mlp", frozenset(int(i) for i in self.skip_mlp))
        bad = sorted(i for i in self.skip_attn | self.skip_mlp if not 0 <= i < self.num_layers)
        if bad:
            raise ValueError(f"layer indices {bad} out of range for a {self.num_layers}-layer model")

    @classmethod
    def full(cls, num_layers: int) -> LayerPlan:
        """The plan that runs everything."""
        return cls(num_layers)

    @classmethod
    def from_mask(cls, attn_skip: list[bool], mlp_skip: list[bool]) -> LayerPlan:
        """Build from two per-layer boolean lists (True = skip)."""
        if len(attn_skip) != len(mlp_skip):
            raise ValueError("attn and mlp masks must have one entry per layer")
        return cls(len(attn_skip), frozenset(i for i, s in enumerate(attn_skip) if s),
                   frozenset(i for i, s in enumerate(mlp_skip) if s))

    def to_mask(self) -> tuple[list[bool], list[bool]]:
        """Two per-layer boolean lists (True = skip), attention first."""
        return ([i in self.skip_attn for i in range(self.num_layers)],
                [i in self.skip_mlp for i in range(self.num_layers)])

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
        return cls(int(d["num_layers"]), frozenset(d.get("skip_attn", ())), frozenset(d.get("skip_mlp", ())))

    def describe(self) -> str:
        attn = ",".join(map(str, sorted(self.skip_attn))) or "-"
        mlp = ",".join(map(str, sorted(self.skip_mlp))) or "-"
        return f"skip attn[{attn}] mlp[{mlp}] ({self.skip_ratio:.0%} of sublayers)"


PLAN_FORMAT = "layerskip-plan/1"


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

    def to_dict(self) -> dict:
        return {"format": PLAN_FORMAT, "source": self.source, "model": self.model, "task": self.task,
                "plan": self.plan.to_dict(), "skip_ratio": self.plan.skip_ratio, "objective": self.objective,
                "search": self.search}

    def save(self, path) -> None:
        """Write atomically (a temporary file renamed into place)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path) -> PlanFile:
        """Read and validate a plan file; anything wrong is one UserError naming the file."""
        path = Path(path).expanduser()
        if not path.is_file():
            raise UserError(f"plan file {path} does not exist (create one with `layerskip search` or "
                            "`layerskip plan import`)")
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(d, dict):
                raise ValueError(f"it holds a JSON {type(d).__name__}, not an object")
            if d.get("format") != PLAN_FORMAT:
                raise ValueError(f"format is {d.get('format')!r}, expected {PLAN_FORMAT!r}")
            for key, kind in (("plan", dict), ("model", dict)):
                if not isinstance(d.get(key), kind):
                    raise ValueError(f"{key!r} must be an object, got {type(d.get(key)).__name__}")
            return cls(LayerPlan.from_dict(d["plan"]), d["model"], str(d.get("task", "")), d.get("objective"),
                       d.get("search"), str(d.get("source", "")))
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{path} is not a valid plan file: {e}") from None
        except OSError as e:
            raise UserError(f"cannot read plan file {path}: {e.strerror}") from None

    def check_model(self, identity: dict, path: str = "the plan") -> None:
        """Refuse a plan made for another model (architecture or weights differ)."""
        diff = {k: (self.model.get(k), v) for k, v in identity.items() if self.model.get(k) != v}
        if diff:
            what = ", ".join(f"{k}: plan has {a}, model has {b}" for k, (a, b) in diff.items())
            raise UserError(f"{path} was made for another model ({what}); search a plan for this model with "
                            "`layerskip search`")


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

    def draft(self, plan: LayerPlan) -> float:
        L = plan.num_layers
        return self.base + (L - len(plan.skip_attn)) * self.attn + (L - len(plan.skip_mlp)) * self.mlp

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


def weights_cost(runner: Runner, max_tokens: int) -> CostModel:
    """Memory-bound costs: proportional to the weights each part reads; verification costs one forward.

    Attention reads its q, k, v and o projections, the MLP 3·d·I, the LM head V·d.
    """
    s = runner.spec
    attn = s.hidden_size * (s.num_heads + 2 * s.num_kv_heads) * s.head_dim + s.num_heads * s.head_dim * s.hidden_size
    mlp = 3 * s.hidden_size * s.intermediate_size
    head = s.vocab_size * s.hidden_size
    full = s.num_layers * (attn + mlp) + head
    return CostModel(head / full, attn / full, mlp / full, [1.0] * max_tokens, "weights")
