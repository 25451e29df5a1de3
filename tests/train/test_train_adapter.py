"""Training an exit adapter on the frozen tiny model: the base never changes, the file drafts losslessly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter
from infer.model.runner import Runner
from train.layerskip import run_training

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


@pytest.mark.parametrize("target", ["distill", "data"])
def test_adapter_run_trains_saves_and_drafts(tiny_recipe, tiny_model_dir, target):
    cfg = tiny_recipe("adapter.enabled=true", "adapter.exit_layer=2", f"adapter.target={target}",
                      "optim.max_steps=12", "logging.eval_every=6", "logging.eval_at_start=true")
    before = Runner.from_pretrained(tiny_model_dir).identity()
    result = run_training(cfg)
    out = Path(cfg.checkpoint.output_dir)
    path = out / "adapter.safetensors"
    assert result["final_dir"] == path and path.stat().st_size < 1_000_000
    assert not (out / "final").exists()  # the base model is not exported: it did not change
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("split") == "val"]
    losses = [r["loss"] for r in records if "loss" in r and "split" not in r]
    assert len(evals) >= 2 and losses[-1] < losses[0]
    assert evals[0]["adapter_agreement"] == evals[0]["exit_agreement"]  # it starts as the plain exit
    runner = Runner.from_pretrained(tiny_model_dir)
    assert runner.identity() == before
    engine = Engine(runner, build_drafter("early_exit", runner, {"adapter": str(path), "k": 3}))
    plain = Engine(runner, build_drafter("autoregressive", runner))
    prompt = list(range(40, 60))
    assert engine.generate(prompt, DecodeConfig(max_new_tokens=24)).tokens == \
        plain.generate(prompt, DecodeConfig(max_new_tokens=24)).tokens


def test_adapter_run_resumes(tiny_recipe):
    """A run killed after its checkpoint continues from it; the checkpoint holds the adapter, not the model."""
    cfg = tiny_recipe("adapter.enabled=true", "adapter.exit_layer=1", "optim.max_steps=4", "checkpoint.save_every=2")
    run_training(cfg)
    out = Path(cfg.checkpoint.output_dir)
    sizes = [p.stat().st_size for p in (out / "checkpoints").rglob("*.safetensors")]
    assert sizes and max(sizes) < 1_000_000
    more = tiny_recipe("adapter.enabled=true", "adapter.exit_layer=1", "optim.max_steps=6",
                       "checkpoint.save_every=2", "checkpoint.resume=auto")
    assert run_training(more)["step"] == 6
    assert (out / "adapter.safetensors").exists()


def test_adapter_refuses_layerskip_options(tiny_recipe):
    from layerskip_core.errors import UserError

    with pytest.raises(UserError, match="turn lora, layer_dropout and early_exit off"):
        tiny_recipe("adapter.enabled=true", "early_exit.exits=[1]")


def test_eval_adapter_script_scores_the_trained_file(tiny_recipe, tmp_path, capsys):
    import eval_adapter

    from train.recipe import dump_config

    cfg = tiny_recipe("adapter.enabled=true", "adapter.exit_layer=2", "optim.max_steps=8")
    run_training(cfg)
    recipe = tmp_path / "recipe.yaml"
    dump_config(cfg, recipe)
    path = Path(cfg.checkpoint.output_dir) / "adapter.safetensors"
    assert eval_adapter.main(["--adapter", str(path), "--config", str(recipe), "--n", "4",
                              "--json", str(tmp_path / "e.json")]) == 0
    result = json.loads((tmp_path / "e.json").read_text())
    assert result["exit_layer"] == 2 and result["tokens"] > 0 and 0 <= result["adapter_agreement"] <= 1
    assert result["provenance"]["steps"] == 8


def test_ship_adapter_writes_the_file_in_bf16_with_its_provenance(tiny_recipe, tiny_model_dir, tmp_path, capsys):
    """scripts/ship_adapter.py: a finished run becomes a shipped file (bf16: half the bytes, the same drafts and the
    same output) and a provenance read from the run; an existing file is kept unless --force; a folder that is no
    finished run is refused in one line."""
    import ship_adapter

    cfg = tiny_recipe("adapter.enabled=true", "adapter.exit_layer=2", "adapter.mlp_size=16", "optim.max_steps=6",
                      "logging.eval_every=3")
    run_training(cfg)
    run, out = Path(cfg.checkpoint.output_dir), tmp_path / "ship"
    argv = ["--run", str(run), "--name", "tiny", "--dtype", "bf16", "--out", str(out)]
    assert ship_adapter.main(argv) == 0
    shipped = out / "tiny-e2.safetensors"
    record = json.loads((out / "tiny-e2.provenance.json").read_text())
    assert shipped.stat().st_size < 0.6 * (run / "adapter.safetensors").stat().st_size
    assert (record["steps"], record["dtype"], record["shape"]["mlp_size"]) == (6, "bf16", 16)
    assert set(record["validation_agreement_at_exit_2"]) == {"plain_exit", "adapter_step_3", "adapter_step_6"}
    assert record["draft_vocab_counts"] is None  # the tiny model has no shipped counts
    runner = Runner.from_pretrained(tiny_model_dir)
    prompt = list(range(40, 60))
    outs = [Engine(runner, build_drafter("early_exit", runner, {"adapter": str(f), "k": 3}))
            .generate(prompt, DecodeConfig(max_new_tokens=16)).tokens for f in (run / "adapter.safetensors", shipped)]
    plain = Engine(runner, build_drafter("autoregressive", runner)).generate(prompt, DecodeConfig(max_new_tokens=16))
    assert outs[0] == outs[1] == plain.tokens
    assert ship_adapter.main(argv) == 2 and "exists; pass --force" in capsys.readouterr().err
    assert ship_adapter.main([*argv, "--force"]) == 0
    assert ship_adapter.main(["--run", str(tmp_path), "--out", str(out)]) == 2
    assert "holds no finished adapter run" in capsys.readouterr().err
