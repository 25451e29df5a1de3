"""Classify a difference between a drafter's greedy output and plain autoregressive decoding.

A forward over T rows need not round each row as a forward over one row does (matmul, attention
and reduction order depend on the row count; on a GPU cuBLAS also picks its kernels per shape, fp32
included), so verifying T tokens at once can move the target's logits slightly and flip an argmax
where its two best logits are (nearly) tied. Such a *tie flip* is a property of the arithmetic, not
a bug; any other difference is a bug. Measured with :func:`measure_spread` on a CPU (T = 2..32, the
largest difference of any logit): ~1e-6 in fp32 and 0.02 in bf16 (eager; 0 on the static executor)
on the tests' tiny models; 5e-5 in fp32 and 0.9-1.2 in bf16 on SmolLM2-135M-Instruct.

The rule, at the first position where the outputs differ:

1. The run being judged must have emitted what its own verification chose there: greedy decoding
   emits the verification's argmax, so an emitted token that is not it (an acceptance bug emitting
   the target's runner-up, say) is a bug, whatever the margin. ``decode_verified`` records that
   argmax per output token through the engine's public ``start``/``step``; peers (transformers)
   expose none and are judged by the rules below alone.
2. Recompute the target's logits exactly as the reference run computed them: the same executor
   (eager, static or CUDA graphs), the same pooled cache capacity (the same ``DecodeConfig``),
   the prompt prefilled in one forward, then one token per forward (``Engine.target_logits``).
   If that row does not pick the reference's token, the reference disagrees with itself: a bug.
3. Otherwise the margin ``logit(ref_token) - logit(out_token)`` (>= 0) is a tie flip when it is at
   most the *tie bound* ``max(4 * rounding, ULPS ulps)``. ``rounding`` is measured by
   :func:`measure_rounding` on a path independent of the verification being judged: the one-row
   incremental path (what plain decoding runs) against an fp32 recomputation of the same positions
   (one full-sequence forward of fp32 weights). Each logit of either run lies within ``rounding`` of
   the exact value (measured for the one-row path; assumed, not measured, for the many-row
   verification, which uses the same dtype and kernels), the exact margin lies between the two
   runs' opposite margins, so the reference's margin is at most ``2 * rounding + 2 * rounding``.
   A broken many-row path cannot widen this bound, as the one-row vs many-row ``measure_spread``
   (kept as a diagnostic) would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter
from infer.model.program import BULK, Program, Rows
from infer.model.runner import Runner

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


def tie_bound(rounding: float, magnitude: float, dtype: torch.dtype) -> float:
    """Largest margin called a tie: four times the measured per-logit ``rounding`` (two logits, two runs), at
    least ``ULPS`` ulps of ``dtype`` at the logits' ``magnitude``."""
    return max(4.0 * rounding, ULPS * ulp(magnitude, dtype))


def classify_logits(logits_row: Tensor, ref_token: int, out_token: int, dtype: torch.dtype,
                    rounding: float = 0.0, verified: int | None = None) -> tuple[float, float, bool, str]:
    """(margin, bound, tie_flip, reason) for the reference's own logits row (V,) at a divergent position;
    ``verified``: the judged run's own verification argmax there (None: not known, a peer)."""
    row = logits_row.float().reshape(-1)  # (V,)
    a, b = float(row[ref_token]), float(row[out_token])
    margin = a - b
    bound = tie_bound(rounding, max(abs(a), abs(b)), dtype)
    winner = int(row.argmax())
    if verified is not None and verified != out_token:
        return margin, bound, False, (f"the run emitted token {out_token} where its own verification chose "
                                      f"{verified}: an acceptance bug")
    if margin < 0 or winner != ref_token:
        return margin, bound, False, (f"reference disagrees with itself: its recomputed logits pick token {winner}, "
                                      f"not its output {ref_token}")
    if margin > bound:
        return margin, bound, False, f"margin {margin:.3g} exceeds the tie bound {bound:.3g}"
    return margin, bound, True, ""


def decode_verified(engine: Engine, prompt_ids: Sequence[int], config: DecodeConfig,
                    generator: torch.Generator | None = None) -> tuple[list[int], list[int], list]:
    """(tokens, verified, outcomes) of one greedy generation: ``verified[i]`` is the argmax the run's own
    verification (or prefill, for the first token) chose for output token ``i``; ``outcomes`` are the
    engine's ``VerifyOutcome`` per cycle."""
    gen = engine.start(prompt_ids, config, generator)
    verified, outcomes = list(gen.tokens), []
    while not gen.done:
        outcome = engine.step(gen)
        outcomes.append(outcome)
        verified += [outcome.target_argmax[p] for p in outcome.path] if outcome.target_argmax else outcome.tokens
    tokens = engine.finish(gen).tokens
    return tokens, verified[:len(tokens)], outcomes


def reference_engine(runner) -> Engine:
    """The engine plain decoding runs with: the autoregressive drafter on ``runner`` (its executor, its cache pool)."""
    return Engine(runner, build_drafter("autoregressive", runner))


def classify_divergence(runner, prompt_ids: Sequence[int], ref: list[int], out: list[int],
                        config: DecodeConfig | None = None, rounding: float = 0.0,
                        verified: Sequence[int] | None = None) -> Divergence | None:
    """Classify the first difference of ``out`` from the autoregressive ``ref``; None when they agree.

    ``config`` must be the ``DecodeConfig`` the reference was generated with (it sets the pooled
    cache's capacity, hence the static forwards that ran); ``rounding`` is :func:`measure_rounding`'s
    ``max_abs`` for this runner (0: only the ulp floor); ``verified``: the judged run's own verification
    argmax per output token (:func:`decode_verified`; None for a peer). A length difference (one output
    ended first) is never a tie flip.
    """
    pos = first_divergence(ref, out)
    if pos is None:
        return None
    if pos >= len(ref) or pos >= len(out):
        return Divergence(pos, ref[pos] if pos < len(ref) else -1, out[pos] if pos < len(out) else -1,
                          math.inf, 0.0, False, "one output ended first")
    row = reference_engine(runner).target_logits(list(prompt_ids), list(ref[:pos]), config)  # (V,)
    own = None if verified is None else int(verified[pos])
    margin, bound, tie, reason = classify_logits(row, ref[pos], out[pos], runner.dtype, rounding, own)
    return Divergence(pos, ref[pos], out[pos], margin, bound, tie, reason)


# --------------------------------------------------------------------------- the spread
def spread_prompts(vocab_size: int, lengths: Sequence[int] = SPREAD_PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    """Seeded random prompts (ids 3 .. vocab-1, so no special token of the tiny models) of ``lengths``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()  # the engine's grad mode: compiled steps guard on it
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
        hidden = runner.run(Program(0, L), Rows.one(cache, runner.embed(ids), torch.arange(P, device=runner.device),
                                                    kind=BULK)).hidden  # (P, d)
        chain = [int(runner.logits(hidden[-1:])[0].argmax())]
        singles, step = [], Program(0, L, logits=True)
        for i in range(n):
            one = runner.embed(runner.to_device(chain[i:i + 1]))  # (1, d)
            row = runner.run(step, Rows.one(cache, one, [P + i])).logits  # (1, V)
            singles.append(row)
            chain.append(int(row[0].argmax()))
        alone = torch.cat(singles)  # (n, V)
        out = {}
        for T in sizes:
            cache.rollback(P)
            rows = Rows.one(cache, runner.embed(runner.to_device(chain[:T])), list(range(P, P + T)))
            many = runner.run(step, rows).logits  # (T, V)
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


@torch.no_grad()  # the engine's grad mode: compiled steps guard on it
def chain_rounding(runner, reference, prompt_ids: Sequence[int], n: int) -> float:
    """Max |logit difference| between ``runner``'s one-row incremental path (the prompt prefilled, then one token
    per forward, as plain decoding runs) and one full-sequence forward of the fp32 ``reference`` over the same
    positions (the target's greedy chain after the prompt, n + 1 rows)."""
    engine = reference_engine(runner)
    prompt, P, L = [int(t) for t in prompt_ids], len(prompt_ids), runner.num_layers
    cache = runner.take_cache(engine.cache_length(P, n))
    try:
        given = Rows.one(cache, runner.embed(runner.to_device(prompt)), torch.arange(P, device=runner.device),
                         kind=BULK)
        rows = [runner.logits(runner.run(Program(0, L), given).hidden[-1:])]  # [(1, V)]
        chain, step = [int(rows[0][0].argmax())], Program(0, L, logits=True)
        for i in range(n):
            one = runner.embed(runner.to_device(chain[i:i + 1]))  # (1, d)
            rows.append(runner.run(step, Rows.one(cache, one, [P + i])).logits)  # (1, V)
            chain.append(int(rows[-1][0].argmax()))
    finally:
        runner.release_cache(cache)
    ids = torch.tensor(prompt + chain[:n], device=reference.device)  # (P + n,)
    exact = reference.forward(reference.new_cache(P + n + 1), ids)[P - 1:].float()  # (n + 1, V)
    return float((torch.cat(rows).float().to(exact.device) - exact).abs().max())


def measure_rounding(runner, reference=None, prompts: Sequence[Sequence[int]] | None = None, n: int = 16) -> dict:
    """Per-logit rounding of ``runner``'s one-row path against an fp32 recomputation, over ``prompts`` (default
    :func:`spread_prompts`) and ``n`` greedy tokens each: the tie bound's input, measured on a path independent of
    any many-row verification.

    ``reference``: an fp32 runner of the same weights (as ``runner`` rounds them: build it from the model cast to
    ``runner``'s dtype); default ``runner`` itself when it is fp32 (its full-sequence prefill path). Returns
    ``{"max_abs", "executor", "dtype", "prompts", "tokens", "path"}``.
    """
    if reference is None:
        if runner.dtype != torch.float32:
            raise ValueError(f"measuring the rounding of a {runner.dtype} runner needs an fp32 reference runner")
        reference = runner
    if reference.dtype != torch.float32:
        raise ValueError(f"the reference runner must be fp32, not {reference.dtype}")
    prompts = spread_prompts(runner.spec.vocab_size) if prompts is None else prompts
    worst = max((chain_rounding(runner, reference, p, n) for p in prompts), default=0.0)
    return {"max_abs": worst, "executor": runner.executor, "dtype": str(runner.dtype).removeprefix("torch."),
            "prompts": len(prompts), "tokens": n, "path": "one-row incremental vs fp32 full-sequence recomputation"}


def rounded_reference(path, dtype: torch.dtype, device) -> object:
    """An fp32 runner of a model folder's weights rounded to ``dtype`` first, as a ``dtype`` runner holds them: the
    independent fp32 recomputation :func:`measure_rounding` needs to judge a bf16/fp16 runner."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dtype).float()  # rounded, then fp32
    return Runner.from_model(model, dtype=torch.float32, device=device)


class DivergenceJudge:
    """Classifies one runner's divergences from its plain-decoding references, all generated with ``config``.

    The tie bound's ``rounding``: given, or measured on the first divergence that needs it (once) by
    :func:`measure_rounding` against ``reference`` (an fp32 runner of the same weights, or ``make_reference``
    building one on that first need, e.g. :func:`rounded_reference`; the runner itself when it is fp32). A non-fp32
    runner with neither falls back to the one-row vs many-row :func:`measure_spread`, a bound measured through the
    verification path it vouches for (``bound_source`` says which was used).
    """

    def __init__(self, runner, config: DecodeConfig | None = None, rounding: float | None = None,
                 reference=None, make_reference=None):
        self.runner, self.config, self.reference = runner, config, reference
        self.make_reference = make_reference
        self._rounding = rounding
        self.bound_source = "given" if rounding is not None else None

    @property
    def rounding(self) -> float:
        if self._rounding is None and self.reference is None and self.make_reference is not None:
            self.reference = self.make_reference()
        if self._rounding is None:
            if self.reference is None and self.runner.dtype != torch.float32:
                # the spread bounds the two runs' difference, up to twice a logit's rounding: the bound stays 2 x spread
                self._rounding, self.bound_source = measure_spread(self.runner)["max_abs"] / 2, "many-row spread"
            else:
                self._rounding = measure_rounding(self.runner, self.reference)["max_abs"]
                self.bound_source = "fp32 recomputation"
        return self._rounding

    def classify(self, prompt_ids: Sequence[int], ref: list[int], out: list[int],
                 verified: Sequence[int] | None = None) -> Divergence | None:
        """``verified``: the judged run's own verification argmax per output token (None for a peer)."""
        if first_divergence(ref, out) is None:
            return None
        return classify_divergence(self.runner, prompt_ids, ref, out, self.config, self.rounding, verified)
