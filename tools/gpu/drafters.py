"""Every registered drafter, with the example options its own file gives (``infer.drafters.examples``) for the GPU
check's models: the one source each part of the check (greedy identity, sampling, host syncs, per-shape costs) takes
its drafters from, so a drafter added to the registry is checked without an edit here (a quantized draft only where
it runs: on the CPU rehearsal; on CUDA its refusal is a case of its own)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from infer.drafters import DRAFTERS, ExampleModel, example_cases
from infer.model.plan import LayerPlan, PlanFile
from infer.model.quant_weights import QUANT_DTYPES
from infer.model.runner import Runner

PLAIN = "autoregressive"
"""Plain decoding: the reference, drafting nothing."""
SYNC_RULE = ("per_cycle <= draft_steps_per_cycle + 2", lambda s: s["per_cycle"] <= s["draft_steps_per_cycle"] + 2)
"""The host syncs a drafting cycle is held to: one a draft step, and the verification's and the acceptance's."""
SYNC_RULE_FOR = {"early_exit": ("per_cycle <= 1", lambda s: s["per_cycle"] <= 1.0)}
"""A stricter rule where a drafter's chain runs without a host read (early exit's draft loop stays on the device)."""

Specs = dict[str, tuple[str, dict]]
"""key -> (registered drafter name, its options)."""


def sync_target(key: str) -> tuple[str, Callable[[dict], bool]] | None:
    """The host syncs the drafter measured as ``key`` is held to (reported in the result; they do not fail the run):
    every registered drafter but plain decoding, under its main example's key (its name)."""
    if key not in DRAFTERS or key == PLAIN:
        return None
    return SYNC_RULE_FOR.get(key, SYNC_RULE)


def runs_here(runner: Runner, specs: Specs) -> Specs:
    """The specs that draft on ``runner``'s device: a quantized draft (draft_dtype int8 or int4, as quant_self's
    examples are) runs on the CPU only; on CUDA its refusal is a case of its own (``tools.gpu.exact.quant_case``)."""
    cpu = runner.device.type == "cpu"
    return {key: (name, options) for key, (name, options) in specs.items()
            if cpu or options.get("draft_dtype") not in QUANT_DTYPES}


def plan_file(runner: Runner, folder: Path, plan: LayerPlan) -> Path:
    """``plan`` saved as a plan file for ``runner``'s model in ``folder``."""
    path = folder / f"plan-{runner.fingerprint[:8]}.json"
    PlanFile(plan, runner.identity(), source="gpu_check").save(path)
    return path


def drafter_specs(runner: Runner, folder: Path, adapter: Path | None = None) -> Specs:
    """Every registered drafter's examples but plain decoding's on a 4-layer model, drafting from E = L/2: the skip
    plan (attention of layer L-2, MLP of layer L-1) a small plan file, and early exit also through ``adapter`` (an
    exit adapter file for this model) where one is given, as a chain and as a token tree."""
    L = runner.num_layers
    plan = plan_file(runner, folder, LayerPlan(L, skip_attn=frozenset({L - 2}), skip_mlp=frozenset({L - 1})))
    model = ExampleModel(L, exit_layer=L // 2, plan=str(plan), adapter=None if adapter is None else str(adapter))
    return runs_here(runner, {key: spec for key, spec in example_cases(model).items() if spec[0] != PLAIN})


def sync_specs(runner: Runner, folder: Path) -> Specs:
    """Every registered drafter's main example, whose host syncs are counted (early exit drafting 4, and once more
    with a confidence stop)."""
    L = runner.num_layers
    plan = plan_file(runner, folder, LayerPlan(L, skip_attn=frozenset({L - 2}), skip_mlp=frozenset({L - 1})))
    specs = example_cases(ExampleModel(L, exit_layer=L // 2, plan=str(plan)), main_only=True)
    early = specs["early_exit"][1] | {"num_draft": 4}
    confident = early | {"confidence": 0.5}
    return runs_here(runner, specs | {"early_exit": ("early_exit", early),
                                      "early_exit_confidence": ("early_exit", confident)})


def shape_drafters(runner: Runner, folder: Path) -> Specs:
    """Every registered drafter's main example, whose per-cycle cost is measured at a shape: the skip plan skips
    alternate sublayers of the back half (a plan file for this model), one-exit drafting starts at E = L/4 (early exit
    drafting 4)."""
    L = runner.num_layers
    plan = plan_file(runner, folder, LayerPlan(L, skip_attn=frozenset(range(L // 2, L, 2)),
                                               skip_mlp=frozenset(range(L // 2 + 1, L, 2))))
    specs = example_cases(ExampleModel(L, exit_layer=max(1, L // 4), plan=str(plan)), main_only=True)
    specs["early_exit"] = ("early_exit", specs["early_exit"][1] | {"num_draft": 4})
    return runs_here(runner, specs)
