"""tools/results/write_results.py regenerates docs/RESULTS.md without losing hand-written or GPU sections."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = ["-m", "tools.results.write_results"]
"""How the page's program runs (from the checkout's root)."""


def test_regenerating_keeps_notes_and_the_gpu_section(tmp_path):
    page = tmp_path / "RESULTS.md"
    page.write_text("# old\n\n<!-- notes:summary -->\nmy summary\n<!-- /notes:summary -->\n\n"
                    "<!-- notes:where_it_pays -->\nthe cost model\n<!-- /notes:where_it_pays -->\n\n"
                    "<!-- gpu-compare:begin -->\n## GPU\nmeasured table\n<!-- gpu-compare:end -->\n")
    (tmp_path / "runs").mkdir()
    subprocess.run([sys.executable, *SCRIPT, "--runs", str(tmp_path / "runs"), "--out", str(page)], cwd=REPO,
                   check=True, capture_output=True)
    text = page.read_text()
    assert "my summary" in text and "the cost model" in text
    assert "<!-- gpu-compare:begin -->\n## GPU\nmeasured table\n<!-- gpu-compare:end -->" in text
    assert text.index("the cost model") < text.index("measured table")


def test_a_run_folder_without_inputs_keeps_every_measured_section_of_the_committed_page(tmp_path):
    page = tmp_path / "RESULTS.md"
    shutil.copyfile(REPO / "docs" / "RESULTS.md", page)
    (tmp_path / "runs").mkdir()
    proc = subprocess.run([sys.executable, *SCRIPT, "--runs", str(tmp_path / "runs"), "--out", str(page)], cwd=REPO,
                          capture_output=True, text=True, check=True)
    assert page.read_text() == (REPO / "docs" / "RESULTS.md").read_text()
    assert "kept the committed section 'Early-exit agreement before and after LayerSkip training'" in proc.stderr
    assert "exits_*.json is missing" in proc.stderr


def test_a_missing_run_folder_is_refused_and_the_page_left_as_it_is(tmp_path):
    page = tmp_path / "RESULTS.md"
    page.write_text("# measured\n")
    proc = subprocess.run([sys.executable, *SCRIPT, "--runs", str(tmp_path / "runs"), "--out", str(page)], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode != 0 and page.read_text() == "# measured\n"
    assert proc.stderr.count("\n") == 1 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def _bench_payload(quality: dict | None) -> dict:
    from dataclasses import asdict

    from infer.measure.report import Summary

    rows = [Summary(m, "gsm8k", method, 2, 16, 10.0, [10.0], 1.0, None, None, None, None, None, None, None, None,
                    0, answer_accuracy=0.0) for m in ("base", "trained") for method in ("autoregressive", "swift")]
    payload = {"meta": {"command": "layerskip bench", "cpu": "cpu", "threads": 1, "torch": "t", "transformers": "t",
                        "date": "d"},
               "config": {"n": 2, "max_new_tokens": 16, "repeats": 1, "labels": ["base", "trained"]},
               "summary": [asdict(r) for r in rows], "recommended": []}
    return payload | ({"quality": quality} if quality is not None else {})


def test_a_bench_section_shows_each_verifiers_quality_or_says_it_was_not_measured(tmp_path):
    import json

    from infer.measure.quality import compare_to_base

    split = {"tokens": 2032, "blocks": 16, "block_size": 128, "source": "humaneval", "split": "s", "note": None}
    quality = {"base": {"loss": 2.0, "perplexity": 7.39} | split, "trained": {"loss": 2.5, "perplexity": 12.18} | split}
    compare_to_base(quality, ["base", "trained"], None)
    for name, payload in (("measured", _bench_payload(quality)), ("old", _bench_payload(None))):
        runs = tmp_path / name
        (runs / "bench").mkdir(parents=True)
        (runs / "bench" / "results.json").write_text(json.dumps(payload))
        page = tmp_path / f"{name}.md"
        subprocess.run([sys.executable, *SCRIPT, "--runs", str(runs), "--out", str(page)], check=True, cwd=REPO,
                       capture_output=True)
        text = page.read_text()
        if name == "measured":
            assert "| trained | 2.500 | 12.18 | +0.500 | **verifier worse by +0.50 nats** |" in text
            assert "| base | 2.000 | 7.39 | 0 (base) | base |" in text
            assert "gsm8k: 0 of 2 at 8 new tokens (0 for every model here: it does not tell them apart)" in text
        else:
            assert "| trained | not measured | not measured |" in text and "2.500" not in text


def test_a_tuning_bench_is_called_tuning_and_its_best_fixed_setting_is_picked(tmp_path):
    """A bench run with --skip is written as tuning prompts (not held out); scripts/best_fixed.py picks the early_exit
    setting with the best geometric mean over tasks, and refuses a bench without one in one line."""
    import json
    from dataclasses import asdict

    from infer.measure.report import Summary

    speed = {("a", "early_exit:E=24:k=4"): 1.2, ("b", "early_exit:E=24:k=4"): 0.8,
             ("a", "early_exit:E=24:k=8:confidence=0.7"): 1.1, ("b", "early_exit:E=24:k=8:confidence=0.7"): 1.0}
    rows = [Summary("trained", task, method, 2, 16, 10.0, [10.0], ratio, None, None, None, None, None, None, None,
                    None, 0) for (task, method), ratio in speed.items()]
    payload = _bench_payload(None) | {"summary": [asdict(r) for r in rows]}
    payload["config"]["skip"] = 4
    runs = tmp_path / "runs"
    (runs / "tune_fixed").mkdir(parents=True)
    results = runs / "tune_fixed" / "results.json"
    results.write_text(json.dumps(payload))
    page = tmp_path / "page.md"
    subprocess.run([sys.executable, *SCRIPT, "--runs", str(runs), "--out", str(page)], check=True, cwd=REPO,
                   capture_output=True)
    assert "2 tuning prompts (before the last 4: not held out) per task" in page.read_text()
    best = REPO / "scripts" / "best_fixed.py"
    proc = subprocess.run([sys.executable, str(best), str(results)], capture_output=True, text=True, check=True)
    assert proc.stdout == "early_exit:E=24:k=8:confidence=0.7\n"  # sqrt(1.1) > sqrt(0.96)
    results.write_text(json.dumps(_bench_payload(None)))
    proc = subprocess.run([sys.executable, str(best), str(results)], capture_output=True, text=True)
    assert proc.returncode == 2 and "no early_exit rows" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("content", ['{"summary": [', '{"summary": 3, "config": {}, "meta": {}}', '{"meta": {}}',
                                     '[1, 2]', '{"summary": [], "config": {"n": NaN}, "meta": {}}',
                                     '{"summary": [{"x": 1}], "config": {}, "meta": {}}'])
def test_a_damaged_results_json_is_one_line_and_the_page_is_left_as_it_is(tmp_path, content):
    page = tmp_path / "RESULTS.md"
    page.write_text("# measured\n")
    (tmp_path / "runs" / "bench").mkdir(parents=True)
    (tmp_path / "runs" / "bench" / "results.json").write_text(content)
    proc = subprocess.run([sys.executable, *SCRIPT, "--runs", str(tmp_path / "runs"), "--out", str(page)], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert "results.json" in proc.stderr and page.read_text() == "# measured\n"
