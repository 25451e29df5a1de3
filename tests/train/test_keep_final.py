"""keep_final: the final layer distilled toward the frozen starting model (KL term), on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from accel_state import fresh_state
from layerskip_core.errors import UserError
from train.checkpoint import list_checkpoints
from train.config import EarlyExitConfig, KeepFinalConfig, LayerDropoutConfig
from train.layerskip import check_zero_stage, run_training
from train.losses import Teacher, fused_head_ce
from train.model import LayerSkipLM, add_lora, load_model


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _lm(model_dir, weight: float, lora: bool = False) -> LayerSkipLM:
    model, _, _ = load_model(str(model_dir))
    if lora:
        model = add_lora(model, 4, 8.0, 0.0, ["q_proj", "v_proj"])
    return LayerSkipLM(model, LayerDropoutConfig(p_max=0.0), EarlyExitConfig(exits=[2]), 10,
                       keep_final=KeepFinalConfig(kl_weight=weight)).train()


def _ids(lm: LayerSkipLM) -> torch.Tensor:
    return torch.randint(0, lm.model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_term_is_zero_at_the_start_and_grows_when_the_model_moves(tiny_model_dir, lora):
    lm = _lm(tiny_model_dir, 2.0, lora)
    ids = _ids(lm)
    plain = LayerSkipLM(lm.model, LayerDropoutConfig(p_max=0.0), EarlyExitConfig(exits=[2]), 10).train()
    out = lm(ids, ids)
    assert abs(float(out["keep_final_kl"])) < 1e-6
    assert torch.allclose(out["loss"], plain(ids, ids)["loss"], atol=1e-6)  # nothing added at the start
    with torch.no_grad():  # move the trained model (with LoRA: an adapter), never the start
        trained = [p for p in lm.model.parameters() if p.requires_grad and p.dim() == 2]
        trained[-1].add_(0.5 * torch.randn_like(trained[-1]))
    assert float(lm(ids, ids)["keep_final_kl"]) > 1e-3
    assert lm.start is not None and all("start" not in k for k in lm.state_dict())  # never saved, never trained
    assert all(not n.startswith("start") for n, _ in lm.named_parameters())


def test_kl_value_and_gradient_match_autograd(tiny_model_dir):
    model, _, _ = load_model(str(tiny_model_dir))
    head = model.lm_head
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, head.in_features, generator=g, requires_grad=True)  # (B, T, d)
    x_t = torch.randn(2, 9, head.in_features, generator=g)  # (B, T, d)
    targets = torch.randint(0, head.out_features, (2, 9), generator=g)
    targets[0, -1] = -100  # ignored rows count in neither term
    total, per_exit, kl = fused_head_ce(head, [x], [targets], [0.3], 5, Teacher(x_t, head.weight, 1.7))
    total.backward()
    x_ref = x.detach().clone().requires_grad_(True)
    logits, t_logp = head(x_ref), F.log_softmax(head(x_t), -1)  # (B, T, V)
    valid = targets != -100
    kl_ref = F.kl_div(F.log_softmax(logits, -1)[valid], t_logp[valid], log_target=True, reduction="batchmean")
    ref = 0.3 * F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100) + 1.7 * kl_ref
    ref.backward()
    assert torch.allclose(kl, kl_ref.detach(), atol=1e-5) and torch.allclose(total, ref.detach(), atol=1e-5)
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-5)


def test_misconfigurations_are_one_line(tiny_recipe, tiny_model_dir):
    with pytest.raises(UserError, match="keep_final.kl_weight must be >= 0"):
        tiny_recipe("keep_final.kl_weight=-1")
    with pytest.raises(UserError, match="keep_final.kl_weight: adapter.enabled"):
        tiny_recipe("adapter.enabled=true", "keep_final.kl_weight=1")
    with pytest.raises(UserError, match="keep_final.kl_weight is not supported with DeepSpeed ZeRO-3"):
        check_zero_stage(tiny_recipe("keep_final.kl_weight=1"), 3)
    model, _, _ = load_model(str(tiny_model_dir))
    model = add_lora(model, 4, 8.0, 0.0, ["q_proj", "lm_head"])
    with pytest.raises(UserError, match="needs a plain LM head"):
        LayerSkipLM(model, LayerDropoutConfig(), EarlyExitConfig(exits=[2]), 10, keep_final=KeepFinalConfig(1.0))


def test_resumed_run_equals_uninterrupted_run_without_saving_the_start(tiny_recipe):
    common = ("keep_final.kl_weight=1.5", "layer_dropout.p_max=0.5", "early_exit.exits=[2, 3]",
              "checkpoint.save_every=2", "optim.max_steps=4", "checkpoint.save_final=false")
    whole_cfg = tiny_recipe(*common, output="whole")
    whole = run_training(whole_cfg)
    reference = whole["accelerator"].unwrap_model(whole["model"]).state_dict()

    class Killed(Exception):
        pass

    def kill_after_3(step: int) -> None:
        if step == 3:
            raise Killed

    cfg = tiny_recipe(*common, output="killed")
    fresh_state()
    with pytest.raises(Killed):
        run_training(cfg, on_step=kill_after_3)
    out = Path(cfg.checkpoint.output_dir)
    saved = list_checkpoints(out)[-1]
    weights = sum(f.stat().st_size for f in saved.rglob("model*.safetensors"))
    params = sum(v.numel() * v.element_size() for v in reference.values())
    assert weights < 1.2 * params  # one model's weights: the frozen start is not in the checkpoint
    fresh_state()
    resumed = run_training(tiny_recipe(*common, "checkpoint.resume=auto", output="killed"))
    state = resumed["accelerator"].unwrap_model(resumed["model"]).state_dict()
    for k, v in reference.items():
        assert torch.equal(state[k], v), k
    whole_log = {r["step"]: r for r in read_metrics(Path(whole_cfg.checkpoint.output_dir)) if "loss" in r}
    again = {r["step"]: r for r in read_metrics(out) if "loss" in r}
    assert again[4]["loss"] == whole_log[4]["loss"] and again[4]["keep_final_kl"] == whole_log[4]["keep_final_kl"]
    assert whole_log[4]["keep_final_kl"] > 0


def test_the_lora_teacher_runs_without_dropout_in_a_training_model(tiny_model_dir):
    """With LoRA the teacher is the model itself with its adapters off: while training (train mode, attention dropout
    0.5 here) it must still be the deterministic starting model, and the model's train mode is kept."""
    lm = _lm(tiny_model_dir, 2.0, lora=True)
    for module in lm.model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.5
    ids = _ids(lm)
    first, _ = lm.start.final_normed(lm, ids)
    second, _ = lm.start.final_normed(lm, ids)
    assert torch.equal(first, second)
    assert lm.training and all(m.training for m in lm.model.modules())
    lm.eval()
    torch.testing.assert_close(lm.start.final_normed(lm, ids)[0], first)
