"""Early-exit loss: indexing against HF hidden_states, equality with plain CE, weights and curricula."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from layerskip_core.errors import UserError
from layerskip_core.heldout import IGNORE
from tiny_models import make_model
from train.config import EarlyExitConfig, LayerDropoutConfig
from train.model import LayerSkipLM
from train.schedules import enabled_exits, exit_weights, raw_exit_scale

L = 4


@pytest.fixture
def model():
    m = make_model(layers=L, seed=5)
    with torch.no_grad():  # a non-trivial final norm, so normalising twice is visible
        m.model.norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
    return m


@pytest.fixture
def batch():
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = IGNORE  # a prompt part without loss, as in finetuning
    labels[1, -3:] = IGNORE  # right padding
    return ids, labels


def lm_for(model, **exit_cfg) -> LayerSkipLM:
    return LayerSkipLM(model, LayerDropoutConfig(), EarlyExitConfig(**exit_cfg), max_steps=100).train()


def manual_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE)


def test_only_last_layer_equals_plain_causal_lm_loss(model, batch):
    ids, labels = batch
    out = lm_for(model)(ids, labels)
    torch.testing.assert_close(out["loss"], model(ids, labels=labels).loss, rtol=1e-6, atol=1e-6)
    assert out["exits"].tolist() == [L]


def test_each_exit_equals_manual_norm_head_ce(model, batch):
    """HF hidden_states[E] is the input of layer E (un-normed) for E < L; hidden_states[L] is already normed."""
    ids, labels = batch
    out = lm_for(model, exits=[1, 2, 3], scale="uniform")(ids, labels)
    hs = model(ids, output_hidden_states=True).hidden_states
    assert len(hs) == L + 1
    expected = [manual_ce(model.lm_head(model.model.norm(hs[e])), labels) for e in (1, 2, 3)]
    expected.append(manual_ce(model.lm_head(hs[L]), labels))  # no second norm on the last one
    assert out["exits"].tolist() == [1, 2, 3, 4]
    torch.testing.assert_close(out["exit_losses"], torch.stack(expected).detach(), rtol=0, atol=1e-5)
    # the weighted total: uniform weights over 4 exits
    torch.testing.assert_close(out["loss"], torch.stack(expected).mean(), rtol=0, atol=1e-5)
    # the off-by-one of a published recipe (norm applied to hidden_states[L] again) gives a different loss
    double_normed = manual_ce(model.lm_head(model.model.norm(hs[L])), labels)
    assert abs(double_normed.item() - expected[-1].item()) > 1e-4


def test_total_loss_is_weighted_sum(model, batch):
    ids, labels = batch
    lm = lm_for(model, exits=[2, 3], scale="linear", e_scale=0.5)
    out = lm(ids, labels)
    w = lm.weights(0)
    assert w == pytest.approx({2: 1.0 / 6.5, 3: 1.5 / 6.5, 4: 4.0 / 6.5})
    total = sum(w[e] * loss for e, loss in zip(out["exits"].tolist(), out["exit_losses"], strict=True))
    torch.testing.assert_close(out["loss"], total, rtol=0, atol=1e-6)
    assert manual_ce(model(ids).logits, labels).item() == pytest.approx(out["exit_losses"][-1].item(), abs=1e-5)


def test_gradient_reaches_shallow_layers_only_through_their_exits(model, batch):
    ids, labels = batch
    lm = lm_for(model, exits=[1], scale="uniform")
    lm(ids, labels)["loss"].backward()
    assert model.model.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("scale", ["uniform", "linear", "sum"])
def test_scales_normalise(scale):
    cfg = EarlyExitConfig(exits=[2, 4, 6, 8, 10], scale=scale, e_scale=0.3)
    w = exit_weights(cfg, cfg.exits, 12, 0, 10)
    assert sum(w.values()) == pytest.approx(1.0)
    assert set(w) == {2, 4, 6, 8, 10, 12}
    if scale == "uniform":
        assert w[2] == pytest.approx(w[10]) and w[12] == pytest.approx(w[2] / 0.3)
    if scale == "linear":
        assert w[10] / w[2] == pytest.approx(5.0) and w[12] / w[6] == pytest.approx(12 / (0.3 * 6))
    if scale == "sum":  # the paper: e(l) = e_scale * sum_{i<=l} i (0-based l = E - 1);
        # the last layer: L-1 + e_scale * sum_{i<L-1} i
        assert raw_exit_scale(cfg, 4, 12) == pytest.approx(0.3 * (0 + 1 + 2 + 3))
        assert raw_exit_scale(cfg, 12, 12) == pytest.approx(11 + 0.3 * sum(range(11)))
        assert w[4] / w[2] == pytest.approx(6 / 1)


def test_curriculum_rotational_enables_the_right_exits():
    cfg = EarlyExitConfig(exits=[1, 2, 3, 4, 5], curriculum="rotational", rotation=2)
    assert enabled_exits(cfg, cfg.exits, 0, 10) == [1, 3, 5]
    assert enabled_exits(cfg, cfg.exits, 1, 10) == [2, 4]
    assert enabled_exits(cfg, cfg.exits, 2, 10) == [1, 3, 5]
    cfg3 = EarlyExitConfig(exits=[1, 2, 3, 4, 5], curriculum="rotational", rotation=3)
    assert [enabled_exits(cfg3, cfg3.exits, t, 10) for t in range(4)] == [[1, 4], [2, 5], [3], [1, 4]]
    w = exit_weights(cfg, cfg.exits, 6, 1, 10)
    assert set(w) == {2, 4, 6} and sum(w.values()) == pytest.approx(1.0)  # the final layer always trains


def test_curriculum_gradual_enables_deepest_first():
    cfg = EarlyExitConfig(exits=[2, 4, 6, 8], curriculum="gradual", curriculum_steps=8)
    on = [enabled_exits(cfg, cfg.exits, t, 100) for t in range(10)]
    assert on[0] == [] and on[1] == [8] and on[2] == [8] and on[3] == [6, 8]
    assert on[5] == [4, 6, 8] and on[7] == [2, 4, 6, 8] and on[9] == [2, 4, 6, 8]
    assert exit_weights(cfg, cfg.exits, 10, 0, 100) == {10: 1.0}
    none = EarlyExitConfig(exits=[2, 4], curriculum="none")
    assert enabled_exits(none, none.exits, 123, 10) == [2, 4]


def test_curriculum_changes_which_exits_the_model_computes(model, batch):
    ids, labels = batch
    lm = lm_for(model, exits=[1, 2, 3], scale="uniform", curriculum="rotational", rotation=3)
    assert [lm(ids, labels, step=t)["exits"].tolist() for t in range(3)] == [[1, 4], [2, 4], [3, 4]]
    lm.eval()  # evaluation reports every exit
    assert lm(ids, labels, step=1)["exits"].tolist() == [1, 2, 3, 4]


def test_exits_out_of_range_are_refused(model):
    with pytest.raises(UserError, match=r"use 1 <= E < 4"):
        lm_for(model, exits=[4])
    with pytest.raises(UserError, match="layer counts >= 1"):
        lm_for(model, exits=[0])


@pytest.mark.parametrize("max_steps", [8, 9, 100])
def test_curriculum_gradual_defaults_to_all_exits_on_at_half_of_training(max_steps):
    """The paper's C_grad: one more exit every T/(2k) steps, all of them on from step T/2."""
    cfg = EarlyExitConfig(exits=[2, 4, 6, 8], curriculum="gradual")
    on = [enabled_exits(cfg, cfg.exits, t, max_steps) for t in range(max_steps)]
    half = max_steps // 2
    assert all(o == [2, 4, 6, 8] for o in on[half:])
    assert on[half - 2] != [2, 4, 6, 8]
    assert all(set(a) <= set(b) for a, b in zip(on, on[1:], strict=False))  # exits only ever turn on
    assert all(o == cfg.exits[len(cfg.exits) - len(o):] for o in on)  # deepest first
