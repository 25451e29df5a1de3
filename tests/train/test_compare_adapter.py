"""tools/experiments/compare_adapter.py: the three families at the same exits on one held-out split, with a real bench
run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from train.layerskip import run_training

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def test_projection_follows_the_cost_model():
    from infer.model.plan import cycle_speedup, iid_tokens_per_cycle
    from tools.experiments.compare_adapter import H200, gpu_projection

    plain = gpu_projection(0.0, 8, 30, 0)
    assert plain["k"] == 1 and plain["c"] == H200.draft_cost  # nothing accepted: the shortest draft loses least
    assert plain["speedup"] == pytest.approx(1 / (H200.draft_cost + H200.verify_cost))
    good = gpu_projection(0.9, 8, 30, 1)
    assert good["c"] == pytest.approx(H200.draft_cost * 9 / 8) and good["v"] == pytest.approx(H200.verify_cost + 1 / 30)
    assert good["speedup"] == pytest.approx(
        cycle_speedup(iid_tokens_per_cycle(0.9, good["k"]), good["k"], good["c"], good["v"]))
    assert good["speedup"] > 1 > plain["speedup"]
    assert gpu_projection(0.5, 4, 30, 0)["speedup"] > gpu_projection(0.5, 16, 30, 0)["speedup"]  # cheaper drafts


def test_decoding_acceptance_is_read_back_as_a_per_token_rate():
    from infer.model.plan import iid_tokens_per_cycle
    from tools.experiments.compare_adapter import implied_per_token

    for p, k in ((0.3, 4), (0.8, 2.5), (0.05, 1)):
        assert implied_per_token(iid_tokens_per_cycle(p, k), k) == pytest.approx(p, abs=1e-6)
    assert implied_per_token(None, 4) is None and implied_per_token(1.2, 0) is None


def test_compare_scores_three_families_and_reads_the_bench(tiny_recipe, tiny_model_dir, tmp_path, capsys):
    from layerskip_cli.main import main as layerskip
    from tools.experiments import compare_adapter
    from train.recipe import dump_config

    adapter_cfg = tiny_recipe("adapter.enabled=true", "adapter.exit_layer=2", "optim.max_steps=6", output="adapter")
    run_training(adapter_cfg)
    adapter = Path(adapter_cfg.checkpoint.output_dir) / "adapter.safetensors"
    ckpt_cfg = tiny_recipe("early_exit.exits=[2]", "optim.max_steps=4", output="layerskip")
    checkpoint = Path(run_training(ckpt_cfg)["final_dir"])
    recipe = tmp_path / "recipe.yaml"
    dump_config(ckpt_cfg, recipe)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"the {w} of the tale"}) + "\n" for w in ("end", "rest")))
    bench = tmp_path / "bench"
    assert layerskip(["bench", "--model", str(tiny_model_dir), "--drafters",
                      f"autoregressive,early_exit:E=2:k=2,early_exit:adapter={adapter}:k=2", "--peers", "none",
                      "--data", str(prompts), "--n", "2", "--max-new-tokens", "6", "--repeats", "1", "--quiet",
                      "--out", str(bench)]) == 0
    out = tmp_path / "compare"
    assert compare_adapter.main(["--config", str(recipe), "--checkpoint", str(checkpoint), "--adapters", str(adapter),
                                 "--n", "4", "--bench-base", str(bench / "results.json"), "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    rows = {r["family"]: r for r in result["rows"]}
    assert sorted(rows) == ["a", "b", "c"] and {r["E"] for r in rows.values()} == {2}
    assert 0 < rows["b"]["tokens"] <= 6 * 2 * 2 * 32  # the adapter run's tokens: at most steps x batch x accum x block
    assert rows["a"]["cpu"]["exact"] and rows["b"]["cpu"]["exact"] and rows["c"]["cpu"] is None
    assert rows["b"]["cpu"]["method"].startswith("early_exit:adapter=")
    assert 0 <= rows["b"]["cpu"]["per_token"] <= 1 and rows["b"]["cpu"]["tokens_per_verify"] >= 1
    assert all(0 <= r["agreement"] <= 1 and r["gpu_projection"]["speedup"] > 0 for r in rows.values())
    assert result["validation_loss"]["base"] != result["validation_loss"]["checkpoint"]
    verifier = {f: r["verifier"] for f, r in rows.items()}  # the verifier's quality beside each family's speed
    delta = result["validation_loss"]["checkpoint"] - result["validation_loss"]["base"]
    assert verifier["a"]["delta_nats"] == verifier["b"]["delta_nats"] == 0
    assert verifier["c"]["delta_nats"] == pytest.approx(delta) and verifier["c"]["loss"] > 0
    assert verifier["c"]["flag"] == (f"verifier worse by {delta:+.2f} nats" if delta > 0.01 else None)
    table = (out / "table.md").read_text()
    assert "verifier: loss / perplexity (Δ nats vs base)" in table and "Task accuracy: not scored here" in table
    assert (verifier["c"]["flag"] or f"{delta:+.3f}") in table
    assert (out / "compare.png").stat().st_size > 0 and "(b) exit adapter" in (out / "table.md").read_text()
    assert compare_adapter.main(["--config", str(recipe), "--checkpoint", str(checkpoint), "--adapters", str(adapter),
                                 "--out", str(out)]) == 2  # a user error: nothing overwritten
    assert "already holds results.json, table.md, compare.png" in capsys.readouterr().err


@pytest.mark.parametrize("bench,message", [
    ('{"summary": [{"method": "early_exit:E=2"}]}', "'speedup_vs_autoregressive' is missing"),
    ('{"summary": [{"method": 3}]}', "must be a string"),
    ('{"summary": {"method": "x"}}', "must be a list"),
    ('{"summary": [', "not JSON"),
    (None, "does not exist"),
])
def test_bad_inputs_are_refused_before_any_evaluation(tiny_recipe, tiny_model_dir, tmp_path, capsys, monkeypatch,
                                                      bench, message):
    from deadline import deadline
    from tools.experiments import compare_adapter
    from train.recipe import dump_config

    def evaluated(*args):
        raise AssertionError("evaluated before its inputs were checked")

    monkeypatch.setattr(compare_adapter, "adapter_quality", evaluated)
    recipe = tmp_path / "recipe.yaml"
    dump_config(tiny_recipe(), recipe)
    adapter = tmp_path / "a.safetensors"
    from tiny_models import make_model
    from train.adapter import AdapterLM
    from train.config import AdapterConfig

    AdapterLM(make_model("llama", seed=0), AdapterConfig(enabled=True, exit_layer=1)).save(adapter, {})
    bench_file = tmp_path / "results.json"
    if bench is not None:
        bench_file.write_text(bench)
    with deadline(120):
        code = compare_adapter.main(["--config", str(recipe), "--checkpoint", str(tiny_model_dir), "--adapters",
                                     str(adapter), "--bench-base", str(bench_file), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_the_output_folder_never_takes_an_input(tmp_path, capsys):
    from tools.experiments import compare_adapter

    bench = tmp_path / "results.json"
    bench.write_text("{}")
    code = compare_adapter.main(["--config", "r.yaml", "--checkpoint", "c", "--adapters", "a.safetensors",
                                 "--bench-base", str(bench), "--out", str(tmp_path), "--force"])
    assert code == 2 and "would write over --bench-base" in capsys.readouterr().err and bench.read_text() == "{}"
