"""Every registered drafter, with options that make it draft on the GPU check's models: the one list each part of
the check (greedy identity, sampling, host syncs, per-shape costs) takes its drafters from."""

from __future__ import annotations

from pathlib import Path

from infer.drafters import DRAFTERS
from infer.model.plan import LayerPlan, PlanFile
from infer.model.runner import Runner

SWIFT_TREES = {"context_window": 4, "tree": True, "adaptive": False, "remember": "off"}
"""SWIFT settings that verify token trees from the first cycles (no fallback gate, nothing remembered)."""
SYNC_TARGETS = {
    "early_exit": ("per_cycle <= 1", lambda s: s["per_cycle"] <= 1.0),
    "self_sd": ("per_cycle <= draft_steps_per_cycle + 2", lambda s: s["per_cycle"] <= s["draft_steps_per_cycle"] + 2),
    "swift": ("per_cycle <= draft_steps_per_cycle + 2", lambda s: s["per_cycle"] <= s["draft_steps_per_cycle"] + 2),
}
"""Host syncs each drafter is held to (reported in the result; they do not fail the run)."""

Specs = dict[str, tuple[str, dict]]
"""key -> (registered drafter name, its options)."""


def registered_options(runner: Runner, plan: Path, E: int) -> dict[str, dict]:
    """Options that make every registered drafter draft (``infer.drafters.DRAFTERS``), drafting from exit ``E`` or
    under the skip plan file ``plan``; a drafter added to the registry without an entry here fails the check at
    once, so the GPU check never skips one."""
    options = {
        "autoregressive": {},
        "early_exit": {"exit_layer": E, "num_draft": 3},
        "dynamic_exit": {"exits": "/".join(str(x) for x in sorted({max(1, E // 2), E})), "num_draft": 3,
                         "min_speedup": 0, "adaptive": False,
                         "observe_every": 1, "calibrate": False},  # always drafts, choices from counts
        "self_sd": {"plan": str(plan), "num_draft": 4},
        "swift": dict(SWIFT_TREES),
    }
    missing = sorted(set(DRAFTERS) - set(options))
    if missing:
        raise RuntimeError(f"gpu_check has no drafting options for the registered drafter(s) {missing}: add them to "
                           "tools.gpu.drafters.registered_options")
    return options


def plan_file(runner: Runner, folder: Path, plan: LayerPlan) -> Path:
    """``plan`` saved as a plan file for ``runner``'s model in ``folder``."""
    path = folder / f"plan-{runner.fingerprint[:8]}.json"
    PlanFile(plan, runner.identity(), source="gpu_check").save(path)
    return path


def drafter_specs(runner: Runner, folder: Path, adapter: Path | None = None) -> Specs:
    """Every registered drafter but autoregressive, with settings that make it draft on a 4-layer model: self_sd
    gets a small plan file, swift verifies token trees, and early exit also drafts through ``adapter`` (an exit
    adapter file for this model) where one is given, as a chain and as a token tree."""
    L = runner.num_layers
    plan = plan_file(runner, folder, LayerPlan(L, skip_attn=frozenset({L - 2}), skip_mlp=frozenset({L - 1})))
    specs = {name: (name, options) for name, options in registered_options(runner, plan, L // 2).items()
             if name != "autoregressive"}
    if adapter is not None:
        specs["early_exit_adapter"] = ("early_exit", {"adapter": str(adapter), "num_draft": 3})
        specs["early_exit_adapter_tree"] = ("early_exit", {"adapter": str(adapter), "num_draft": 3, "tree": True,
                                                           "max_tree_nodes": 8})
    return specs


def sync_specs(runner: Runner, folder: Path) -> Specs:
    """Every registered drafter whose host syncs are counted (early exit drafting 4, and once more with a confidence
    stop)."""
    base = drafter_specs(runner, folder)
    early = base["early_exit"][1] | {"num_draft": 4}
    specs = {"autoregressive": ("autoregressive", {}), "early_exit": ("early_exit", early),
             "early_exit_confidence": ("early_exit", early | {"confidence": 0.5})}
    return specs | {key: spec for key, spec in base.items() if key not in specs}


def shape_drafters(runner: Runner, folder: Path) -> Specs:
    """Every registered drafter whose per-cycle cost is measured at a shape. Self-SD skips alternate sublayers of
    the back half (a plan file for this model), SWIFT verifies token trees, early and dynamic exit draft from
    E = L/4 (dynamic_exit choosing between L/8 and L/4)."""
    L = runner.num_layers
    plan = plan_file(runner, folder, LayerPlan(L, skip_attn=frozenset(range(L // 2, L, 2)),
                                               skip_mlp=frozenset(range(L // 2 + 1, L, 2))))
    options = registered_options(runner, plan, max(1, L // 4))
    options["early_exit"] = options["early_exit"] | {"num_draft": 4}
    return {name: (name, opts) for name, opts in options.items()}
