"""Which sublayers of the model run: the unit every layer-skipping drafter works with."""

from __future__ import annotations

from dataclasses import dataclass


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
        """Number of leading layers whose KV and input hidden state equal the full model's.

        Layer ``l``'s attention input is exact iff no sublayer before it is skipped; its KV is
        written iff its attention runs. So the prefix ends at the first skipped attention, or
        one layer after the first skipped MLP, whichever comes first.
        """
        first_attn = min(self.skip_attn, default=self.num_layers)
        first_mlp = min(self.skip_mlp, default=self.num_layers) + 1
        return min(first_attn, first_mlp, self.num_layers)

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
