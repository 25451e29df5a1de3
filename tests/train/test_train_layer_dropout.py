"""Layer dropout: identity at p=0, passthrough at p=1, skipped rows do no work, rates follow the schedule."""

from __future__ import annotations

import math

import pytest
import torch

from layerskip_core.errors import UserError
from tiny_models import make_model
from train.config import EarlyExitConfig, LayerDropoutConfig
from train.model import LayerSkipLM
from train.schedules import depth_scale, dropout_rates, sample_skips, skip_generator, time_scale

L = 4


def lm_for(model, **dropout) -> LayerSkipLM:
    return LayerSkipLM(model, LayerDropoutConfig(**dropout), EarlyExitConfig(), max_steps=100)


def manual_forward(model, ids: torch.Tensor, skip_layers: set[int]) -> torch.Tensor:
    """Final hidden (normed) of the HF modules run by hand, leaving out ``skip_layers``."""
    inner = model.model
    h = inner.embed_tokens(ids)
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    pe = inner.rotary_emb(h, pos)
    for i, layer in enumerate(inner.layers):
        if i not in skip_layers:
            h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
    return inner.norm(h)


@pytest.fixture
def model():
    return make_model(layers=L, seed=3)


@pytest.fixture
def ids():
    return torch.randint(3, 300, (3, 16), generator=torch.Generator().manual_seed(0))


def test_p0_is_identity_to_the_plain_model(model, ids):
    lm = lm_for(model, p_max=0.0).train()
    _, last = lm.hidden_states(ids, skip=None)
    logits = lm.exit_logits(last)
    ref = model(ids).logits
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-5)
    out = lm(ids, ids, step=5)
    torch.testing.assert_close(out["loss"], model(ids, labels=ids).loss, rtol=1e-6, atol=1e-6)
    assert out["skipped"].sum() == 0


def test_p1_on_a_layer_passes_its_input_through(model, ids):
    lm = lm_for(model, p_max=1.0, scale="uniform", layers=[2]).train()
    assert lm.rates(0) == [0.0, 0.0, 1.0, 0.0]
    hiddens, last = lm.hidden_states(ids, skip=sample_skips(lm.rates(0), 3, skip_generator(0, 0, 0)),
                                     collect={2, 3})
    torch.testing.assert_close(hiddens[3], hiddens[2], rtol=0, atol=0)  # layer 2 did nothing
    torch.testing.assert_close(model.model.norm(last), manual_forward(model, ids, {2}),
                               rtol=0, atol=1e-5)


def test_mixed_rows_skip_only_their_own_layers(model, ids):
    lm = lm_for(model).train()
    skip = torch.zeros(3, L, dtype=torch.bool)
    skip[0, 1] = skip[0, 3] = True  # row 0 skips layers 1 and 3
    skip[2, 0] = True  # row 2 skips layer 0
    _, last = lm.hidden_states(ids, skip=skip)
    normed = model.model.norm(last)
    torch.testing.assert_close(normed[0:1], manual_forward(model, ids[0:1], {1, 3}), rtol=0, atol=1e-5)
    torch.testing.assert_close(normed[1:2], manual_forward(model, ids[1:2], set()), rtol=0, atol=1e-5)
    torch.testing.assert_close(normed[2:3], manual_forward(model, ids[2:3], {0}), rtol=0, atol=1e-5)


def test_skipped_rows_do_no_work(model, ids):
    """Each layer only sees the rows that keep it: compute is really skipped, not masked."""
    seen: dict[int, list[int]] = {i: [] for i in range(L)}
    hooks = [layer.register_forward_pre_hook(lambda mod, args, i=i: seen[i].append(args[0].shape[0]))
             for i, layer in enumerate(model.model.layers)]
    skip = torch.tensor([[False, True, True, True], [False, False, True, True], [False, False, False, True]])
    lm_for(model).train().hidden_states(ids, skip=skip)
    for h in hooks:
        h.remove()
    assert seen == {0: [3], 1: [2], 2: [1], 3: []}


def test_gradients_flow_only_through_layers_that_ran(model, ids):
    lm = lm_for(model).train()
    skip = torch.zeros(3, L, dtype=torch.bool)
    skip[:, 3] = True  # every row skips the last layer
    _, last = lm.hidden_states(ids, skip=skip)
    lm.exit_logits(last).sum().backward()
    assert model.model.layers[3].mlp.down_proj.weight.grad is None
    assert model.model.layers[2].mlp.down_proj.weight.grad.abs().sum() > 0


def test_eval_disables_dropout(model, ids):
    lm = lm_for(model, p_max=1.0, scale="uniform").eval()
    out = lm(ids, ids, step=50)
    assert out["skipped"].sum() == 0
    torch.testing.assert_close(out["loss"], model(ids, labels=ids).loss, rtol=1e-6, atol=1e-6)
    lm.train()
    assert lm(ids, ids, step=50)["skipped"].sum() == 3 * L  # p=1 everywhere: every row skips every layer


@pytest.mark.parametrize("scale", ["exp", "linear"])
def test_measured_skip_frequency_matches_schedule(model, scale):
    """Count the decisions the model actually applied over many steps; compare with p_max * S(l)."""
    lm = lm_for(model, p_max=0.6, scale=scale).train()
    ids = torch.randint(3, 300, (8, 2))
    skipped = torch.zeros(L)
    steps = 400
    with torch.no_grad():
        for step in range(steps):
            skipped += lm(ids, ids, step=step)["skipped"]
    rows = steps * 8
    for layer, p in enumerate(lm.rates(0)):
        sigma = math.sqrt(max(p * (1 - p), 1e-12) / rows)
        assert abs(skipped[layer].item() / rows - p) <= 4 * sigma + 1e-9, (layer, skipped[layer] / rows, p)
    assert lm.rates(0)[0] == 0.0 and lm.rates(0)[-1] == pytest.approx(0.6)


def test_rate_formulas_and_time_curriculum():
    assert depth_scale("linear", 5) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert depth_scale("exp", 3) == pytest.approx([0.0, math.sqrt(2) - 1, 1.0])
    assert depth_scale("uniform", 3) == [1.0, 1.0, 1.0]
    assert time_scale("off", 3, 10) == 1.0
    assert time_scale("linear", 3, 10) == pytest.approx(0.3)
    assert time_scale("linear", 30, 10) == 1.0
    assert time_scale("exp", 5, 10) == pytest.approx(math.sqrt(2) - 1)
    cfg = LayerDropoutConfig(p_max=0.5, scale="linear", curriculum="linear", curriculum_steps=10, layers=[1, 3])
    assert dropout_rates(cfg, 4, 0, 100) == [0.0, 0.0, 0.0, 0.0]
    assert dropout_rates(cfg, 4, 5, 100) == pytest.approx([0.0, 0.5 / 3 * 0.5, 0.0, 0.25])
    assert dropout_rates(cfg, 4, 50, 100) == pytest.approx([0.0, 0.5 / 3, 0.0, 0.5])
    with pytest.raises(UserError, match="out of range"):
        dropout_rates(LayerDropoutConfig(p_max=0.1, layers=[4]), 4, 0, 10)


def test_decisions_depend_only_on_seed_step_micro():
    rates = [0.5] * 6
    a = sample_skips(rates, 4, skip_generator(1, 7, 0))
    assert torch.equal(a, sample_skips(rates, 4, skip_generator(1, 7, 0)))
    assert not torch.equal(a, sample_skips(rates, 4, skip_generator(1, 7, 1)))
    assert not torch.equal(a, sample_skips(rates, 4, skip_generator(1, 8, 0)))
