"""docs/GPU.md's lease sequence rehearsed on the CPU (tests/lease_rehearsal.py, once per session): the plan's limits,
what each command leaves under $OUT, and tools/gpu/gpu_check.py end to end as the first command runs it there (tiny
stand-in shapes, compiled steps on the cheap 'eager' backend, no model cache, no network, none of optuna, datasets,
wandb, gguf or deepspeed importable): value order, per-part timings, the graph count, the JSON schema and the GPU.md
block. One file, so that `make test`'s workers (xdist, --dist loadfile) run the rehearsal once."""

import json

import pytest
import torch

from infer import kernels
from infer.drafters import DRAFTERS, ExampleModel, example_cases
from lease_rehearsal import returned_files
from script_modules import load_script

gpu_lease = load_script("gpu_lease")

SHAPES = {"stand-in for SmolLM2-135M", "stand-in for Llama-3.2-1B-like", "stand-in for Llama-2-7B-like"}


@pytest.fixture(scope="module")
def offline_run(lease_rehearsal):
    """gpu_check as the sequence's first command ran it on the CPU (tests/lease_rehearsal.py): its process, $OUT and
    JSON."""
    out = lease_rehearsal["outs"][0]
    return lease_rehearsal["procs"][0], out, json.loads((out / "gpu_check.json").read_text())


def test_runs_to_the_end_without_model_cache_network_or_optional_packages(offline_run):
    proc, out, result = offline_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["complete"] is True and result["failures"] == [] and "errors" not in result, result.get("errors")
    assert {"device", "torch", "transformers", "commit", "date", "exact", "shapes", "parts", "compiles"} <= set(result)
    assert result["device"] == "cpu" and result["tiny"] is True and result["executor"] == "static"
    assert "train" in result and result["e2e_ok"] is True and len(result["train_e2e"]["decoded"]) == 6
    assert "optuna not installed: swift's Bayesian step is random search" in result["notes"]
    page = (out / "GPU.md").read_text()
    assert page.count("<!-- gpu_check:begin -->") == 1 and "| stand-in for SmolLM2-135M |" in page
    assert "python -m tools.gpu.gpu_check --budget-s" in page and result["commit"] in page and "Parts: shapes" in page
    assert "gpu_check:train:begin" in (out / "TRAINING.md").read_text()


def test_the_shapes_come_first_and_every_part_records_its_time_and_compiles(offline_run):
    parts = offline_run[2]["parts"]
    assert list(parts) == ["shapes", "greedy", "checks", "train", "rest"]
    assert parts["shapes"]["start_s"] < 5.0  # from its first seconds
    starts = [p["start_s"] for p in parts.values()]
    assert starts == sorted(starts) and all(p["seconds"] > 0 and p["cut"] is False for p in parts.values())
    assert sum(p["compiles"] for p in parts.values()) == offline_run[2]["compiles"]["dynamo_graphs"]


def test_compile_once(offline_run):
    """At most 16 dynamo graphs in the whole run, two per step set (attention and MLP, dynamic in rows and cache
    size from the first compile, no grad-mode recompile), none in a timed run."""
    result = offline_run[2]
    compiles = result["compiles"]
    assert compiles["backend"] == "eager" and compiles["dynamo_graphs"] <= 16
    assert compiles["per_step_set"] and set(compiles["per_step_set"].values()) == {2}, compiles
    assert compiles["ours"] == 2 * len(compiles["per_step_set"])
    assert all(s["compiles_in_timed"] == 0 for s in result["shapes"].values())


def drafting_cases(adapter: str | None) -> set[str]:
    """The keys the check runs every registered drafter's examples under (plain decoding, the reference, apart)."""
    cases = example_cases(ExampleModel(4, adapter=adapter))
    return {key for key, (name, _) in cases.items() if name != "autoregressive"}


def test_exactness_parts(offline_run):
    exact = offline_run[2]["exact"]
    assert exact["greedy_fp32_mismatches"] == 0 and exact["greedy_fp32_failures"] == 0
    cases, adapted = drafting_cases(adapter=None), drafting_cases(adapter="a.safetensors")
    assert "early_exit_adapter" in adapted and "early_exit_adapter_tree" in adapted
    assert exact["greedy_runs"] == 3 * 2 * len(adapted)  # every registered drafter's examples but autoregressive's,
    # early exit also through an exit adapter as a chain and as a tree, x 2 executors x 3
    assert {key.split("/")[-1] for key in exact["greedy_detail"]} == adapted
    assert {"llama/static/swift", "llama/eager/early_exit", "llama/static/early_exit_adapter"} <= set(
        exact["greedy_detail"])
    assert exact["greedy_detail"]["llama/static/early_exit_adapter"]["verifications"] > 0
    assert exact["greedy_detail"]["llama/static/early_exit_adapter_tree"]["verifications"] > 0
    assert exact["greedy_rest_runs"] == 3 * len(cases) and exact["greedy_rest_fp32_failures"] == 0
    assert "qwen2/static/self_sd" in exact["greedy_rest_detail"] and 0.0 <= exact["parity_max_abs"] < 1e-3
    assert exact["greedy_swift_trees"] > 0  # SWIFT (random search without optuna) verified token trees
    spread = exact["spread"]
    assert set(spread) == {f"{m}/{d}" for m in ("llama", "qwen2")
                           for d in ("float32/static", "float32/eager", "bfloat16/eager")}
    assert all(0.0 <= s["max_abs"] < 1.0 for s in spread.values())
    # bf16 verification against one-token decoding: bitwise equal on the CPU kernel's batch-invariant path (AVX512_BF16
    # matmuls and row attention), a near-tie-sized spread on torch's route (the path a GPU takes)
    invariant = kernels.supports(kernels.load(), torch.bfloat16)
    assert (spread["llama/bfloat16/eager"]["max_abs"] == 0) == invariant
    sampling = exact["sampling"]
    assert set(sampling) == cases | {"autoregressive"}  # every registered drafter's examples
    assert all(s["ok"] and s["tokens"] == 16 for s in sampling.values())


def test_sync_counts_and_targets(offline_run):
    result = offline_run[2]
    s = result["syncs"]
    assert set(s) == set(DRAFTERS) | {"early_exit_confidence"}
    assert s["autoregressive"]["per_cycle"] == 1.0 and s["early_exit"]["draft_steps_per_cycle"] > 1
    targets = result["sync_targets"]
    assert set(targets) == set(DRAFTERS) - {"autoregressive"} and all(isinstance(t["met"], bool)
                                                                     for t in targets.values())


def test_shapes(offline_run):
    shapes = offline_run[2]["shapes"]
    assert set(shapes) == SHAPES  # tiny stand-ins are never labelled with the real models' names
    for name, s in shapes.items():
        for key in ("ms_forward", "ours_ar_tok_s", "hf_dynamic_tok_s", "hf_static_tok_s", "hf_early_exit_tok_s"):
            assert isinstance(s[key], float) and s[key] > 0, (name, key)
        assert s["v"]["1"] == 1.0 and set(s["v"]) == {"1", "2", "4", "8"} and len(s["c"]) == 3
        assert s["executor"] == "static" and s["static"]["warmup"]["builds"] > 0  # static forwards built in warm-up,
        assert s["captures_in_timed"] == s["builds_in_timed"] == 0  # none in the timed runs
        assert s["kernels_counted_on"] == "uncaptured static forward" and s["kernels_at_least_one_per_layer"] is True
        if s["eager_fused_span"]:  # the CPU stand-in's eager forward runs its layers in one C++ call (fused span)
            assert 0 < s["kernels_per_forward_eager"] < s["kernels_per_forward"]
        else:
            assert s["kernels_per_forward_eager"] > s["kernels_per_forward"] > 0  # compiled regions counted once
    drafters = shapes["stand-in for SmolLM2-135M"]["drafters"]
    assert set(drafters) == set(DRAFTERS) | {"E"}
    assert all(d["tok_s"] > 0 and d["verify_ms_per_cycle"] > 0 for k, d in drafters.items() if k != "E")
    assert drafters["early_exit"]["draft_ms_per_cycle"] > 0 and drafters["early_exit"]["tokens_per_cycle"] >= 1


def test_the_plan_fits_one_lease(lease_rehearsal):
    calls = lease_rehearsal["calls"]
    assert [c["command"].split()[-1] for c in calls] == ["check", "compare"]
    assert all(c["timeout_s"] <= 9 * 60 for c in calls)
    assert sum(c["timeout_s"] for c in calls) + 2 * 60 <= 13 * 60  # a 2-minute start-up included
    for call, half in zip(calls, ("a", "b"), strict=True):
        assert call["carry"] == ["runs/lease/meta", f"runs/lease/{half}"] and len(call["command"]) <= 2000
    for stage, call in zip(("check", "compare"), calls, strict=True):
        assert gpu_lease.BUDGET_S[stage] + gpu_lease.GRACE_S < call["timeout_s"]


def test_command_one_leaves_the_gpu_check_json(lease_rehearsal):
    proc, out = lease_rehearsal["procs"][0], lease_rehearsal["outs"][0]
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = {f.name for f in returned_files(out)}
    assert names == {"gpu_check.json", "GPU.md", "TRAINING.md", "lease_check.json"}
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["complete"] is True and result["failures"] == [] and "errors" not in result
    assert result["settings"]["budget_s"] == 0.0  # the budgets are the GPU's; the CPU rehearsal runs without one
    stage = json.loads((out / "lease_check.json").read_text())
    assert stage["returncode"] == 0 and any("runs/lease/a not carried" in n for n in stage["notes"])
    assert "optuna not installed: swift's Bayesian step is random search" in result["notes"]


def test_command_two_leaves_the_first_lease_comparison(lease_rehearsal):
    proc, out = lease_rehearsal["procs"][1], lease_rehearsal["outs"][1]
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = {f.name for f in returned_files(out)}
    assert names == {"compare.json", "gpu_section.md", "lease_compare.json", "steps.log"}
    log = (out / "steps.log").read_text()
    assert "===== step train: exit 0" in log and "===== step bench_code_heldout: exit 0" in log
    c = json.loads((out / "compare.json").read_text())
    assert c["complete"] is True and c["form"] == "first" and c["dry_run"] is True
    assert {r["task"] for r in c["rows"]} == {"code_heldout"} and {r["model"] for r in c["rows"]} == {"base", "trained"}
    methods = {r["method"] for r in c["rows"]}
    assert "autoregressive" in methods and "hf_generate" in methods and not any("hf_static" in m for m in methods)
    assert all(r["mismatches"] == 0 for r in c["rows"] if r["mismatches"] is not None)  # fp32: lossless
    assert set(c["quality"]) == {"base", "trained"} and all("exits" in q for q in c["quality"].values())
    assert [s["name"] for s in c["steps"]][:2] == ["resolve_model", "train"]
    assert (lease_rehearsal["stash"] / "compare-first" / "train" / "final" / "config.json").is_file()
    assert c["settings"]["tasks"] == ["code_heldout"] and c["settings"]["search"] is False
