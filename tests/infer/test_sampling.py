"""Sampling: logits processing, and statistical losslessness of speculative sampling."""

import numpy as np
import pytest
import torch
from lossless_stats import P_THRESHOLD, chi2_pvalue, sampling_pvalue, transformers_probs

from infer.decode.acceptance import TreeShape, sampling_accept
from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import ExampleModel, build_drafter, example_cases
from infer.model.runner import Runner
from infer.model.sampling import SamplingConfig, probs_from_logits, select
from layerskip_core.errors import UserError
from tiny_models import make_model
from tools.syncs import SyncCounter


def test_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    p = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([5 / 7, 2 / 7, 0, 0, 0]))
    p = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(p, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    p = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_p=0.01))
    torch.testing.assert_close(p, torch.tensor([1.0, 0, 0, 0, 0]))


def test_top_p_drops_tied_tokens_as_transformers_does():
    """The issue's case: logits [2, 1, 1, -3] at top-p 0.75 kept {0, 1} (a descending sort dropped the later of the
    tied tokens); transformers' TopPLogitsWarper keeps {0, 2}."""
    logits = torch.tensor([2.0, 1.0, 1.0, -3.0])
    cfg = SamplingConfig(temperature=1.0, top_p=0.75)
    p = probs_from_logits(logits, cfg)
    assert p.nonzero().flatten().tolist() == [0, 2]
    assert torch.equal(p, transformers_probs(logits, cfg))


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
WARPS = [(1.0, 0, 0.75), (0.7, 5, 0.9), (1.3, 3, 0.5), (0.5, 0, 0.3), (1.0, 8, 0.95), (2.0, 4, 1.0)]
"""(temperature, top-k, top-p) combinations; top-k and top-p together in most."""


def tie_heavy_logits(dtype: torch.dtype, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """(2, 3, vocab) logits where many tokens tie: fp32 on a grid of 8 values; bf16 from a narrow normal (bf16 holds
    64 values between 2 and 4)."""
    if dtype == torch.float32:
        return torch.randint(-4, 4, (2, 3, vocab), generator=generator).float() * 0.5
    return (torch.randn(2, 3, vocab, generator=generator) * 0.4 + 3).to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [5, 40, 3000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_logits_keep_what_transformers_warpers_keep(dtype, vocab, device):
    """Batches of tie-heavy rows under temperature, top-k and top-p combined: the kept set and the probabilities are
    bitwise those of transformers' warpers and softmax (torch's ascending sort orders ties by id up to 16 tokens on
    the CPU, not beyond: the rule is the very sort transformers calls, not "the lower id goes first")."""
    generator = torch.Generator().manual_seed(vocab)
    boundary_ties = 0
    for temperature, top_k, top_p in WARPS:
        logits = tie_heavy_logits(dtype, vocab, generator).to(device)  # (2, 3, V)
        cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
        ours, theirs = probs_from_logits(logits, cfg), transformers_probs(logits, cfg)  # (2, 3, V) each
        assert torch.equal(ours > 0, theirs > 0), cfg
        assert torch.equal(ours, theirs), cfg
        kept_min = logits.float().masked_fill(ours == 0, float("inf")).amin(-1, keepdim=True)  # (2, 3, 1)
        boundary_ties += int(((logits.float() == kept_min) & (ours == 0)).any(-1).sum())
    assert boundary_ties > 0  # some rows dropped a token tied with one they kept: the tie rule was exercised


def test_the_distribution_has_no_host_sync():
    """Temperature, top-k and top-p make no host read (the static executor and CUDA graphs run them)."""
    logits = tie_heavy_logits(torch.bfloat16, 300, torch.Generator().manual_seed(0))
    with SyncCounter() as syncs:
        probs_from_logits(logits, SamplingConfig(temperature=0.7, top_k=20, top_p=0.8))
        probs_from_logits(logits, SamplingConfig(temperature=1e-39, top_p=0.8))
    assert syncs.counts["reads"] == 0 and syncs.counts["h2d"] == 0


@pytest.mark.parametrize("candidates", [1, 3])
@pytest.mark.parametrize("deterministic", [False, True])
def test_recursive_rejection_reproduces_target(candidates, deterministic):
    """One node with several siblings drawn without replacement from q: the output follows p."""
    gen = torch.Generator().manual_seed(candidates + 10 * deterministic)
    V = 6
    p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
    q = torch.tensor([0.05, 0.10, 0.40, 0.05, 0.30, 0.10])
    tree = TreeShape([0] * candidates)
    counts = np.zeros(V)
    n = 20000
    for _ in range(n):
        if deterministic:
            cand = torch.topk(q, candidates).indices
            qs = None
        else:
            cand = torch.multinomial(q, candidates, replacement=False, generator=gen)
            qs = q.expand(candidates, V)
        path, bonus = sampling_accept(tree, [0] + cand.tolist(), torch.stack([p] + [p] * candidates), qs, gen)
        token = cand[path[1] - 1].item() if len(path) > 1 else bonus
        counts[token] += 1
    assert chi2_pvalue(counts, p.numpy()) > P_THRESHOLD
    # and a 2% shift of mass is detected at this sample size
    biased = p.clone()
    biased[0] += 0.02
    biased[1] -= 0.02
    assert chi2_pvalue(counts, biased.numpy()) < P_THRESHOLD


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=4)],
                         ids=["t1", "t07-topk4"])
def test_speculative_sampling_matches_target_distribution(cfg):
    """Empirical joint of the first 3 tokens under early-exit drafting == exact target joint."""
    model = make_model("llama", seed=7, vocab_size=5, layers=2)
    runner = Runner.from_model(model)
    engine = Engine(runner, build_drafter("early_exit", runner, {"exit_layer": 1, "num_draft": 3}))
    pvalue, totals = sampling_pvalue(engine, model, [1, 2, 3], cfg, samples=2500, seed=1234)
    assert 0.2 < totals["accepted"] / totals["drafted"] < 0.95  # the draft differs from the target but is used
    assert pvalue > P_THRESHOLD


@pytest.mark.parametrize("temperature", [1e-39, 1e-50])
def test_a_tiny_temperature_is_the_greedy_limit_for_every_drafter(temperature):
    """Dividing logits by 1e-39 overflowed to inf / inf (and 1e-50 is 0 in fp32): NaN probabilities; the limit is the
    argmax, so sampled output equals greedy output."""
    model = make_model("llama", seed=3)
    runner = Runner.from_model(model)
    cfg = DecodeConfig(max_new_tokens=10, sampling=SamplingConfig(temperature=temperature, seed=0))
    cases = example_cases(ExampleModel(runner.num_layers)) | {
        "early_exit_confidence": ("early_exit", {"exit_layer": 2, "confidence": 0.3})}
    for name, options in cases.values():
        engine = Engine(runner, build_drafter(name, runner, options))
        greedy = engine.generate([5, 6, 7], DecodeConfig(max_new_tokens=10))
        assert Engine(runner, build_drafter(name, runner, options)).generate([5, 6, 7], cfg).tokens == greedy.tokens


def test_logits_that_are_not_finite_are_one_line_under_sampling():
    logits = torch.tensor([[0.0, float("nan"), 1.0]])
    with pytest.raises(UserError, match="not finite") as err:
        select(logits, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    assert "\n" not in str(err.value)
