"""Which sublayers of the model run: the unit every layer-skipping drafter works with."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from core.errors import UserError


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
