"""The GPU-minded training forward against plain references, in fp32 on a tiny model.

- layer dropout with regrouped rows == a per-sample reference (each row run alone through its own layers);
- the chunked / fused exit loss == full-logits cross-entropy, loss and gradients, with and without -100;
- no transformers masking internals in the training forward; eager and SDPA attention agree;
- ``granularity: batch`` skips the same layers for every row.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tiny_models import make_model
from train.config import EarlyExitConfig, LayerDropoutConfig
from train.data import IGNORE
from train.losses import checkpointed_head_ce, fused_head_ce
from train.model import DropoutPlan, LayerSkipLM, next_token_targets
from train.schedules import sample_skips, skip_generator

L = 6
B, T = 5, 12


@pytest.fixture
def model():
    m = make_model(layers=L, seed=7)
    with torch.no_grad():  # a non-trivial final norm
        m.model.norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
    return m


@pytest.fixture
def batch():
    ids = torch.randint(3, 300, (B, T), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = IGNORE  # a prompt without loss
    labels[3, -4:] = IGNORE  # right padding
    return ids, labels


def reference_forward(model, ids: torch.Tensor, labels: torch.Tensor, skip: torch.Tensor,
                      weights: dict[int, float]) -> torch.Tensor:
    """The per-sample reference: every row alone through the layers it keeps; exits via full logits."""
    inner = model.model
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    per_exit: dict[int, list[torch.Tensor]] = {e: [] for e in weights}
    for b in range(ids.shape[0]):
        h = inner.embed_tokens(ids[b:b + 1])
        pe = inner.rotary_emb(h, pos)
        for i, layer in enumerate(inner.layers):
            if not skip[b, i]:
                h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
            if i + 1 in per_exit:
                per_exit[i + 1].append(h)
    targets = next_token_targets(labels)
    total = torch.zeros(())
    for e, w in weights.items():
        logits = model.lm_head(inner.norm(torch.cat(per_exit[e])))  # (B, T, V)
        total = total + w * F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    return total


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("step", [0, 3, 11])
def test_dropout_plan_equals_per_sample_reference(model, batch, step):
    ids, labels = batch
    lm = LayerSkipLM(model, LayerDropoutConfig(p_max=0.6, scale="linear"),
                     EarlyExitConfig(exits=[2, 4], scale="linear"), max_steps=20, seed=4).train()
    skip = sample_skips(lm.rates(step), B, skip_generator(4, step, 0))  # (B, L): the decisions forward uses
    assert skip.any() and not skip.all()
    out = lm(ids, labels, step=step)
    assert torch.equal(out["skipped"], skip.sum(0))  # same decisions
    out["loss"].backward()
    got = grads(model)
    ref = reference_forward(model, ids, labels, skip, lm.weights(step))
    ref.backward()
    want = grads(model)
    torch.testing.assert_close(out["loss"], ref, rtol=1e-6, atol=1e-6)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6, msg=name)


def test_plan_runs_each_layer_on_a_contiguous_prefix():
    skip = torch.tensor([[False, True, False], [False, False, True], [False, True, True], [False, False, False]])
    plan = DropoutPlan.build(skip, torch.device("cpu"))
    assert plan.kept == [4, 2, 2]
    for i in range(3):
        order_before = plan.order_after(i)
        gather = plan.gather_index(i)
        rows = order_before if gather is None else order_before[gather]
        assert torch.equal(rows, plan.order_after(i + 1))
        assert set(rows[:plan.kept[i]].tolist()) == set((~skip[:, i]).nonzero().squeeze(1).tolist())
    h = torch.arange(4.0).unsqueeze(1)
    torch.testing.assert_close(DropoutPlan.unpermute(h[plan.order_after(3)], plan.order_after(3)), h)


def test_hidden_states_keep_the_batch_order(model, batch):
    """Called without a plan, hidden_states regroups internally and returns rows in the batch's order."""
    ids, _ = batch
    lm = LayerSkipLM(model, LayerDropoutConfig(), EarlyExitConfig(), max_steps=10).train()
    skip = torch.zeros(B, L, dtype=torch.bool)
    skip[0, 2] = skip[4, 1] = skip[2, 5] = True
    hiddens, last = lm.hidden_states(ids, skip=skip, collect={3})
    for b in range(B):
        one, last_one = lm.hidden_states(ids[b:b + 1], skip=skip[b:b + 1], collect={3})
        torch.testing.assert_close(hiddens[3][b:b + 1], one[3], rtol=0, atol=1e-5)
        torch.testing.assert_close(last[b:b + 1], last_one, rtol=0, atol=1e-5)


def test_batch_granularity_skips_whole_layers():
    rates = [0.0, 0.5, 0.5, 0.5, 0.5, 0.5]
    for step in range(5):
        skip = sample_skips(rates, 4, skip_generator(0, step, 0), "batch")
        assert skip.shape == (4, 6) and bool((skip == skip[0:1]).all())
    per_sample = sample_skips(rates, 4, skip_generator(0, 1, 0))
    assert torch.equal(per_sample, sample_skips(rates, 4, skip_generator(0, 1, 0), "sample"))


def full_ce(model, h, targets):
    logits = model.lm_head(model.model.norm(h))  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


@pytest.mark.parametrize("chunk", [1, 7, 16, 1000])
@pytest.mark.parametrize("padded", [False, True])
def test_fused_and_checkpointed_ce_equal_full_logits(model, batch, chunk, padded):
    ids, labels = batch
    if not padded:
        labels = ids
    targets = next_token_targets(labels)
    hs = [torch.randn(B, T, 64, generator=torch.Generator().manual_seed(s), requires_grad=True) for s in (0, 1)]
    w = [0.3, 0.7]

    ref = sum(wi * full_ce(model, h, targets) for wi, h in zip(w, hs, strict=True))
    ref.backward()
    want = [h.grad.clone() for h in hs] + [model.lm_head.weight.grad.clone(), model.model.norm.weight.grad.clone()]
    for h in hs:
        h.grad = None
    model.zero_grad(set_to_none=True)

    total, per_exit, _ = fused_head_ce(model.lm_head, [model.model.norm(h) for h in hs], [targets, targets], w, chunk)
    total.backward()
    got = [h.grad.clone() for h in hs] + [model.lm_head.weight.grad.clone(), model.model.norm.weight.grad.clone()]
    torch.testing.assert_close(total, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(per_exit, torch.stack([full_ce(model, h, targets) for h in hs]).detach(),
                               rtol=1e-5, atol=1e-5)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    for h in hs:
        h.grad = None
    model.zero_grad(set_to_none=True)

    ck = sum(wi * checkpointed_head_ce(model.model.norm, model.lm_head, h, targets, chunk)
             for wi, h in zip(w, hs, strict=True))
    ck.backward()
    got = [h.grad.clone() for h in hs] + [model.lm_head.weight.grad.clone(), model.model.norm.weight.grad.clone()]
    torch.testing.assert_close(ck, ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("curriculum", ["none", "rotational", "gradual"])
def test_model_loss_equals_unchunked_for_every_curriculum(model, batch, curriculum):
    """The whole LayerSkipLM forward (small chunks) against full-logits CE per exit, at several steps."""
    ids, labels = batch
    cfg = EarlyExitConfig(exits=[1, 3, 5], scale="sum", e_scale=0.5, curriculum=curriculum, rotation=2, loss_chunk=5)
    lm = LayerSkipLM(model, LayerDropoutConfig(), cfg, max_steps=8).train()
    targets = next_token_targets(labels)
    for step in (0, 1, 3, 6):
        weights = lm.weights(step)
        out = lm(ids, labels, step=step)
        out["loss"].backward()
        got = grads(model)
        hs = model(ids, output_hidden_states=True).hidden_states
        ref = sum(w * (full_ce(model, hs[e], targets) if e < L else
                       F.cross_entropy(model.lm_head(hs[L]).flatten(0, 1), targets.flatten(), ignore_index=IGNORE))
                  for e, w in weights.items())
        ref.backward()
        want = grads(model)
        assert out["exits"].tolist() == sorted(weights)
        torch.testing.assert_close(out["loss"], ref, rtol=1e-5, atol=1e-5)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=name)


def test_training_forward_uses_no_transformers_masking(model, batch, monkeypatch):
    import transformers.masking_utils as mu

    def refuse(*args, **kwargs):
        raise AssertionError("transformers.masking_utils called from the training forward")

    for name in ("create_causal_mask", "create_sliding_window_causal_mask"):
        monkeypatch.setattr(mu, name, refuse)
    ids, labels = batch
    lm = LayerSkipLM(model, LayerDropoutConfig(p_max=0.5), EarlyExitConfig(exits=[2]), max_steps=10).train()
    lm(ids, labels, step=9)["loss"].backward()


@pytest.mark.parametrize("window", [None, 5])
def test_eager_masks_match_sdpa(batch, window):
    """Our own masks (eager: additive; SDPA with a short sliding window: boolean) give SDPA's results."""
    ids, labels = batch
    kw = {} if window is None else {"layer_types": ["sliding_attention", "full_attention"] * (L // 2),
                                   "sliding_window": window, "use_sliding_window": True}
    losses = {}
    for impl in ("sdpa", "eager"):
        m = make_model("qwen2" if window else "llama", layers=L, seed=9, attn_implementation=impl, **kw)
        lm = LayerSkipLM(m, LayerDropoutConfig(), EarlyExitConfig(exits=[3]), max_steps=10).eval()
        losses[impl] = lm(ids, labels)["exit_losses"]
        hf = m(ids, labels=labels).loss  # the HF forward builds its own masks
        torch.testing.assert_close(losses[impl][-1], hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(losses["sdpa"], losses["eager"], rtol=1e-5, atol=1e-5)


def test_fused_ce_under_bf16_autocast_matches_unfused(model, batch):
    """bf16 autocast (CPU here, CUDA in training): the fused loss follows autocast's matmul dtype."""
    ids, labels = batch
    targets = next_token_targets(labels)
    h = torch.randn(B, T, 64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = full_ce(model, h, targets)
    ref.backward()
    want = [h.grad.clone(), model.lm_head.weight.grad.clone()]
    h.grad = None
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total, _, _ = fused_head_ce(model.lm_head, [model.model.norm(h)], [targets], [1.0], 16)
    total.backward()
    assert total.dtype == torch.float32 and h.grad.dtype == torch.float32
    assert model.lm_head.weight.grad.dtype == torch.float32
    torch.testing.assert_close(total, ref, rtol=1e-2, atol=1e-2)
    for g, r in zip([h.grad, model.lm_head.weight.grad], want, strict=True):
        torch.testing.assert_close(g, r, rtol=5e-2, atol=5e-3)


def test_tied_head_gradient_reaches_the_embedding(batch):
    """With tied embeddings the fused loss's head gradient adds to the embedding's lookup gradient."""
    ids, labels = batch
    m = make_model(layers=2, seed=11, tie_word_embeddings=True)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    m(ids, labels=labels).loss.backward()
    want = grads(m)
    out = LayerSkipLM(m, LayerDropoutConfig(), EarlyExitConfig(), max_steps=10).train()(ids, labels)
    out["loss"].backward()
    got = grads(m)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_exit_loss_chunk_is_sized_to_the_device(monkeypatch):
    """About 32M logits per chunk on a CPU; on a GPU larger (up to 128M, at most 1/64 of its memory)."""
    from types import SimpleNamespace

    from train.losses import CHUNK_ELEMENTS, GPU_CHUNK_ELEMENTS, default_chunk

    V = 49152
    assert default_chunk(V) == default_chunk(V, "cpu") == CHUNK_ELEMENTS // V
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=141 << 30))
    assert default_chunk(V, "cuda") == GPU_CHUNK_ELEMENTS // V > 4 * default_chunk(V)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=8 << 30))
    assert default_chunk(V, "cuda") == (8 << 30) // 64 // 4 // V  # a small GPU: 1/64 of its memory
