"""The pieces of the documented lease sequence (docs/GPU.md): the budget, the commit without .git, optional packages
as notes, the bundle, publishing. The sequence itself, rehearsed on the CPU, is checked in test_lease_rehearsal.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from layerskip_core.errors import UserError
from layerskip_core.packages import sha256_of
from script_modules import load_script
from tools.gpu.budget import Budget
from tools.gpu.bundle import unpack_bundle
from tools.gpu.compare_report import Report
from tools.gpu.compare_settings import dry_settings
from tools.gpu.counts import kernel_profile
from tools.gpu.pipeline import OutOfBudget, Pipeline
from tools.gpu.run import Run, Settings, part

lease = load_script("lease")
gpu_lease = load_script("gpu_lease")
gb = load_script("gpu_bundle")
gc = load_script("gpu_compare")


def _row(method: str, vs_ar: float, tok_s: float) -> dict:
    return {"model": "base", "task": "code_heldout", "method": method, "vs_ar": vs_ar, "tok_s": tok_s, "alpha": None,
            "mismatches": 0, "tie_flips": 0}


def test_a_later_stage_carries_the_previous_rows_over(tmp_path):
    previous = {"command": "python -m tools.gpu.gpu_compare --form first", "quality": {"base": {"exits": {}}},
                "rows": [_row("autoregressive", 1.0, 5.0), _row("early_exit:E=12:k=3", 1.2, 6.0)]}
    head = {"form": "full", "dry_run": True, "command": "c", "device": "cpu", "commit": "x", "date": "d",
            "recipe": gc.RECIPE, "settings": {"dtype": "fp32", "prompts": 1, "max_new_tokens": 4, "repeats": 1}}
    report = Report(tmp_path, head, previous)
    pipeline = Pipeline(tmp_path / "run", dry_settings(), env={}, quiet=True)
    report.save(pipeline, [_row("autoregressive", 1.0, 9.0)], {}, 1.0)
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert [r["method"] for r in saved["rows"]] == ["early_exit:E=12:k=3", "autoregressive"]
    assert saved["rows"][1]["tok_s"] == 9.0 and saved["stage_of"] == previous["command"]
    assert saved["quality"] == previous["quality"] and (tmp_path / "gpu_section.md").is_file()


def test_a_spent_budget_stops_the_next_step_and_keeps_the_results(tmp_path):
    pipeline = Pipeline(tmp_path, dry_settings(), env={}, quiet=True, budget=Budget(1.0, started=0.0))
    with pytest.raises(OutOfBudget, match="before step train"):
        pipeline.run("train", ["true"])
    pipeline = Pipeline(tmp_path, dry_settings(), env={}, quiet=True, budget=Budget(1.0))
    with pytest.raises(OutOfBudget, match="step sleep was stopped"):
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
    saved = []
    run = Run(torch.device("cpu"), Settings.for_run(True), saver=saved.append)

    def needs_accelerate():
        raise ModuleNotFoundError("No module named 'accelerate'", name="accelerate")
    part("train", needs_accelerate, run)
    assert "errors" not in run.result and run.notes == ["part train skipped: accelerate is not installed"]
    part("train", lambda: 1 / 0, run)
    assert "ZeroDivisionError" in run.result["errors"]["train"] and len(saved) == 2


def test_kernel_profile_fields_on_a_cpu():
    found = kernel_profile(lambda: None, torch.device("cpu"))
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
    pipeline = Pipeline(tmp_path / "run", dry_settings(), env={}, quiet=True)
    cache = tmp_path / "cache"
    unpack_bundle([out / "meta", out / "b", out / "a"], cache, pipeline)
    assert (cache / "packages" / "model.gguf").read_bytes() == src.read_bytes()
    with pytest.raises(UserError, match="missing model part"):
        unpack_bundle([out / "meta", out / "b"], tmp_path / "cache2", pipeline)
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


def test_the_stash_lies_in_the_toolkit_cache_never_the_system_temp_folder(tmp_path, monkeypatch):
    """Issue 49 item 9: the CPU rehearsal wrote a 47 MB GGUF half under /tmp, outside --out and LAYERSKIP_CACHE."""
    import subprocess
    import sys
    import tempfile

    monkeypatch.delenv("LEASE_STASH", raising=False)
    monkeypatch.setenv("LAYERSKIP_CACHE", str(tmp_path / "cache"))
    fresh = load_script("gpu_lease")
    try:
        assert fresh.STASH == tmp_path / "cache" / "lease"
        assert not str(fresh.STASH).startswith(tempfile.gettempdir() + "/lease")
        bundle = tmp_path / "bundle"
        (bundle / "a").mkdir(parents=True)
        (bundle / "a" / "model.gguf.part1").write_bytes(b"x" * 1000)
        env = {k: v for k, v in __import__("os").environ.items() if k not in ("LEASE_STASH", "OUT")}
        env |= {"LAYERSKIP_CACHE": str(tmp_path / "cache"), "LEASE_BUNDLE": str(bundle)}
        proc = subprocess.run([sys.executable, "-m", "tools.gpu.gpu_lease", "stash", "--out", str(tmp_path / "out")],
                              cwd=lease.REPO, capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert (tmp_path / "cache" / "lease" / "model.gguf.part1").is_file()
    finally:
        load_script("gpu_lease")  # the module as the other tests expect it


def test_make_lease_ends_with_the_next_steps_in_users_terms():
    text = gb.NEXT_STEPS.format(out="runs/lease")
    for words in ("GPU machine", "offline", "torch", "transformers", "accelerate", "peft", "OUT", "results folder",
                  "gpu_lease check", "gpu_lease compare", "gpu_lease publish", "minutes"):
        assert words in text, words
    assert "carry" not in text and "device command" not in text


def test_one_budget_rule_for_every_lease_program():
    """A part, a step and a stage's program are cut by the same rule: nothing starts past the budget (less a
    reserve), a running step gets what is left, a program is stopped a grace after it; 0 is no budget."""
    spent = Budget(10.0, started=0.0)
    assert spent.over() and spent.left() == 1.0 and spent.limit(45.0) == 55.0
    fresh = Budget(100.0)
    assert not fresh.over() and fresh.over(reserve=100.0) and 99.0 < fresh.left() <= 100.0
    none = Budget(0.0, started=0.0)
    assert not none.over(reserve=1e9) and none.left() is None and none.limit() is None
    assert gpu_lease.BUDGET_S == {"check": 240.0, "compare": 240.0} and gpu_lease.GRACE_S == 45.0
