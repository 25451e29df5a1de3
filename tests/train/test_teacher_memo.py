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


# ---------------------------------------------------------------- a reduced draft vocabulary (adapter.draft_vocab)
def test_the_loss_over_a_draft_vocabulary_is_the_teachers_distribution_conditioned_on_it():
    torch.manual_seed(2)
    V, k, subset = 13, 5, torch.tensor([0, 2, 3, 5, 8, 9, 12])  # the student scores 7 of the 13 tokens
    teacher = torch.randn(6, 1, V)
    target = TeacherTargets.of(teacher, k, subset).rows(torch.ones(6, 1, dtype=torch.bool))  # (6, 5)
    columns = torch.full((V,), -1).index_put_((subset,), torch.arange(len(subset)))  # (V,)
    student = torch.randn(6, len(subset))  # (6, 7)
    p, q = torch.softmax(teacher[:, 0], -1), torch.softmax(student, -1)  # (6, 13), (6, 7)
    expected = []
    for i in range(6):
        inside = [int(t) for t in target.ids[i] if int(t) in subset.tolist()]  # the teacher's K the student scores
        p_in = p[i, inside] / p[i, subset].sum()  # the teacher conditioned on the draft vocabulary
        q_in = q[i, [int(columns[t]) for t in inside]]
        expected.append(-(p_in * q_in.log()).sum() - (1 - p_in.sum()) * (1 - q_in.sum()).log())
    assert torch.allclose(top_k_distill_loss(student, target, columns), torch.stack(expected).mean(), atol=1e-5)
    assert any(int(t) not in subset.tolist() for t in target.ids.flatten())  # the case is exercised


def test_a_draft_vocabulary_of_every_token_gives_the_whole_heads_loss():
    torch.manual_seed(3)
    student, teacher = torch.randn(4, 9), torch.randn(4, 1, 9)
    target = TeacherTargets.of(teacher, 3, torch.arange(9)).rows(torch.ones(4, 1, dtype=torch.bool))
    assert torch.allclose(top_k_distill_loss(student, target, torch.arange(9)), top_k_distill_loss(student, target),
                          atol=1e-6)


def test_the_adapter_scores_only_its_draft_vocabulary(tiny_hf):
    torch.manual_seed(0)  # the adapter's init and the batch, whatever ran before (10 seeds: 0.92-1.0 after training)
    ids = tuple(range(0, 256, 3))  # 86 of the tiny model's tokens
    lm = AdapterLM(tiny_hf, AdapterConfig(enabled=True, exit_layer=2, mlp_size=16, teacher_top_k=8), ids)
    whole = AdapterLM(tiny_hf, AdapterConfig(enabled=True, exit_layer=2, mlp_size=16, teacher_top_k=8))
    whole.adapter.load_state_dict(lm.adapter.state_dict())
    batch = torch.randint(3, 200, (4, 32))
    h, target, rope = lm.teacher(batch)  # the frozen model's: the same before and after the adapter trains
    sub, full = lm.adapter_logits(h, rope), whole.adapter_logits(h, rope)  # (4, 32, 86), (4, 32, V)
    assert sub.shape[-1] == len(ids) and torch.allclose(sub, full[..., list(ids)], atol=1e-5)
    assert set(lm.vocab.argmax(sub).flatten().tolist()) <= set(ids)
    inside = lm.vocab.columns[target.greedy()] >= 0  # (4, 32): the full model's token is one it can draft
    before = (lm.vocab.argmax(lm.adapter_logits(h, rope)) == target.greedy())[inside].float().mean()
    opt, losses = torch.optim.Adam(lm.adapter.parameters(), lr=3e-3), []
    for _ in range(60):  # one batch, over and over: the loss falls, the drafted token becomes the teacher's
        loss = lm(batch, batch.clone())["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    drafted = lm.vocab.argmax(lm.adapter_logits(h, rope))  # (4, 32)
    after = (drafted == target.greedy())[inside].float().mean()
    assert inside.sum() >= 16 and after > 0.9 and after > before


def _vocab_file(model_dir, path, ids) -> str:
    from transformers import AutoConfig, AutoTokenizer

    from layerskip_core.draft_vocab import DraftVocab, model_record

    c = AutoConfig.from_pretrained(model_dir)
    identity = {"model_type": c.model_type, "num_layers": c.num_hidden_layers, "hidden_size": c.hidden_size,
                "vocab_size": c.vocab_size}
    DraftVocab(ids, model_record(identity, AutoTokenizer.from_pretrained(model_dir))).save(path)
    return str(path)


def test_a_run_with_a_draft_vocabulary_trains_and_reports_the_drafted_agreement(tiny_recipe, tiny_model_dir,
                                                                               tmp_path, capsys):
    vocab = _vocab_file(tiny_model_dir, tmp_path / "vocab.json", range(0, 128))
    cfg = tiny_recipe("adapter.enabled=true", "adapter.exit_layer=2", "adapter.mlp_size=32", "adapter.teacher_top_k=16",
                      f"adapter.draft_vocab={vocab}", "optim.max_steps=12", "optim.grad_accum_steps=1",
                      "logging.eval_every=6", "logging.eval_at_start=true")
    run_training(cfg)
    out = Path(cfg.checkpoint.output_dir)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r and "split" not in r]
    evals = [r for r in records if r.get("split") == "val"]  # agreement: the token drafted over the vocabulary
    assert all(0 < x < 10 for x in losses)  # per batch, noisy at 12 steps; the fixed batch above falls
    assert evals[-1]["adapter_agreement"]["2"] > evals[0]["adapter_agreement"]["2"]  # what it would draft
    assert (out / "adapter.safetensors").exists()
    # the file says which ids its head was trained on; a drafter scoring others says so in one line (output unchanged)
    from infer.drafters import build_drafter
    from infer.model.runner import Runner
    from layerskip_core.adapter_spec import read_file
    from layerskip_core.draft_vocab import DraftVocab, ids_digest

    trained = json.loads(read_file(out / "adapter.safetensors")[0]["provenance"])["draft_vocab"]
    assert trained["ids_sha256"] == ids_digest(range(0, 128)) and trained["size"] == 128
    runner = Runner.from_pretrained(tiny_model_dir)
    same, other = (DraftVocab(ids=list(ids), model=runner.identity()) for ids in (range(0, 128), range(0, 256, 2)))
    for draft_vocab, noted in ((same, False), (other, True), ("off", True)):
        capsys.readouterr()
        build_drafter("early_exit", runner, {"adapter": str(out / "adapter.safetensors"), "draft_vocab": draft_vocab})
        err = capsys.readouterr().err
        assert ("trained on a draft vocabulary of 128 ids" in err) == noted, (draft_vocab, err)


def test_a_draft_vocabulary_for_another_model_or_target_is_refused(tiny_recipe, tiny_model_dir, tmp_path):
    with pytest.raises(UserError, match="draft_vocab needs target: distill"):
        tiny_recipe("adapter.enabled=true", "adapter.target=data", "adapter.draft_vocab=auto")
    with pytest.raises(UserError, match="neither a size"):
        tiny_recipe("adapter.enabled=true", "adapter.draft_vocab=nonsense")
    other = json.loads(Path(_vocab_file(tiny_model_dir, tmp_path / "v.json", range(9))).read_text())
    other["model"]["num_layers"] = 99
    (tmp_path / "other.json").write_text(json.dumps(other))
    cfg = tiny_recipe("adapter.enabled=true", "adapter.exit_layer=2", f"adapter.draft_vocab={tmp_path / 'other.json'}")
    with pytest.raises(UserError, match="made for another model"):
        run_training(cfg)
    assert not (Path(cfg.checkpoint.output_dir) / "adapter.safetensors").exists()
