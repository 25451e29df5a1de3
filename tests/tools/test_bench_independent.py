"""tools/bench/bench_independent.py: a fresh drafter per prompt, finish() after each, exactness and ratios."""

import json

from script_modules import load_script


def test_independent_prompts_on_a_tiny_model(tiny_model_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n{"prompt": "hello"}\n')
    code = load_script("bench_independent").main([
        "--model", str(tiny_model_dir), "--data", str(prompts), "--n", "2", "--max-new-tokens", "6", "--repeats", "2",
        "--device", "cpu", "--drafters", "early_exit:E=2:k=3,swift:context_window=4", "--out", str(tmp_path / "out")])
    assert code == 0, capsys.readouterr().err
    rows = {r["method"]: r for r in json.loads((tmp_path / "out" / "independent.json").read_text())["rows"]}
    assert set(rows) == {"autoregressive", "early_exit:E=2:k=3", "swift:context_window=4"}
    assert all(r["exact"] == "2/2" for r in rows.values())  # fp32: every drafter equals autoregressive
    assert rows["autoregressive"]["vs_ar"] == 1.0 and len(rows["swift:context_window=4"]["vs_ar_per_repeat"]) == 2
    assert set(rows["swift:context_window=4"]["vs_ar_per_prompt"]) == {"p/0", "p/1"}  # per-prompt ratios too


def test_bad_spec_is_refused_before_loading(tmp_path, capsys):
    code = load_script("bench_independent").main(["--model", str(tmp_path / "missing"), "--drafters", "nope"])
    assert code == 2 and "unknown drafter 'nope'" in capsys.readouterr().err
