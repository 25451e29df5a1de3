"""The kept teacher of an exit adapter's training (``adapter.teacher_top_k``): the (K + 1)-bucket loss, the memo
and a run that uses them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from layerskip_core.errors import UserError
from train.adapter import AdapterLM
from train.config import AdapterConfig
from train.layerskip import run_training
from train.teacher_memo import TeacherTargets, top_k_distill_loss


def test_top_k_loss_is_the_full_cross_entropy_when_k_is_the_vocabulary():
    torch.manual_seed(0)
    student, teacher = torch.randn(6, 11), torch.randn(6, 1, 11)
    target = TeacherTargets.of(teacher, 11).rows(torch.ones(6, 1, dtype=torch.bool))  # (6, 11)
    full = F.cross_entropy(student, torch.softmax(teacher[:, 0], -1))
    assert torch.allclose(top_k_distill_loss(student, target), full, atol=1e-6)


def test_top_k_loss_is_the_cross_entropy_of_the_bucketed_distributions():
    torch.manual_seed(1)
    student, teacher, k = torch.randn(5, 13), torch.randn(5, 1, 13), 4
    target = TeacherTargets.of(teacher, k).rows(torch.ones(5, 1, dtype=torch.bool))  # (5, 4)
    p, q = torch.softmax(teacher[:, 0], -1), torch.softmax(student, -1)  # (5, 13) each
    in_top = torch.zeros_like(p, dtype=torch.bool).scatter(-1, target.ids, True)  # (5, 13)
    buckets_p = torch.cat([p.gather(-1, target.ids), (p * ~in_top).sum(-1, keepdim=True)], -1)  # (5, K + 1)
    buckets_q = torch.cat([q.gather(-1, target.ids), (q * ~in_top).sum(-1, keepdim=True)], -1)  # (5, K + 1)
    expected = -(buckets_p * buckets_q.log()).sum(-1).mean()
    assert torch.allclose(top_k_distill_loss(student, target), expected, atol=1e-5)
    assert torch.equal(target.greedy(), teacher[:, 0].argmax(-1))


@pytest.fixture
def tiny_hf(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def test_a_kept_pass_gives_the_first_pass_loss_and_gradient(tiny_hf):
    lm = AdapterLM(tiny_hf, AdapterConfig(enabled=True, exit_layer=2, mlp_size=16, teacher_top_k=8))
    ids = torch.randint(3, 200, (2, 24))  # (B, T)
    first = lm(ids, ids.clone())["loss"]
    first.backward()
    grads = [p.grad.clone() for p in lm.adapter.parameters()]
    lm.adapter.zero_grad()
    assert (lm.memo.hits, lm.memo.misses, len(lm.memo.rows)) == (0, 1, 2)
    again = lm(ids, ids.clone())["loss"]
    again.backward()
    assert (lm.memo.hits, lm.memo.misses) == (1, 1)
    assert torch.equal(first, again)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, lm.adapter.parameters(), strict=True))
    other = torch.randint(3, 200, (2, 24))
    lm(other, other.clone())
    assert lm.memo.misses == 2 and len(lm.memo.rows) == 4  # a batch with an unseen row runs the frozen model


def test_the_kept_stream_is_the_frozen_models(tiny_hf):
    lm = AdapterLM(tiny_hf, AdapterConfig(enabled=True, exit_layer=2, teacher_top_k=5))
    ids = torch.randint(3, 200, (1, 16))
    h, target, _ = lm.teacher(ids)
    h_plain, logits, _ = lm.base_states(ids, teacher=True)
    assert torch.equal(h, h_plain) and torch.equal(target.greedy(), logits.argmax(-1))
    h_kept, kept, _ = lm.teacher(ids)
    assert torch.equal(h_kept, h) and torch.equal(kept.logp, target.logp) and lm.memo.hits == 1


def test_a_run_with_the_kept_teacher_trains_and_reuses_it(tiny_recipe):
    cfg = tiny_recipe("adapter.enabled=true", "adapter.exit_layer=2", "adapter.mlp_size=32",
                      "adapter.teacher_top_k=16", "optim.max_steps=16", "optim.grad_accum_steps=1",
                      "logging.eval_every=8", "logging.eval_at_start=true")
    run_training(cfg)
    out = Path(cfg.checkpoint.output_dir)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r and "split" not in r]
    evals = [r for r in records if r.get("split") == "val"]
    assert len(evals) >= 2 and losses[-1] < losses[0]
    assert evals[-1]["adapter_agreement"]["2"] >= evals[0]["adapter_agreement"]["2"]
    assert evals[-1]["teacher_kept_batches"] > 0 and evals[-1]["teacher_kept_rows"] > 0  # later epochs reused it
    assert (out / "adapter.safetensors").exists()


def test_teacher_top_k_needs_the_distill_target(tiny_recipe):
    with pytest.raises(UserError, match="teacher_top_k needs target: distill"):
        tiny_recipe("adapter.enabled=true", "adapter.target=data", "adapter.teacher_top_k=8")
    with pytest.raises(UserError, match="teacher_top_k must be >= 0"):
        tiny_recipe("adapter.enabled=true", "adapter.teacher_top_k=-1")
