"""Statistical losslessness checks shared by the drafter tests (tiny vocabularies, exact targets)."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from scipy.stats import chisquare
from torch import Tensor
from transformers.generation import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from infer.decode.engine import DecodeConfig
from infer.model.sampling import SamplingConfig
from tiny_models import make_model

P_THRESHOLD = 1e-3  # fixed seeds make the tests deterministic; the threshold guards against a real bias


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit, pooling cells expected to hold fewer than 5 samples; 0 where a cell of
    probability 0 was drawn."""
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum()
    if counts[probs == 0].sum() > 0:  # a draw the target rules out (a token outside its top-k / top-p): not a fit
        return 0.0
    keep = probs * counts.sum() >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(probs[keep], probs[~keep].sum()) * counts.sum()
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp).pvalue


def transformers_probs(logits: Tensor, cfg: SamplingConfig) -> Tensor:
    """(..., V) logits -> (..., V) probabilities under transformers' own warpers, as ``generate`` builds them for
    ``cfg`` (temperature unless 1, top-k unless 0, top-p unless 1, on fp32 scores), then its softmax: the reference
    that ``probs_from_logits`` must equal, ties included."""
    processors = LogitsProcessorList()
    if cfg.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(float(cfg.temperature)))
    if cfg.top_k:
        processors.append(TopKLogitsWarper(cfg.top_k))
    if cfg.top_p < 1.0:
        processors.append(TopPLogitsWarper(cfg.top_p))
    scores = logits.float().reshape(-1, logits.shape[-1])  # (rows, V)
    return torch.softmax(processors(None, scores), dim=-1).reshape(logits.shape)


def target_joint(model, prompt: list[int], cfg: SamplingConfig, steps: int) -> dict[tuple[int, ...], float]:
    """Exact probability of every sequence of the first ``steps`` generated tokens, by enumeration, each position's
    distribution made by transformers' own warpers (``transformers_probs``: a reference independent of the code under
    test)."""
    vocab = model.config.vocab_size
    joint = {}
    for seq in itertools.product(range(vocab), repeat=steps):
        prob = 1.0
        for i in range(steps):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(seq[:i])])).logits[0, -1]
            prob *= transformers_probs(logits, cfg)[seq[i]].item()
            if prob == 0:
                break
        joint[seq] = prob
    return joint


def sampling_pvalue(engine, model, prompt: list[int], cfg: SamplingConfig, steps: int = 3, samples: int = 4000,
                    seed: int = 0, new_tokens: int | None = None) -> tuple[float, dict]:
    """p-value of the engine's sampled joint of the first ``steps`` tokens against the exact target joint.

    ``new_tokens`` (default ``steps``): tokens generated per sample (more than ``steps`` drafts longer chains; the
    first ``steps`` are tested). Also returns totals of the engine's statistics (accepted, drafted, draft_forwards),
    so a test can check that drafting was really exercised (the draft differs from the target and is used).
    """
    config = DecodeConfig(max_new_tokens=new_tokens or steps, sampling=cfg)
    gen = torch.Generator().manual_seed(seed)
    results = [engine.generate(prompt, config, generator=gen) for _ in range(samples)]
    return joint_pvalue(results, target_joint(model, prompt, cfg, steps), steps), totals_of(results)


def batch_sampling_pvalue(batch, model, prompt: list[int], cfg: SamplingConfig, steps: int = 3, samples: int = 4000,
                          seed: int = 0, new_tokens: int | None = None) -> tuple[float, dict]:
    """``sampling_pvalue`` through a ``BatchEngine``: the samples are the rows of one batched run of ``prompt``
    repeated, each row with its own generator (seeded ``seed + row``)."""
    config = DecodeConfig(max_new_tokens=new_tokens or steps, sampling=cfg)
    generators = [torch.Generator().manual_seed(seed + i) for i in range(samples)]
    results = batch.generate([prompt] * samples, config, generators)
    return joint_pvalue(results, target_joint(model, prompt, cfg, steps), steps), totals_of(results)


def joint_pvalue(results, joint: dict[tuple[int, ...], float], steps: int) -> float:
    """Chi-square p-value of the results' first ``steps`` tokens against ``joint`` (sequence -> probability)."""
    cells = sorted(joint)
    index = {c: i for i, c in enumerate(cells)}
    counts = np.zeros(len(cells))
    for res in results:
        counts[index[tuple(res.tokens[:steps])]] += 1
    return chi2_pvalue(counts, np.array([joint[c] for c in cells]))


def totals_of(results) -> dict:
    """Accepted, drafted and draft forwards summed over generation results."""
    return {"accepted": sum(r.stats.accepted for r in results), "drafted": sum(r.stats.drafted for r in results),
            "draft_forwards": sum(r.stats.drafter.draft_forwards for r in results)}


TIE_TOP_P = 0.85
"""With LM-head row 2 a copy of row 1, the first position's ascending probabilities are 0.099, 0.099 (the tied 1 and
2), 0.183, ...: the nucleus boundary 1 - 0.85 falls between the tied tokens, so the tie rule decides which is kept."""


def tied_model():
    """The sampling matrix's 5-token model with LM-head rows 1 and 2 identical: tokens 1 and 2 tie exactly at every
    position (in transformers' forward and in the runner's)."""
    model = make_model("llama", seed=7, vocab_size=5, layers=4)
    with torch.no_grad():
        model.lm_head.weight[2] = model.lm_head.weight[1]
    return model
