"""Statistical losslessness checks shared by the drafter tests (tiny vocabularies, exact targets)."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from scipy.stats import chisquare

from infer.engine import DecodeConfig
from infer.sampling import SamplingConfig, probs_from_logits

P_THRESHOLD = 1e-3  # fixed seeds make the tests deterministic; the threshold guards against a real bias


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit, pooling cells expected to hold fewer than 5 samples."""
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum()
    keep = probs * counts.sum() >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(probs[keep], probs[~keep].sum()) * counts.sum()
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp).pvalue


def target_joint(model, prompt: list[int], cfg: SamplingConfig, steps: int) -> dict[tuple[int, ...], float]:
    """Exact probability of every sequence of the first ``steps`` generated tokens, by enumeration."""
    vocab = model.config.vocab_size
    joint = {}
    for seq in itertools.product(range(vocab), repeat=steps):
        prob = 1.0
        for i in range(steps):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(seq[:i])])).logits[0, -1]
            prob *= probs_from_logits(logits, cfg)[seq[i]].item()
            if prob == 0:
                break
        joint[seq] = prob
    return joint


def sampling_pvalue(engine, model, prompt: list[int], cfg: SamplingConfig, steps: int = 3, samples: int = 4000,
                    seed: int = 0) -> tuple[float, dict]:
    """p-value of the engine's sampled joint of the first ``steps`` tokens against the exact target joint.

    Also returns totals of the engine's statistics (accepted, drafted, draft_forwards), so a test can check
    that drafting was really exercised (the draft differs from the target and is used).
    """
    joint = target_joint(model, prompt, cfg, steps)
    cells = sorted(joint)
    index = {c: i for i, c in enumerate(cells)}
    counts = np.zeros(len(cells))
    totals = {"accepted": 0, "drafted": 0, "draft_forwards": 0}
    gen = torch.Generator().manual_seed(seed)
    for _ in range(samples):
        res = engine.generate(prompt, DecodeConfig(max_new_tokens=steps, sampling=cfg), generator=gen)
        counts[index[tuple(res.tokens)]] += 1
        totals["accepted"] += res.stats.accepted
        totals["drafted"] += res.stats.drafted
        totals["draft_forwards"] += res.stats.drafter.draft_forwards
    return chi2_pvalue(counts, np.array([joint[c] for c in cells])), totals
