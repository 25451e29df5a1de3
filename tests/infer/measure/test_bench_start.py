"""No drafter state crosses into a timed bench run unless the run says so: cold by default, warm read-only."""

import json

import pytest

from infer.decode.engine import DecodeConfig
from infer.loading import load_model
from layerskip_cli.main import main

METHODS = "swift:context_window=4:opt_budget=0.9:fallback_opt_budget=0.9,early_exit:E=2:adaptive=true"


@pytest.fixture
def cache(tmp_path):
    """Where the drafters' memory goes in tests (conftest's private toolkit cache)."""
    return tmp_path / "toolkit-cache" / "gate"


def _records(tiny_model_dir, prompts_file, out, *extra):
    code = main(["bench", "--model", str(tiny_model_dir), "--drafters", METHODS, "--data", str(prompts_file), "--n",
                 "2", "--max-new-tokens", "12", "--repeats", "2", "--out", str(out), "--quiet", "--peers", "none",
                 *extra])
    assert code == 0
    return [r for r in json.loads((out / "results.json").read_text())["records"] if r["method"] != "autoregressive"]


def _snapshot(cache) -> dict:
    return {p.name: p.read_text() for p in cache.glob("*.json")} if cache.is_dir() else {}


def test_cold_bench_reads_and_writes_no_remembered_state(tiny_model_dir, prompts_file, tmp_path, cache):
    """Default: warm-up and timed drafters start cold and leave nothing behind (before, the warm-up saved SWIFT's
    plan and the gate's memory, and the timed runs and every later repeat started from it)."""
    records = _records(tiny_model_dir, prompts_file, tmp_path / "out")
    assert records and {r["start_state"] for r in records} == {"cold"}
    assert _snapshot(cache) == {}


def test_warm_bench_starts_every_repeat_from_the_same_remembered_state(tiny_model_dir, prompts_file, tmp_path,
                                                                        cache):
    """--start warm: each timed drafter reads what an earlier command remembered, names the file, and changes
    nothing, so both repeats start alike."""
    model = load_model(tiny_model_dir, threads=1)
    for spec in METHODS.split(","):
        engine, config = model.method(spec, DecodeConfig(max_new_tokens=12))
        with engine:
            engine.generate(model.encode("def sub(a, b):"), config)  # a command that remembers (remember=on)
    saved = _snapshot(cache)
    assert len(saved) == 2
    records = _records(tiny_model_dir, prompts_file, tmp_path / "out", "--start", "warm")
    assert {r["repeat"] for r in records} == {0, 1}
    for r in records:
        assert r["start_state"].startswith("warm from ") and r["start_state"].split("/")[-1] in saved
    assert _snapshot(cache) == saved
