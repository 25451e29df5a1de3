"""The documented lease sequence (docs/GPU.md) rehearsed on the CPU, and its pieces: limits of the plan, what each
command leaves under $OUT, the budget, the commit without .git, optional packages as notes, the bundle, publishing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from layerskip_core.errors import UserError
from layerskip_core.packages import sha256_of
from lease_rehearsal import returned_files
from script_modules import load_script

pytestmark = pytest.mark.xdist_group("lease_rehearsal")  # one worker runs the rehearsal (make test)

lease = load_script("lease")
gpu_lease = load_script("gpu_lease")
gb = load_script("gpu_bundle")
gc = load_script("gpu_compare")


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


def _row(method: str, vs_ar: float, tok_s: float) -> dict:
    return {"model": "base", "task": "code_heldout", "method": method, "vs_ar": vs_ar, "tok_s": tok_s, "alpha": None,
            "mismatches": 0, "tie_flips": 0}


def test_a_later_stage_carries_the_previous_rows_over(tmp_path):
    previous = {"command": "scripts/gpu_compare.py --form first", "quality": {"base": {"exits": {}}},
                "rows": [_row("autoregressive", 1.0, 5.0), _row("early_exit:E=12:k=3", 1.2, 6.0)]}
    head = {"form": "full", "dry_run": True, "command": "c", "device": "cpu", "commit": "x", "date": "d",
            "recipe": gc.RECIPE, "settings": {"dtype": "fp32", "prompts": 1, "max_new_tokens": 4, "repeats": 1}}
    report = gc.Report(tmp_path, head, previous)
    pipeline = gc.Pipeline(tmp_path / "run", gc.dry_settings(), env={}, quiet=True)
    report.save(pipeline, [_row("autoregressive", 1.0, 9.0)], {}, 1.0)
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert [r["method"] for r in saved["rows"]] == ["early_exit:E=12:k=3", "autoregressive"]
    assert saved["rows"][1]["tok_s"] == 9.0 and saved["stage_of"] == previous["command"]
    assert saved["quality"] == previous["quality"] and (tmp_path / "gpu_section.md").is_file()


def test_a_spent_budget_stops_the_next_step_and_keeps_the_results(tmp_path):
    pipeline = gc.Pipeline(tmp_path, gc.dry_settings(), env={}, quiet=True, budget=lease.Budget(1.0, started=0.0))
    with pytest.raises(gc.OutOfBudget, match="before step train"):
        pipeline.run("train", ["true"])
    pipeline = gc.Pipeline(tmp_path, gc.dry_settings(), env={}, quiet=True, budget=lease.Budget(1.0))
    with pytest.raises(gc.OutOfBudget, match="step sleep was stopped"):
        pipeline.run("sleep", ["sleep", "30"])
    assert pipeline.steps[-1].returncode == -9


def test_out_dir_follows_OUT(monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path / "o"))
    assert lease.out_dir(None) == tmp_path / "o" and lease.out_dir(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("OUT")
    assert lease.out_dir(None) == lease.REPO / "runs" / "gpu"


def test_the_commit_comes_from_the_carried_file_without_git(monkeypatch, tmp_path):
    monkeypatch.setattr(lease, "REPO", tmp_path)  # no .git there
    monkeypatch.setattr(lease, "COMMIT_FILE", tmp_path / "COMMIT")
    assert lease.commit() == "?"
    (tmp_path / "COMMIT").write_text("abc1234\n")
    assert lease.commit() == "abc1234"


def test_a_missing_optional_package_is_a_note_not_a_failure():
    gpu_check = load_script("gpu_check")
    saved = []
    run = gpu_check.Run(torch.device("cpu"), gpu_check.Settings.for_run(True), saver=saved.append)

    def needs_accelerate():
        raise ModuleNotFoundError("No module named 'accelerate'", name="accelerate")
    gpu_check.part("train", needs_accelerate, run)
    assert "errors" not in run.result and run.notes == ["part train skipped: accelerate is not installed"]
    gpu_check.part("train", lambda: 1 / 0, run)
    assert "ZeroDivisionError" in run.result["errors"]["train"] and len(saved) == 2


def test_kernel_profile_fields_on_a_cpu():
    found = lease.kernel_profile(lambda: None, torch.device("cpu"))
    assert found == {"kernels_per_forward": None, "attention_kernels": [], "kernel_note": "CPU: no CUDA kernels"}


def _fake_gguf(tmp_path: Path) -> Path:
    src = tmp_path / "src" / "model.gguf"
    src.parent.mkdir(parents=True)
    src.write_bytes(bytes(range(256)) * 41 + b"tail")
    return src


def test_bundle_writes_the_carry_folders_and_the_halves_join(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERSKIP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gb, "fetch_packaged_file", lambda spec, dest: _data_file(tmp_path, spec))
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    src = _fake_gguf(tmp_path)
    manifest = gb.build_bundle(tmp_path / "lease", wheels=(), gguf=src, tokenizer=tokenizer)
    out = tmp_path / "lease"
    assert (out / "meta" / "COMMIT").read_text().strip() == lease.commit()
    assert (out / "meta" / "tokenizer" / "tokenizer.json").is_file()
    assert sorted(p.name for p in (out / "a").iterdir()) == ["model.gguf.part1"]
    assert sorted(p.name for p in (out / "b").iterdir()) == ["model.gguf.part2"]
    assert manifest["model"]["sha256"] == sha256_of(src)
    pipeline = gc.Pipeline(tmp_path / "run", gc.dry_settings(), env={}, quiet=True)
    cache = tmp_path / "cache"
    gc.unpack_bundle([out / "meta", out / "b", out / "a"], cache, pipeline)
    assert (cache / "packages" / "model.gguf").read_bytes() == src.read_bytes()
    with pytest.raises(UserError, match="missing model part"):
        gc.unpack_bundle([out / "meta", out / "b"], tmp_path / "cache2", pipeline)
    with pytest.raises(UserError, match="not empty"):
        gb.build_bundle(out, wheels=(), gguf=src, tokenizer=tokenizer)


def _data_file(tmp_path: Path, spec) -> Path:
    path = tmp_path / "data" / spec.filename
    path.parent.mkdir(exist_ok=True)
    path.write_text('{"id": "1"}\n')
    return path


def _publish_setup(tmp_path, monkeypatch):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "GPU.md").write_text("intro\n<!-- gpu_check:begin -->\nold\n<!-- gpu_check:end -->\nafter\n")
    (docs / "RESULTS.md").write_text("a\n<!-- gpu-compare:begin -->\nold\n<!-- gpu-compare:end -->\nb\n")
    back = tmp_path / "back"
    back.mkdir()
    (back / "GPU.md").write_text("# GPU results\n\n<!-- gpu_check:begin -->\nnew\n<!-- gpu_check:end -->\n")
    (back / "gpu_check.json").write_text('{"complete": true, "device": "H200"}')
    monkeypatch.setattr(lease, "REPO", tmp_path)
    return docs, back


def test_publish_puts_the_returned_blocks_into_the_docs(tmp_path, monkeypatch):
    docs, back = _publish_setup(tmp_path, monkeypatch)
    written = gpu_lease.publish(back)
    assert (docs / "GPU.md").read_text() == "intro\n<!-- gpu_check:begin -->\nnew\n<!-- gpu_check:end -->\nafter\n"
    assert json.loads((docs / "gpu" / "latest.json").read_text())["complete"] is True and len(written) == 2
    with pytest.raises(UserError, match="holds none"):
        gpu_lease.publish(tmp_path / "docs" / "gpu")


@pytest.mark.parametrize("name, content, message", [
    ("gpu_section.md", "<!-- gpu-compare:end -->\nx\n<!-- gpu-compare:begin -->\n", "once and then"),  # reversed
    ("gpu_section.md", "<!-- gpu-compare:begin -->\nx\n", "once and then"),  # no end marker
    ("compare.json", '{"rows": [', "not valid JSON"),
    ("compare.json", b"\xff\xfe{}", "not UTF-8"),
    ("compare.json", '{"dry_run": true, "rows": []}', "CPU rehearsal or dry run"),
    ("gpu_check.json", '{"device": "cpu", "tiny": true}', "CPU rehearsal or dry run"),
])
def test_publish_refuses_a_bad_file_and_changes_nothing(tmp_path, monkeypatch, capsys, name, content, message):
    docs, back = _publish_setup(tmp_path, monkeypatch)
    before = {p: p.read_bytes() for p in docs.rglob("*") if p.is_file()}
    (back / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    assert gpu_lease.main(["publish", str(back)]) == 2
    err = capsys.readouterr().err
    assert message in err and "nothing was changed" in err and len(err.strip().splitlines()) == 1
    assert {p: p.read_bytes() for p in docs.rglob("*") if p.is_file()} == before


def test_a_stage_refuses_an_earlier_runs_results_folder(tmp_path, capsys):
    (tmp_path / "lease_check.json").write_text('{"stage": "check", "returncode": 0}')
    assert gpu_lease.main(["check", "--out", str(tmp_path)]) == 2
    assert "lease_check.json exists" in capsys.readouterr().err
    assert json.loads((tmp_path / "lease_check.json").read_text())["returncode"] == 0  # not overwritten
