"""scripts/gpu_check.py end to end on the CPU with tiny stand-in shapes and compiled steps (the cheap 'eager'
backend), as the first command of docs/GPU.md's sequence runs it there (no model cache, no network, none of optuna,
datasets, wandb, gguf or deepspeed importable): value order, per-part timings, the graph count, the documented JSON
schema and the GPU.md block."""

import json
import time

import pytest
import torch

from script_modules import load_script

pytestmark = pytest.mark.xdist_group("lease_rehearsal")  # one worker runs the rehearsal (make test)

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
    assert "python scripts/gpu_check.py --budget-s" in page and result["commit"] in page and "Parts: shapes" in page
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


def test_exactness_parts(offline_run):
    exact = offline_run[2]["exact"]
    assert exact["greedy_fp32_mismatches"] == 0 and exact["greedy_fp32_failures"] == 0
    assert exact["greedy_runs"] == 24  # 4 drafters (early exit also through an exit adapter) x 2 executors x 3
    assert {"llama/static/swift", "llama/eager/early_exit", "llama/static/early_exit_adapter"} <= set(
        exact["greedy_detail"])
    assert exact["greedy_detail"]["llama/static/early_exit_adapter"]["verifications"] > 0
    assert exact["greedy_rest_runs"] == 9 and exact["greedy_rest_fp32_failures"] == 0
    assert "qwen2/static/self_sd" in exact["greedy_rest_detail"] and 0.0 <= exact["parity_max_abs"] < 1e-3
    assert exact["greedy_swift_trees"] > 0  # SWIFT (random search without optuna) verified token trees
    spread = exact["spread"]
    assert set(spread) == {f"{m}/{d}" for m in ("llama", "qwen2")
                           for d in ("float32/static", "float32/eager", "bfloat16/eager")}
    assert all(0.0 <= s["max_abs"] < 1.0 for s in spread.values()) and spread["llama/bfloat16/eager"]["max_abs"] > 0
    sampling = exact["sampling"]
    assert set(sampling) == {"autoregressive", "early_exit", "self_sd", "swift"}
    assert all(s["ok"] and s["tokens"] == 16 for s in sampling.values())


def test_sync_counts_and_targets(offline_run):
    result = offline_run[2]
    s = result["syncs"]
    assert set(s) == {"early_exit", "early_exit_confidence", "self_sd", "swift", "autoregressive"}
    assert s["autoregressive"]["per_cycle"] == 1.0 and s["early_exit"]["draft_steps_per_cycle"] > 1
    targets = result["sync_targets"]
    assert set(targets) == {"early_exit", "self_sd", "swift"} and all(isinstance(t["met"], bool)
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
        assert s["kernels_per_forward_eager"] > s["kernels_per_forward"] > 0  # compiled regions counted once
    drafters = shapes["stand-in for SmolLM2-135M"]["drafters"]
    assert set(drafters) == {"E", "autoregressive", "early_exit", "self_sd", "swift"}
    assert all(d["tok_s"] > 0 and d["verify_ms_per_cycle"] > 0 for k, d in drafters.items() if k != "E")
    assert drafters["early_exit"]["draft_ms_per_cycle"] > 0 and drafters["early_exit"]["tokens_per_cycle"] >= 1


def test_kernels_are_counted_on_the_forward_not_on_a_graph_replay(monkeypatch):
    """The kernel count runs the static forward itself: no graph replay (CUPTI miscounts replays on CUDA 13.0)."""
    from executor_cases import fake_capture

    from infer.graphs import StaticSpan
    from infer.measure.seeded_models import tiny_model
    from infer.runner import Runner

    gpu_check = load_script("gpu_check")
    monkeypatch.setattr(StaticSpan, "capture", fake_capture)
    runner = Runner.from_model(tiny_model("llama", 0), executor="static")
    runner.static.capture = True
    cache = runner.new_cache(256)
    runner.forward(cache, torch.arange(3, 11))
    one = runner.embed(torch.tensor([5]))
    runner.span(cache, one, [8], 0, 4, logits=True)  # captured (a stand-in graph) on first use
    cache.rollback(8)
    replays = []
    for span in runner.static.spans(cache):
        monkeypatch.setattr(span.graph, "replay", lambda: replays.append(1), raising=False)
    with gpu_check.uncaptured(runner):
        runner.span(cache, one, [8], 0, 4, logits=True)
    assert replays == [] and runner.static.capture is True


def test_markdown_reports_timed_captures_and_failures():
    gpu_check = load_script("gpu_check")
    shape = {"ms_forward": 1.0, "v": {"1": 1.0}, "c": {"1": 0.3}, "ours_ar_tok_s": 100.0, "captures_in_timed": 2,
             "builds_in_timed": 1}
    result = {"device": "x", "torch": "t", "transformers": "h", "commit": "c", "date": "d", "tiny": False,
              "command": "python scripts/gpu_check.py", "notes": [], "shapes": {"S": shape, "T": {"error": "OOM"}},
              "exact": {"greedy_fp32_failures": 1, "sampling": {"swift": {"ok": False, "error": "E"}}},
              "errors": {"syncs": "RuntimeError: boom"}, "e2e_ok": True}
    text = gpu_check.markdown(result)
    assert "S: the timed runs captured 2 CUDA graph(s), built 1 static forward(s) and compiled 0 time(s)" in text
    assert "T failed: OOM" in text
    assert gpu_check.failures(result) == ["1 fp32 greedy mismatch(es)", "sampled generation of swift did not complete",
                                          "part syncs raised RuntimeError: boom"]
    assert text.count("FAILED:") == 3


def test_a_piece_past_its_part_budget_is_cut_with_a_note():
    gpu_check = load_script("gpu_check")
    settings = gpu_check.Settings.for_run(True, budget_s=1000.0)
    settings.part_budgets_s["shapes"] = 100.0
    run = gpu_check.Run(torch.device("cpu"), settings)
    run.part_name, run.part_started = "shapes", time.perf_counter() - 100.0 + gpu_check.COMPILE_RESERVE_S / 2
    assert not run.cut("forward costs") and run.notes == []
    assert run.cut("hf_static", gpu_check.COMPILE_RESERVE_S) and "hf_static cut" in run.notes[0]
    spent = gpu_check.Run(torch.device("cpu"), settings, started=time.perf_counter() - 2000.0)
    gpu_check.part("greedy", lambda: 1 / 0, spent)  # never started
    assert spent.result["parts"]["greedy"]["cut"] is True and "part greedy cut" in spent.notes[0]


def test_a_missing_optional_package_in_the_training_check_is_a_note():
    gpu_check = load_script("gpu_check")
    assert gpu_check.optional_in("ModuleNotFoundError: No module named 'accelerate'") == "accelerate"
    assert gpu_check.optional_in("ImportError: Using the Trainer requires the `accelerate` library") == "accelerate"
    assert gpu_check.optional_in("ModuleNotFoundError: No module named 'torch'") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_check_cuda_without_a_gpu(tmp_path, capsys):
    assert load_script("gpu_check").main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "CUDA is not available" in err and len(err.strip().splitlines()) == 1
