"""The GPU comparison (tools.gpu: its pipeline, settings and report) and tools/gpu/gpu_compare.py: helpers, and
the whole pipeline in --dry-run on a tiny model and a synthetic code tree (CPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from infer.drafters import DRAFTERS
from layerskip_core.errors import UserError
from script_modules import load_script
from tiny_models import save_tiny
from tools.doc_sections import GPU_COMPARE, write_section
from tools.gpu.compare_report import method_key, partial_rows, targets
from tools.gpu.compare_settings import TASKS, dry_settings, form_settings
from tools.gpu.pipeline import Pipeline
from tools.gpu.task_quality import answer_number

REPO = Path(__file__).resolve().parents[2]


gc = load_script("gpu_compare")


def test_answer_number_takes_the_last_number():
    assert answer_number("so 3 + 4 = 7.\nThe answer is 1,234.") == "1234"
    assert answer_number("#### 230") == "230"
    assert answer_number("it costs 12.0 dollars") == "12"
    assert answer_number("no digits here") is None


def test_method_key_drops_the_per_model_plan():
    assert method_key("self_sd:plan=runs/x/plans/base.json") == "self_sd"
    assert method_key("self_sd:plan=/a/b.json:k=4") == "self_sd:k=4"
    assert method_key("early_exit:E=12:k=3") == "early_exit:E=12:k=3"


def test_write_section_replaces_only_the_marked_part(tmp_path):
    page = tmp_path / "RESULTS.md"
    page.write_text("# Results\n\nintro\n")
    write_section(page, GPU_COMPARE, f"{GPU_COMPARE.begin}\nfirst\n{GPU_COMPARE.end}\n")
    assert page.read_text().startswith("# Results\n\nintro\n") and "first" in page.read_text()
    page.write_text(page.read_text() + "\n## Later section\n")
    write_section(page, GPU_COMPARE, f"{GPU_COMPARE.begin}\nsecond\n{GPU_COMPARE.end}\n")
    text = page.read_text()
    assert "first" not in text and "second" in text and text.count(GPU_COMPARE.begin) == 1
    assert text.endswith("## Later section\n") and "intro" in text


def _row(model, task, method, vs_ar):
    return {"model": model, "task": task, "method": method, "vs_ar": vs_ar}


def test_targets_use_the_best_early_exit_and_the_worst_task():
    rows = [_row("trained", "code_heldout", "early_exit:E=12:k=3", 1.2),
            _row("trained", "code_heldout", "early_exit:E=16:k=3", 1.6),
            _row("base", "code_heldout", "early_exit:E=16:k=3", 2.0),
            _row("trained", "humaneval", "early_exit:E=16:k=3", 0.9),
            _row("trained", "code_heldout", "self_sd:plan=p/trained.json", 1.3),
            _row("trained", "humaneval", "self_sd:plan=p/trained.json", 0.8)]
    quality = {"base": {"gsm8k_accuracy": 0.30, "humaneval_prompt_loss": 2.0},
               "trained": {"gsm8k_accuracy": 0.27, "humaneval_prompt_loss": 2.05}}
    t = targets(rows, quality, total_s=500.0)
    code = t["trained early_exit vs AR, held-out code (>= 1.5)"]
    assert code == {"value": 1.6, "met": True}
    assert t["trained early_exit vs AR, HumanEval (>= 1.0)"]["met"] is False
    assert t["GSM8K accuracy drop base -> trained (<= 0.02)"]["met"] is False
    assert t["HumanEval prompt loss trained / base (<= 1.05)"]["met"] is True
    assert t["trained self_sd vs AR, worst task (>= 1.0)"]["value"] == 0.8
    assert t["trained swift vs AR, worst task (>= 1.0)"] == {"value": None, "met": None}
    assert t["whole run in seconds (<= 480)"]["met"] is False


def _pipeline(tmp_path: Path):
    return Pipeline(tmp_path / "out", dry_settings(), env={}, quiet=True)


def test_a_failing_step_is_one_user_error_naming_its_log(tmp_path):
    p = _pipeline(tmp_path)
    argv = [sys.executable, "-c", "import sys; print('first'); print('boom: bad input'); sys.exit(3)"]
    with pytest.raises(UserError, match="exit 3") as e:
        p.run("demo", argv)
    assert "boom: bad input" in str(e.value) and "\n" not in str(e.value)
    assert "first" in (tmp_path / "out" / "logs" / "demo.log").read_text()
    assert p.run("demo", argv, ok_codes=(3,)) == 3 and p.steps[-1].returncode == 3
    (tmp_path / "done.json").write_text("{}")
    assert p.run("again", argv, output=tmp_path / "done.json") == 0 and p.steps[-1].reused


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_the_forms_and_their_tiny_cpu_versions():
    first, full = form_settings("first", cuda=True), form_settings("full", cuda=True)
    assert first.tasks == ["code_heldout"] and first.peers == ["hf_generate"] and not first.search
    assert not first.quality and "optim.max_steps=60" in first.train_overrides
    assert full.tasks == list(TASKS) and "hf_static" in full.peers and full.search
    tiny = form_settings("first", cuda=False)
    assert tiny.device == "cpu" and tiny.tasks == ["code_heldout"] and tiny.peers == ["hf_generate"]
    assert not any(d.startswith(("self_sd", "swift")) for d in tiny.drafters) and tiny.prompts == 1


def test_the_dry_run_benches_every_registered_drafter():
    assert {d.split(":")[0] for d in dry_settings().drafters} == set(DRAFTERS)


def test_out_folder_with_foreign_files_is_refused(tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert gc.main(["--dry-run", "--out", str(out), "--quiet"]) == 2
    assert "not empty" in capsys.readouterr().err and (out / "notes.txt").read_text() == "mine"


def _code_tree(root: Path) -> Path:
    for pkg in ("alpha", "beta", "gamma"):
        for i in range(3):
            body = "\n".join(f"def {pkg}_{i}_{j}(x):\n    return x * {j} + len('{pkg}{i}')\n" for j in range(30))
            (root / pkg).mkdir(parents=True, exist_ok=True)
            (root / pkg / f"mod{i}.py").write_text(f'"""{pkg} module {i}."""\n\n{body}')
    return root


@pytest.mark.slow
def test_dry_run_writes_the_whole_comparison(tmp_path):
    """The full pipeline (train, eval-exits, quality, search, bench per task) on a tiny 8-layer model."""
    model = save_tiny(tmp_path / "tiny", layers=8, max_position_embeddings=4096)  # byte tokens: long prompts
    tree = _code_tree(tmp_path / "tree")
    out = tmp_path / "out"
    docs_json = REPO / "docs" / "gpu" / "compare.json"
    before = docs_json.read_bytes() if docs_json.exists() else None
    overrides = ["data.sources.0.type=files", f"data.sources.0.path={tree}", "data.sources.0.holdout_packages=[beta]",
                 "early_exit.exits=[2,4,6]", f"data.cache_dir={tmp_path / 'tokens'}"]
    argv = ["--dry-run", "--form", "full", "--out", str(out), "--model", str(model), "--quiet"]
    for o in overrides:
        argv += ["--set", o]
    assert gc.main(argv) == 0
    c = json.loads((out / "compare.json").read_text())
    assert c["dry_run"] is True and isinstance(c["device"], str) and isinstance(c["commit"], str)
    assert {r["model"] for r in c["rows"]} == {"base", "trained"}
    assert {r["task"] for r in c["rows"]} == {"code_heldout", "humaneval", "gsm8k"}
    methods = {method_key(r["method"]) for r in c["rows"]}
    assert {"autoregressive", "early_exit:E=2:k=2", "hf_generate", "hf_static", "hf_early_exit:E=2:k=2"} <= methods
    for r in c["rows"]:
        assert isinstance(r["tok_s"], float) and r["tok_s"] > 0
        assert r["alpha"] is None or 0.0 <= r["alpha"] <= 1.0
        assert isinstance(r["mismatches"], int) and r["mismatches"] == 0  # fp32: lossless
    for name in ("base", "trained"):
        q = c["quality"][name]
        assert 0.0 <= q["gsm8k_accuracy"] <= 1.0 and q["humaneval_prompt_loss"] > 0
        assert set(q["exits"]["agreement"]) == {"2", "4", "6", "8"}
    prompts = [json.loads(line) for line in (out / "prompts" / "code_heldout.jsonl").read_text().splitlines()]
    assert prompts and all(p["id"].startswith("beta/") for p in prompts)  # cut from the held-out package only
    assert (out / "train" / "final" / "config.json").is_file() and (out / "logs" / "train.log").is_file()
    assert c["command"].startswith("python -m tools.gpu.gpu_compare --dry-run")
    assert "===== step bench_gsm8k: exit 0" in (out / "steps.log").read_text()  # every step's log, merged
    section = (out / "gpu_section.md").read_text()
    assert section.startswith(GPU_COMPARE.begin) and "dry run" in section
    after = docs_json.read_bytes() if docs_json.exists() else None
    assert before == after  # a dry run never writes the docs


def test_a_bench_stopped_at_the_budget_keeps_its_finished_rows(tmp_path):
    from infer.decode.engine import GenerationStats
    from infer.measure.bench import Record

    p = _pipeline(tmp_path)
    folder = p.out / "bench_code_heldout"
    folder.mkdir(parents=True)
    rec = Record("base", "code_heldout", "autoregressive", "p0", 0,
                 GenerationStats(new_tokens=8, wall_time=0.5, verify_calls=7), exact=True)
    (folder / "records.jsonl").write_text(json.dumps({"command": "layerskip bench", "config": {}}) + "\n"
                                          + json.dumps({"record": rec.to_dict()}) + "\n")
    rows = partial_rows(p, "code_heldout")
    assert len(rows) == 1 and rows[0]["method"] == "autoregressive" and rows[0]["tok_s"] == 16.0
    assert rows[0]["mismatches"] == 0 and "stopped before its end: 1 row(s)" in p.notes[0]
    assert partial_rows(p, "humaneval") == []  # a bench that wrote nothing gives nothing


def test_a_dry_run_is_the_first_form_on_a_tiny_stand_in(tmp_path, capsys):
    model = gc.tiny_stand_in(tmp_path / "tiny")
    assert json.loads((model / "config.json").read_text())["num_hidden_layers"] == 8
    assert gc.tiny_stand_in(model) == model and "in place of the default model" in capsys.readouterr().err
