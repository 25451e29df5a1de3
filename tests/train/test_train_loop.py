"""The training loop end to end on a tiny model: outputs, metrics, resume, LoRA, DDP, wandb offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from accel_state import fresh_state
from infer.model.runner import Runner
from train.checkpoint import list_checkpoints
from train.layerskip import run_training
from train.optim import lr_factor

REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def runner_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    """Logits of the inference side's runner (its own forward over the saved weights), (T, V)."""
    runner = Runner.from_pretrained(folder)
    with torch.no_grad():
        return runner.forward(runner.new_cache(ids.shape[0] + 1), ids)


def wrapper_logits(lm, ids: torch.Tensor) -> torch.Tensor:
    lm.eval()
    with torch.no_grad():
        return lm.exit_logits(lm.hidden_states(ids)[1])


def test_tiny_run_writes_metrics_checkpoints_and_a_plain_hf_folder(tiny_recipe):
    cfg = tiny_recipe("layer_dropout.p_max=0.6", "layer_dropout.scale=linear", "early_exit.exits=[1, 2, 3]",
                      "early_exit.scale=linear", "logging.eval_every=3", "logging.eval_at_start=true",
                      "checkpoint.save_every=3", "optim.max_steps=9")
    result = run_training(cfg)
    out = Path(cfg.checkpoint.output_dir)
    assert result["step"] == 9 and result["tokens"] == 9 * 2 * 2 * 31

    records = read_metrics(out)
    train = [r for r in records if "loss" in r and "split" not in r]
    evals = [r for r in records if r.get("split") == "val"]
    assert [r["step"] for r in train] == list(range(1, 10))
    assert set(train[0]["exit_loss"]) == {"1", "2", "3", "4"}
    assert len(train[0]["skip_rate"]) == 4 and train[0]["p_layer"] == pytest.approx([0, 0.2, 0.4, 0.6], abs=1e-4)
    assert sum(sum(r["skip_rate"]) for r in train) > 0 and all(r["skip_rate"][0] == 0 for r in train)
    assert [r["step"] for r in evals] == [0, 3, 6, 9]
    assert evals[0]["exit_agreement"]["4"] == 1.0 and 0 <= evals[0]["exit_agreement"]["1"] < 1
    assert evals[-1]["exit_loss"]["4"] < evals[0]["exit_loss"]["4"]  # it learned something
    assert train[0]["lr"] == pytest.approx(3e-3 * lr_factor(0, cfg))

    assert [p.name for p in list_checkpoints(out)] == ["step-000006", "step-000009"]  # keep_last: 2
    for ckpt in list_checkpoints(out):
        assert (ckpt / "config.yaml").is_file() and json.loads((ckpt / "trainer_state.json").read_text())["step"]
    assert yaml.safe_load((out / "config.yaml").read_text())["early_exit"]["exits"] == [1, 2, 3]

    final = out / "final"
    files = {p.name for p in final.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "layerskip_train.yaml"} <= files
    ids = torch.randint(3, 250, (1, 20), generator=torch.Generator().manual_seed(0))
    trained = wrapper_logits(result["accelerator"].unwrap_model(result["model"]), ids)
    torch.testing.assert_close(hf_logits(final, ids), trained, rtol=0, atol=1e-5)
    torch.testing.assert_close(runner_logits(final, ids[0]), trained[0], rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    """Like the default model: the LM head shares the embedding matrix (safetensors stores it once)."""
    from tiny_models import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny-tied"), seed=4, tie_word_embeddings=True)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-embeddings"])
def test_killed_and_resumed_run_equals_uninterrupted_run(tiny_recipe, tied_model_dir, tied):
    common = ("layer_dropout.p_max=0.5", "early_exit.exits=[2, 3]", "early_exit.curriculum=rotational",
              "checkpoint.save_every=2", "optim.max_steps=6", "checkpoint.save_final=false")
    if tied:
        common += (f"model.name_or_path={tied_model_dir}",)
    whole_cfg = tiny_recipe(*common, output="whole")
    whole = run_training(whole_cfg)
    reference = {k: v.clone() for k, v in whole["accelerator"].unwrap_model(whole["model"]).state_dict().items()}

    class Killed(Exception):
        pass

    def kill_after_5(step: int) -> None:
        if step == 5:  # the checkpoint of step 4 exists; step 5's work is lost
            raise Killed

    cfg = tiny_recipe(*common, output="killed")
    fresh_state()
    with pytest.raises(Killed):
        run_training(cfg, on_step=kill_after_5)
    out = Path(cfg.checkpoint.output_dir)
    assert list_checkpoints(out)[-1].name == "step-000004"
    fresh_state()
    resumed = run_training(tiny_recipe(*common, "checkpoint.resume=auto", output="killed"))
    assert resumed["step"] == 6 and resumed["tokens"] == whole["tokens"]
    state = resumed["accelerator"].unwrap_model(resumed["model"]).state_dict()
    assert state.keys() == reference.keys()
    for k, v in reference.items():
        assert torch.equal(state[k], v), k
    # steps 5 and 6 after resuming log exactly the losses of the uninterrupted run
    whole_loss = {r["step"]: r["loss"] for r in read_metrics(Path(whole_cfg.checkpoint.output_dir)) if "loss" in r}
    again = [r for r in read_metrics(out) if "loss" in r]
    # the log was cut back to the checkpoint (step 4): step 5 of the killed attempt is not repeated
    assert [r["step"] for r in again] == [1, 2, 3, 4, 5, 6]
    assert again[4]["loss"] == whole_loss[5] and again[5]["loss"] == whole_loss[6]


def test_lora_trains_merges_and_loads_in_transformers_and_the_runner(tiny_recipe, tiny_model_dir):
    cfg = tiny_recipe("lora.enabled=true", "lora.r=4", "lora.alpha=8", "early_exit.exits=[2]", "optim.lr=1e-2",
                      "optim.max_steps=4", output="lora")
    result = run_training(cfg)
    final = Path(cfg.checkpoint.output_dir) / "final"
    from safetensors.torch import load_file

    merged = load_file(final / "model.safetensors")
    base = load_file(Path(tiny_model_dir) / "model.safetensors")
    assert not any("lora" in k for k in merged) and merged.keys() == base.keys()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], base[q])
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])  # frozen, no adapter
    ids = torch.randint(3, 250, (1, 16), generator=torch.Generator().manual_seed(1))
    logits = hf_logits(final, ids)
    torch.testing.assert_close(logits, wrapper_logits(result["accelerator"].unwrap_model(result["model"]), ids),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(runner_logits(final, ids[0]), logits[0], rtol=0, atol=1e-4)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_recipe):
    from tiny_models import make_model
    from train.config import EarlyExitConfig, LayerDropoutConfig
    from train.model import LayerSkipLM

    ids = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(2))
    grads = []
    for ckpt in (False, True):
        model = make_model(layers=4, seed=7)
        lm = LayerSkipLM(model, LayerDropoutConfig(p_max=0.5), EarlyExitConfig(exits=[2]), 10,
                         gradient_checkpointing=ckpt).train()
        lm(ids, ids, step=3)["loss"].backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-6)


def test_eval_exits_script(tiny_recipe, tmp_path, capsys):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import eval_exits
    finally:
        sys.path.pop(0)
    cfg = tiny_recipe()
    recipe = tmp_path / "recipe.yaml"
    from train.recipe import dump_config

    dump_config(cfg, recipe)
    out_json = tmp_path / "exits.json"
    assert eval_exits.main(["--model", cfg.model.name_or_path, "--config", str(recipe), "--exits", "1,3",
                            "--max-examples", "4", "--json", str(out_json)]) == 0
    table = capsys.readouterr().out
    assert "| 1 |" in table and "| 4 |" in table
    metrics = json.loads(out_json.read_text())
    assert metrics["agreement"]["4"] == 1.0 and set(metrics["loss"]) == {"1", "3", "4"}
    assert eval_exits.main(["--config", str(recipe), "--model", cfg.model.name_or_path, "--exits", "9"]) == 2


@pytest.mark.slow
def test_two_process_cpu_ddp_keeps_replicas_identical(tiny_recipe, tmp_path):
    """A real `accelerate launch` of two gloo processes with layer dropout on."""
    cfg = tiny_recipe("layer_dropout.p_max=0.7", "layer_dropout.scale=uniform", "early_exit.exits=[2]",
                      "optim.max_steps=4", "checkpoint.save_every=2", output="ddp")
    recipe = tmp_path / "ddp.yaml"
    from train.recipe import dump_config

    dump_config(cfg, recipe)
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}  # the script must not need it
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled")
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           str(REPO / "configs/accelerate/cpu-ddp.yaml"), str(REPO / "train/layerskip.py"),
                           "--config", str(recipe)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "find_unused_parameters" not in proc.stderr and "Removed shared tensor" not in proc.stderr  # no noise
    records = read_metrics(Path(cfg.checkpoint.output_dir))
    digests = [r["param_digest"] for r in records if "param_digest" in r]
    assert len(digests) == 1 and len(digests[0]) == 2 and digests[0][0] == digests[0][1]
    train = [r for r in records if "loss" in r]
    assert sum(sum(r["skip_rate"]) for r in train) > 0  # layers really were dropped
    assert train[-1]["tokens"] == 4 * 2 * 2 * 2 * 31  # steps x micro x accum x processes x labelled tokens
    assert (Path(cfg.checkpoint.output_dir) / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_wandb_offline_needs_no_network(tiny_recipe, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)  # a key set must not make it go online
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = tiny_recipe("logging.wandb=offline", "optim.max_steps=2", output="wb")
    run_training(cfg)
    runs = list((Path(cfg.checkpoint.output_dir) / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
