"""LayerSkip training on issue 47's families (Qwen3, Gemma 3 text with windows shorter than the blocks, SmolLM3): a
two-step run through the command line as a user calls it saves a checkpoint plain transformers loads (and the runner
decodes equally); the training forward equals the model's own; LoRA, keep_final and the exit adapter follow."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter
from infer.model.runner import Runner
from tiny_models import family_model, save_family
from train.config import EarlyExitConfig, LayerDropoutConfig
from train.layerskip import run_training
from train.model import LayerSkipLM
from train.recipe import dump_config

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")
REPO = Path(__file__).resolve().parents[2]
KINDS = ["qwen3", "gemma3_text", "smollm3"]
WINDOW = 16
"""Gemma 3's local window here: shorter than the training blocks (64 tokens)."""


@pytest.fixture(scope="module", params=KINDS)
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def family_dir(kind, tmp_path_factory):
    return save_family(tmp_path_factory.mktemp(kind), kind, seed=2, layers=4, window=WINDOW)


def logits_of(folder: Path, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(transformers' logits (T, V) of a saved folder, the runner's over the same weights)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = Runner.from_pretrained(folder)
    with torch.no_grad():
        return model(ids[None]).logits[0], runner.forward(runner.new_cache(256), ids)


def test_two_steps_through_the_command_line_save_a_plain_checkpoint(tiny_recipe, family_dir, tmp_path):
    cfg = tiny_recipe(f"model.name_or_path={family_dir}", "data.block_size=64", "optim.max_steps=2",
                      "layer_dropout.p_max=0.5", "early_exit.exits=[1, 2]", "optim.lr=1e-2")
    recipe = tmp_path / "recipe.yaml"
    dump_config(cfg, recipe)
    proc = subprocess.run([sys.executable, str(REPO / "train/layerskip.py"), "--config", str(recipe)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    final = Path(cfg.checkpoint.output_dir) / "final"
    ids = torch.randint(3, 250, (80,), generator=torch.Generator().manual_seed(1))  # longer than the window
    hf, ours = logits_of(final, ids)
    torch.testing.assert_close(ours, hf, rtol=0, atol=1e-4)
    before, _ = logits_of(family_dir, ids)
    assert (hf - before).abs().max() > 1e-4  # the two steps changed the weights


@pytest.mark.parametrize("kind_", ["gemma3_text", "qwen2_window"])
def test_training_forward_equals_the_models_own(kind_):
    """Every exit's loss through the model's own final norm and head (Gemma 3: softcapped), the last one equal to
    the model's own loss, with sliding windows shorter than the batch."""
    model = family_model(kind_, seed=4, layers=4, window=WINDOW)
    ids = torch.randint(3, 320, (2, 64), generator=torch.Generator().manual_seed(0))
    lm = LayerSkipLM(model, LayerDropoutConfig(), EarlyExitConfig(exits=[1, 2, 3]), max_steps=4).eval()
    with torch.no_grad():
        losses = lm(ids, ids)["exit_losses"]
        hs = model(ids, output_hidden_states=True).hidden_states
        torch.testing.assert_close(losses[-1], model(ids, labels=ids).loss, rtol=0, atol=1e-5)
        for j, e in enumerate([1, 2, 3]):  # hidden_states[e] is layer e's input
            logits = lm.exit_logits(hs[e])[:, :-1]
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
            torch.testing.assert_close(losses[j], ce, rtol=0, atol=1e-5)


def test_lora_and_keep_final_on_gemma(tiny_recipe, tmp_path):
    folder = save_family(tmp_path / "gemma", "gemma3_text", seed=3, layers=4, window=WINDOW)
    cfg = tiny_recipe(f"model.name_or_path={folder}", "data.block_size=64", "lora.enabled=true", "lora.r=4",
                      "lora.alpha=8", "keep_final.kl_weight=0.5", "early_exit.exits=[2]", "optim.lr=1e-2",
                      "optim.max_steps=2", output="lora")
    run_training(cfg)
    ids = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(2))
    hf, ours = logits_of(Path(cfg.checkpoint.output_dir) / "final", ids)
    torch.testing.assert_close(ours, hf, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind_", ["gemma3_text", "smollm3"])
def test_exit_adapter_trains_and_drafts_losslessly(tiny_recipe, tmp_path, kind_):
    folder = save_family(tmp_path / kind_, kind_, seed=3, layers=4, window=WINDOW)
    cfg = tiny_recipe(f"model.name_or_path={folder}", "data.block_size=64", "adapter.enabled=true",
                      "adapter.exit_layer=2", "optim.max_steps=4", "logging.eval_every=4", "logging.eval_at_start=true")
    run_training(cfg)
    path = Path(cfg.checkpoint.output_dir) / "adapter.safetensors"
    runner = Runner.from_pretrained(folder)
    drafted = Engine(runner, build_drafter("early_exit", runner, {"adapter": str(path), "k": 3}))
    plain = Engine(runner, build_drafter("autoregressive", runner))
    prompt = list(range(40, 60))
    result = drafted.generate(prompt, DecodeConfig(max_new_tokens=40))
    assert result.tokens == plain.generate(prompt, DecodeConfig(max_new_tokens=40)).tokens
    assert result.stats.drafted > 0


def test_an_unsupported_model_type_is_refused_for_training_in_one_line():
    from transformers import GPT2Config, GPT2LMHeadModel

    from layerskip_core.errors import UserError
    from layerskip_core.families import SUPPORTED_MODEL_TYPES

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UserError) as e:
        LayerSkipLM(model, LayerDropoutConfig(), EarlyExitConfig(exits=[]), max_steps=1)
    assert "\n" not in str(e.value) and "gpt2" in str(e.value)
    assert all(t in str(e.value) for t in SUPPORTED_MODEL_TYPES)
