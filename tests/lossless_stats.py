"""Statistical losslessness checks shared by the drafter tests (tiny vocabularies, exact targets)."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from scipy.stats import chisquare

from infer.decode.engine import DecodeConfig
from infer.model.sampling import SamplingConfig, probs_from_logits

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
