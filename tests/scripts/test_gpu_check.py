"""scripts/gpu_check.py end to end on the CPU with tiny shapes, as the lease's first command runs it (no model cache,
no network, none of optuna, datasets, wandb, gguf or deepspeed importable); the documented JSON schema and the GPU.md
block."""

import json

import pytest
import torch

from script_modules import load_script


@pytest.fixture(scope="module")
def offline_run(lease_rehearsal):
    """gpu_check as the lease's first command ran it on the CPU (tests/lease_rehearsal.py): its process and $OUT."""
    return lease_rehearsal["procs"][0], lease_rehearsal["outs"][0]


def test_runs_to_the_end_without_model_cache_network_or_optional_packages(offline_run):
    proc, out = offline_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["complete"] is True and result["failures"] == [] and "errors" not in result, result.get("errors")
    assert {"device", "torch", "transformers", "commit", "date", "exact", "shapes", "part_seconds"} <= set(result)
    assert result["device"] == "cpu" and result["tiny"] is True and result["executor"] == "static"
    assert "train" in result and result["e2e_ok"] is True and len(result["train_e2e"]["decoded"]) == 6
    assert "optuna not installed: swift's Bayesian step is random search" in result["notes"]
    page = (out / "GPU.md").read_text()
    assert page.count("<!-- gpu_check:begin -->") == 1 and "| SmolLM2-135M |" in page
    assert "python scripts/gpu_check.py --budget-s" in page and result["commit"] in page
    assert "gpu_check:train:begin" in (out / "TRAINING.md").read_text()


def test_exactness_part(offline_run):
    exact = json.loads((offline_run[1] / "gpu_check.json").read_text())["exact"]
    assert exact["greedy_fp32_mismatches"] == 0 and exact["greedy_fp32_failures"] == 0
    assert exact["greedy_runs"] == 18 and 0.0 <= exact["parity_max_abs"] < 1e-3
    assert {"llama/swift", "qwen2/swift", "llama/early_exit", "qwen2/self_sd"} <= set(exact["greedy_detail"])
    assert exact["swift_trees"] > 0  # SWIFT (random search without optuna) verified token trees
    spread = exact["spread"]
    assert set(spread) == {f"{m}/{d}/{e}" for m in ("llama", "qwen2") for d in ("float32", "bfloat16")
                           for e in ("static", "eager")}
    assert all(0.0 <= s["max_abs"] < 1.0 for s in spread.values()) and spread["llama/bfloat16/eager"]["max_abs"] > 0
    sampling = exact["sampling"]
    assert set(sampling) == {"autoregressive", "early_exit", "self_sd", "swift"}
    assert all(s["ok"] and s["tokens"] == 16 for s in sampling.values())


def test_sync_counts_and_targets(offline_run):
    result = json.loads((offline_run[1] / "gpu_check.json").read_text())
    s = result["syncs"]
    assert set(s) == {"early_exit", "early_exit_confidence", "self_sd", "swift", "autoregressive"}
    for m in s.values():
        assert all(isinstance(m[k], float) for k in ("per_cycle", "per_token", "draft_steps_per_cycle",
                                                     "update_per_cycle"))
    assert s["autoregressive"]["per_cycle"] == 1.0 and s["early_exit"]["draft_steps_per_cycle"] > 1
    targets = result["sync_targets"]
    assert set(targets) == {"early_exit", "self_sd", "swift"} and all(isinstance(t["met"], bool)
                                                                      for t in targets.values())
    assert "Host syncs" in (offline_run[1] / "GPU.md").read_text()


def test_shapes_count_builds_and_captures(offline_run):
    shapes = json.loads((offline_run[1] / "gpu_check.json").read_text())["shapes"]
    assert set(shapes) == {"SmolLM2-135M", "Llama-3.2-1B-like", "Llama-2-7B-like"}
    for name, s in shapes.items():
        for key in ("ms_forward", "ours_ar_tok_s", "hf_dynamic_tok_s", "hf_static_tok_s", "hf_early_exit_tok_s",
                    "ours_early_exit_tok_s"):
            assert isinstance(s[key], float) and s[key] > 0, (name, key)
        assert s["v"]["1"] == 1.0 and set(s["v"]) == {"1", "2", "4", "8"}
        assert len(s["c"]) == 3 and all(v > 0 for v in s["c"].values())
        assert s["executor"] == "static" and s["static"]["warmup"]["builds"] > 0  # static forwards built in warm-up,
        assert s["captures_in_timed"] == s["builds_in_timed"] == s["compiles_in_timed"] == 0  # none in the timed runs
        assert s["spread_bf16"] >= 0.0


def test_markdown_reports_timed_captures_and_failures():
    gpu_check = load_script("gpu_check")
    shape = {"ms_forward": 1.0, "v": {"1": 1.0}, "c": {"1": 0.3}, "ours_ar_tok_s": 100.0, "captures_in_timed": 2,
             "builds_in_timed": 1}
    result = {"device": "x", "torch": "t", "transformers": "h", "commit": "c", "date": "d", "tiny": False,
              "command": "python scripts/gpu_check.py", "notes": [], "shapes": {"S": shape},
              "exact": {"greedy_fp32_failures": 1, "sampling": {"swift": {"ok": False, "error": "E"}}},
              "errors": {"syncs": "RuntimeError: boom"}, "e2e_ok": True}
    text = gpu_check.markdown(result)
    assert "S: the timed runs captured 2 CUDA graph(s), built 1 static forward(s) and compiled 0 time(s)" in text
    assert gpu_check.failures(result) == ["1 fp32 greedy mismatch(es)", "sampled generation of swift did not complete",
                                          "part syncs raised RuntimeError: boom"]
    assert text.count("FAILED:") == 3


def test_near_the_end_of_the_budget_only_the_compiled_peer_is_skipped():
    import time

    gpu_check = load_script("gpu_check")
    from infer.measure.seeded_models import tiny_model

    settings = gpu_check.Settings.for_run(True, budget_s=1000.0)
    started = time.perf_counter() - (1000.0 - gpu_check.COMPILE_RESERVE_S / 2)  # within the compile reserve
    run = gpu_check.Run(torch.device("cpu"), settings, started=started)
    out = gpu_check.peers(tiny_model("llama", 0), gpu_check.prompt_ids(320, 8, 0), run)
    assert {k for k in out if k.endswith("_tok_s")} == {"hf_dynamic_tok_s", "hf_early_exit_tok_s"}
    assert len(run.notes) == 1 and "hf_static_tok_s skipped" in run.notes[0]
    run = gpu_check.Run(torch.device("cpu"), settings, started=started - 1000.0)  # the budget spent
    assert gpu_check.peers(tiny_model("llama", 0), gpu_check.prompt_ids(320, 8, 0), run) == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_check_cuda_without_a_gpu(tmp_path, capsys):
    assert load_script("gpu_check").main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "CUDA is not available" in err and len(err.strip().splitlines()) == 1
