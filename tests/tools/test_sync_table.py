"""tools/bench/sync_table.py: host syncs per cycle of each drafter on the static executor, within their budgets."""

import json

from script_modules import load_script


def test_sync_table_on_a_tiny_model(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "syncs.json"
    code = load_script("sync_table").main([
        "--model", str(tiny_model_dir), "--device", "cpu", "--max-new-tokens", "24", "--json", str(out),
        "--drafters", "autoregressive,early_exit:E=2:k=3,early_exit:E=2:k=3:confidence=0.1,"
        "swift:context_window=4:adaptive=false:remember=off"])
    assert code == 0, capsys.readouterr().err
    rows = {r["drafter"]: r for r in json.loads(out.read_text())}
    assert rows["early_exit:E=2:k=3"]["per_cycle"] == 1.0 and rows["early_exit:E=2:k=3"]["executor"] == "static"
    assert all(r["per_cycle"] <= r["budget"] for r in rows.values())
    assert "| `swift:context_window=4:adaptive=false:remember=off` |" in capsys.readouterr().out


def test_bad_spec_is_refused_before_loading(capsys):
    assert load_script("sync_table").main(["--model", "/nonexistent", "--drafters", "nope"]) == 2
    assert "unknown drafter" in capsys.readouterr().err
