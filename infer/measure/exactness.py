"""Classify a difference between a drafter's greedy output and plain autoregressive decoding.

A forward over T rows need not round each row as a forward over one row does (matmul, attention
and reduction order depend on the row count; on a GPU cuBLAS also picks its kernels per shape, fp32
included), so verifying T tokens at once can move the target's logits slightly and flip an argmax
where its two best logits are (nearly) tied. Such a *tie flip* is a property of the arithmetic, not
a bug; any other difference is a bug. Measured with :func:`measure_spread` on a CPU (T = 2..32, the
largest difference of any logit): ~1e-6 in fp32 and 0.02 in bf16 (eager; 0 on the static executor)
on the tests' tiny models; 5e-5 in fp32 and 0.9-1.2 in bf16 on SmolLM2-135M-Instruct.

The rule, at the first position where the outputs differ:

1. Recompute the target's logits exactly as the reference run computed them: the same executor
   (eager, static or CUDA graphs), the same pooled cache capacity (the same ``GenerationConfig``),
   the prompt prefilled in one forward, then one token per forward (``Engine.target_logits``).
   The row is then the reference's own row, not an approximation of it: recomputing on another
   path (eager instead of static) can move a bf16 logit by more than any tie bound.
2. If that row does not pick the reference's token (another token has the larger logit), the
   reference disagrees with itself: a bug (non-deterministic kernels, or state leaking between
   runs), whatever the margin.
3. Otherwise the margin ``logit(ref_token) - logit(out_token)`` is >= 0, and the difference is a
   tie flip when the margin is at most the *tie bound*: how far the other run's verification can
   have moved the margin. Each logit of a row computed inside a T-row forward differs from the same
   row computed alone by at most the *spread* (measured by :func:`measure_spread` for a runner on
   its executor and dtype), so the margin between two tokens moves by at most twice the spread.
   The bound is ``max(2 * spread, ULPS ulps)``: the ulp floor covers the rounding of the two logits
   themselves where the spread measures 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from infer.drafters import build_drafter
from infer.engine import Engine, GenerationConfig

ULPS = 4
"""The bound's floor: margins up to this many units in the last place (of the dtype, at the logits' magnitude)."""
SPREAD_SIZES = tuple(range(2, 33))
"""Verification sizes T whose rows :func:`measure_spread` compares with one-row forwards."""
SPREAD_PROMPT_LENGTHS = (5, 9, 14)
"""Prompt lengths of the seeded random prompts :func:`spread_prompts` makes."""


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
    """Target logit(ref_token) - logit(out_token) at that position, recomputed on the reference's path."""
    resolution: float
    """The tie bound applied: margins in [0, resolution] are tie flips."""
    tie_flip: bool
    """0 <= margin <= resolution and the recomputed row picks ref_token: a near-tie flipped by batch
    non-invariance, not a bug."""
    reason: str = ""
    """Why it is a bug, when it is one ('' for a tie flip)."""


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


def tie_bound(spread: float, magnitude: float, dtype: torch.dtype) -> float:
    """Largest margin called a tie: twice the measured one-row vs many-row ``spread`` (each of the two
    logits can move by it), at least ``ULPS`` ulps of ``dtype`` at the logits' ``magnitude``."""
    return max(2.0 * spread, ULPS * ulp(magnitude, dtype))


def classify_logits(logits_row: Tensor, ref_token: int, out_token: int, dtype: torch.dtype,
                    spread: float = 0.0) -> tuple[float, float, bool, str]:
    """(margin, bound, tie_flip, reason) for the reference's own logits row (V,) at a divergent position."""
    row = logits_row.float().reshape(-1)  # (V,)
    a, b = float(row[ref_token]), float(row[out_token])
    margin = a - b
    bound = tie_bound(spread, max(abs(a), abs(b)), dtype)
    winner = int(row.argmax())
    if margin < 0 or winner != ref_token:
        return margin, bound, False, (f"reference disagrees with itself: its recomputed logits pick token {winner}, "
                                      f"not its output {ref_token}")
    if margin > bound:
        return margin, bound, False, f"margin {margin:.3g} exceeds the tie bound {bound:.3g}"
    return margin, bound, True, ""


def reference_engine(runner) -> Engine:
    """The engine plain decoding runs with: the autoregressive drafter on ``runner`` (its executor, its cache pool)."""
    return Engine(runner, build_drafter("autoregressive", runner))


def classify_divergence(runner, prompt_ids: Sequence[int], ref: list[int], out: list[int],
                        config: GenerationConfig | None = None, spread: float = 0.0) -> Divergence | None:
    """Classify the first difference of ``out`` from the autoregressive ``ref``; None when they agree.

    ``config`` must be the ``GenerationConfig`` the reference was generated with (it sets the pooled
    cache's capacity, hence the static forwards that ran); ``spread`` is :func:`measure_spread`'s
    ``max_abs`` for this runner (0: only the ulp floor). A length difference (one output ended first) is
    never a tie flip.
    """
    pos = first_divergence(ref, out)
    if pos is None:
        return None
    if pos >= len(ref) or pos >= len(out):
        return Divergence(pos, ref[pos] if pos < len(ref) else -1, out[pos] if pos < len(out) else -1,
                          math.inf, 0.0, False, "one output ended first")
    row = reference_engine(runner).target_logits(list(prompt_ids), list(ref[:pos]), config)  # (V,)
    margin, bound, tie, reason = classify_logits(row, ref[pos], out[pos], runner.dtype, spread)
    return Divergence(pos, ref[pos], out[pos], margin, bound, tie, reason)


# --------------------------------------------------------------------------- the spread
def spread_prompts(vocab_size: int, lengths: Sequence[int] = SPREAD_PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    """Seeded random prompts (ids 3 .. vocab-1, so no special token of the tiny models) of ``lengths``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def chain_spread(runner, prompt_ids: Sequence[int], sizes: Sequence[int] = SPREAD_SIZES) -> dict[int, float]:
    """Max |logit difference| per T between rows computed alone and inside a T-row forward, after one prompt.

    The chain is the target's greedy continuation of the prompt, decoded one token per forward as
    plain decoding does; then for each T the first T chain tokens go through one forward from the
    same prefix, as a verification of the pending token and T - 1 drafts does, and each of its rows
    is compared with the one-row forward at the same position (every logit of the vocabulary).
    """
    engine = reference_engine(runner)
    prompt, n = [int(t) for t in prompt_ids], max(sizes)
    P, L = len(prompt), runner.num_layers
    cache = runner.take_cache(engine.cache_length(P, n))
    try:
        ids = runner.to_device(prompt)  # (P,)
        hidden = runner.forward_layers(cache, runner.embed(ids), torch.arange(P, device=runner.device),
                                       bulk=True)  # (P, d)
        chain = [int(runner.logits(hidden[-1:])[0].argmax())]
        singles = []
        for i in range(n):
            one = runner.embed(runner.to_device(chain[i:i + 1]))  # (1, d)
            row = runner.span(cache, one, [P + i], 0, L, logits=True).logits  # (1, V)
            singles.append(row)
            chain.append(int(row[0].argmax()))
        alone = torch.cat(singles)  # (n, V)
        out = {}
        for T in sizes:
            cache.rollback(P)
            many = runner.span(cache, runner.embed(runner.to_device(chain[:T])), list(range(P, P + T)), 0, L,
                               logits=True).logits  # (T, V)
            out[T] = float((many - alone[:T]).abs().max())
    finally:
        runner.release_cache(cache)
    return out


def measure_spread(runner, prompts: Sequence[Sequence[int]] | None = None,
                   sizes: Sequence[int] = SPREAD_SIZES) -> dict:
    """One-row vs many-row spread of ``runner`` on its executor and dtype, over ``prompts`` (default:
    :func:`spread_prompts`) and verification sizes ``sizes``.

    Returns ``{"max_abs": float, "per_size": {T: float}, "executor": str, "dtype": str, "prompts": int}``;
    ``max_abs`` is the ``spread`` :func:`classify_divergence` takes.
    """
    prompts = spread_prompts(runner.spec.vocab_size) if prompts is None else prompts
    per_size = dict.fromkeys(sizes, 0.0)
    for prompt in prompts:
        for T, value in chain_spread(runner, prompt, sizes).items():
            per_size[T] = max(per_size[T], value)
    return {"max_abs": max(per_size.values(), default=0.0), "per_size": per_size, "executor": runner.executor,
            "dtype": str(runner.dtype).removeprefix("torch."), "prompts": len(prompts)}


class DivergenceJudge:
    """Classifies one runner's divergences from its plain-decoding references, all generated with ``config``.

    ``spread`` (a measured ``max_abs``): given, or measured by :func:`measure_spread` on the first divergence
    that needs it (once; seconds on a GPU, a minute or two for a 135M model on a CPU).
    """

    def __init__(self, runner, config: GenerationConfig | None = None, spread: float | None = None):
        self.runner, self.config = runner, config
        self._spread = spread

    @property
    def spread(self) -> float:
        if self._spread is None:
            self._spread = measure_spread(self.runner)["max_abs"]
        return self._spread

    def classify(self, prompt_ids: Sequence[int], ref: list[int], out: list[int]) -> Divergence | None:
        if first_divergence(ref, out) is None:
            return None
        return classify_divergence(self.runner, prompt_ids, ref, out, self.config, self.spread)
