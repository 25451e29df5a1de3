"""A drafter's example options: what makes it draft on a given model, named in the drafter's own file.

Every registered drafter class has ``examples``: its options per variant worth running, the key ``""`` for its main
one (``"tree"``, ``"adapter"``, ... for others), as a classmethod ``examples(model: ExampleModel) -> dict[str, dict]``
or, where they do not depend on the model, as that dict itself. The registry
gathers them (``infer.drafters.registry.example_cases``), and every test that runs every drafter and the GPU check
take their drafters from there, so a drafter added to the registry with its examples is run by all of them;
``tests/test_architecture.py`` checks that no other list of drafters exists.

The options are for exercising a drafter (it drafts from the first cycles on a small random-init model: no
fallback gate, nothing remembered, confidence stops a random model's flat distributions pass), not for speed.
"""

from __future__ import annotations

from dataclasses import dataclass

from infer.model.plan import LayerPlan


@dataclass(frozen=True)
class ExampleModel:
    """The model a drafter's examples are for."""

    layers: int
    """Its decoder layers."""
    exit_layer: int | None = None
    """The exit that drafting from one layer starts at (None: a third of the way down, at least 1)."""
    plan: LayerPlan | str | None = None
    """A skip plan for it, as a drafter's ``plan`` option takes one (a ``LayerPlan`` or a plan file's path; None:
    ``default_plan``)."""
    adapter: str | None = None
    """An exit adapter file for it, where one exists: a drafter that takes one adds examples drafting through it."""

    @property
    def exit(self) -> int:
        """The exit of one-layer drafting (``exit_layer``, or a third of the way down)."""
        return self.exit_layer if self.exit_layer is not None else max(1, self.layers // 3)

    @property
    def skip_plan(self) -> LayerPlan | str:
        """The skip plan of plan-drafting examples (``plan``, or ``default_plan``)."""
        return self.plan if self.plan is not None else default_plan(self.layers)

    @property
    def exits(self) -> str:
        """Several exits, for drafters that choose among them (a sixth, half and all but one layer down)."""
        return "/".join(str(e) for e in sorted({max(1, self.layers // 6), max(1, self.layers // 2),
                                                max(1, self.layers - 1)}))


def default_plan(layers: int) -> LayerPlan:
    """Skip the attention of the layers a third and half of the way down and the MLP two thirds down (layers 2, 3
    and 4 of 6): a plan that drafts on any model of two or more layers."""
    return LayerPlan(layers, frozenset({layers // 3, layers // 2}), frozenset({(2 * layers) // 3}))
