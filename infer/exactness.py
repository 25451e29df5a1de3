"""Classify a difference between a drafter's greedy output and plain autoregressive decoding.

In fp32 every drafter's greedy output equals autoregressive decoding token for token (the
runner's kernels are batch-invariant there). In bf16/fp16, and with GPU kernels in general, a
matmul over T rows need not round each row as a matmul over one row does, so verifying T tokens
at once can flip an argmax where the target's two best logits are (nearly) tied. Such a *tie
flip* is a property of the arithmetic, not a bug; any other difference is a bug.

The rule: at the first position where the outputs differ, recompute the target's logits the way
autoregressive decoding computed them (prompt prefill, then one token at a time) and take the
margin ``logit(ref_token) - logit(out_token)``. The difference is a tie flip when the margin is at
most ``ULPS`` units in the last place of the dtype at the larger magnitude of the two logits.
Why 4: each logit is rounded to the dtype at least once at the LM head output (half an ulp each,
so one ulp between two logits), and the hidden state feeding the head is rounded once more after
the final norm; a batch-dependent reduction order moves each rounding by at most an ulp, so a
genuine near-tie can move by about 2-3 ulps. 4 leaves a little headroom without hiding bugs:
in fp32 at logits of magnitude ~30 it is 1.5e-5, far below any real mismatch; in bf16 it is
0.5 (ulp 0.125 for magnitudes in [16, 32)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

ULPS = 4
"""Margins up to this many units in the last place (of the dtype, at the logits' magnitude) are ties."""


@dataclass
class Divergence:
    """The first difference between a reference (autoregressive) output and another output."""

    position: int
    """Index in the generated tokens of the first difference."""
    ref_token: int
    """Token of the reference output there (-1 when the reference ended first)."""
    out_token: int
    """Token of the other output there (-1 when it ended first)."""
    margin: float
    """Target logit(ref_token) - logit(out_token) at that position (>= 0 for a greedy reference)."""
    resolution: float
    """The dtype's resolution at that logit magnitude (``ULPS`` ulps)."""
    tie_flip: bool
    """margin <= resolution: a near-tie flipped by batch non-invariance, not a bug."""


def first_divergence(ref: list[int], out: list[int]) -> int | None:
    """Index of the first differing token; the shorter length if one is a strict prefix; None if equal."""
    for i, (a, b) in enumerate(zip(ref, out, strict=False)):
        if a != b:
            return i
    return None if len(ref) == len(out) else min(len(ref), len(out))


def ulp(value: float, dtype: torch.dtype) -> float:
    """Spacing of ``dtype`` numbers at magnitude ``|value|`` (at least the spacing at 1.0)."""
    eps = torch.finfo(dtype).eps  # spacing in [1, 2)
    _, exponent = math.frexp(max(abs(value), 1.0))  # |value| = m * 2**exponent, 0.5 <= m < 1
    return eps * 2.0 ** (exponent - 1)


def classify_logits(logits_row: Tensor, ref_token: int, out_token: int,
                    dtype: torch.dtype) -> tuple[float, float, bool]:
    """(margin, resolution, tie_flip) for the target logits row (V,) at a divergent position."""
    row = logits_row.float().reshape(-1)  # (V,)
    a, b = float(row[ref_token]), float(row[out_token])
    margin = a - b
    resolution = ULPS * ulp(max(abs(a), abs(b)), dtype)
    return margin, resolution, margin <= resolution


def reference_logits(runner, prompt_ids: list[int], tokens: list[int]) -> Tensor:
    """Target logits (V,) after ``prompt_ids + tokens``, computed as autoregressive decoding does.

    The prompt is prefilled in one forward, then each token runs alone (T = 1), so the numerics
    are those of the reference output rather than of a batched forward.
    """
    cache = runner.new_cache(len(prompt_ids) + len(tokens) + 1)
    device = runner.device
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)  # (P,)
    hidden = runner.forward_layers(cache, runner.embed(ids), torch.arange(len(prompt_ids), device=device),
                                   bulk=True)  # (P, d)
    logits = runner.logits(hidden[-1:])  # (1, V)
    for i, token in enumerate(tokens):
        pos = torch.tensor([len(prompt_ids) + i], device=device)  # (1,)
        one = torch.tensor([token], dtype=torch.long, device=device)  # (1,)
        logits = runner.logits(runner.forward_layers(cache, runner.embed(one), pos))  # (1, V)
    return logits[0]


def classify_divergence(runner, prompt_ids: list[int], ref: list[int], out: list[int]) -> Divergence | None:
    """Classify the first difference of ``out`` from the autoregressive ``ref``; None when they agree.

    A length difference (one output ended first) is never a tie flip.
    """
    pos = first_divergence(ref, out)
    if pos is None:
        return None
    if pos >= len(ref) or pos >= len(out):
        return Divergence(pos, ref[pos] if pos < len(ref) else -1, out[pos] if pos < len(out) else -1,
                          math.inf, 0.0, False)
    row = reference_logits(runner, list(prompt_ids), list(ref[:pos]))  # (V,)
    margin, resolution, tie = classify_logits(row, ref[pos], out[pos], runner.dtype)
    return Divergence(pos, ref[pos], out[pos], margin, resolution, tie)
