"""The two objectives of `layerskip search` (``infer.selfsd.search``) and their cost model.

- ``ModelObjective``: a noise-free expected speed-up from teacher-forced agreement of a plan's draft with the full
  model (over each calibration prompt's greedy continuation) and a draft/verify cost model (``measure_cost`` or
  ``infer.model.plan.weights_cost``), replayed as chain drafting over a (k, gamma) grid.
- ``SpeedObjective``: measured self-speculative decoding speed with the plan (Self-SD's own objective).

Both score a plan with the draft head they are given (the full LM head, or one reduced-vocabulary head), and the
cost model counts that head's share: one head per search, the one recorded in the plan file.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import Spec, build_drafter, drafter_spec
from infer.drafters.self_sd import SelfSDDrafter
from infer.drafters.skipping import agreement, verified_window
from infer.model.plan import CostModel, LayerPlan, cycle_speedup
from infer.model.program import ONCE, Program, Rows
from infer.model.runner import Runner
from layerskip_core.draft_vocab import DraftVocab

SPEED_SEARCH_CONFIDENCE = 0.8
"""The speed objective's threshold: ``decoding.py``'s default initial gamma, adaptive, restarted on every prompt
(the reference search passes no threshold, so each calibration prompt starts from it)."""
K_GRID = (1, 2, 3, 4, 6, 8, 12, 16)
GAMMA_GRID = (0.0, 0.5, 0.7, 0.8, 0.9)


# --------------------------------------------------------------------------- costs
@torch.no_grad()
def measure_cost(runner: Runner, context: Sequence[int], max_tokens: int, repeats: int = 7) -> CostModel:
    """Time single-token forwards under all-attention / all-MLP / everything skipped, and T-token verifies."""
    L = runner.num_layers
    cache = runner.new_cache(len(context) + max_tokens + 8)
    ids = torch.tensor(list(context), device=runner.device)
    runner.run(Program(0, L), Rows.one(cache, runner.embed(ids), torch.arange(len(context), device=runner.device),
                                       kind=ONCE))
    n = len(context)

    def timed(plan: LayerPlan | None, T: int) -> float:
        tok = ids[-1:].repeat(T)  # (T,)
        pos = torch.arange(n, n + T, device=runner.device)
        times = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            runner.forward(cache, tok, pos, plan=plan)  # (T, V)
            times.append(time.perf_counter() - t)
            cache.rollback(n)
        return statistics.median(times[1:])

    full = timed(None, 1)
    no_attn = timed(LayerPlan(L, frozenset(range(L))), 1)
    no_mlp = timed(LayerPlan(L, frozenset(), frozenset(range(L))), 1)
    nothing = timed(LayerPlan(L, frozenset(range(L)), frozenset(range(L))), 1)
    attn = max(full - no_attn, 0.0) / L / full
    mlp = max(full - no_mlp, 0.0) / L / full
    base = nothing / full
    verify = [1.0] + [timed(None, T) / full for T in range(2, max_tokens + 1)]
    return CostModel(base, attn, mlp, verify, "measured")


# --------------------------------------------------------------------------- objectives
def replay(agree: Sequence[bool], top1: Sequence[float], k: int, gamma: float) -> tuple[int, int, int, list]:
    """Replay greedy chain drafting over one teacher-forced continuation of G tokens.

    ``agree[i]``/``top1[i]``: does the draft, given the true prefix, predict continuation token i,
    and with which top-1 probability. Token 0 comes from the prefill. Returns (tokens produced by
    verification cycles, drafted, accepted, [(draft forwards, tokens verified) per cycle]).
    """
    G = len(agree)
    j, tokens, drafted, accepted = 0, 0, 0, 0
    cycles = []
    while j < G - 1:
        budget = G - 1 - j  # tokens still to produce
        kk = min(k, budget - 1)
        proposed = f = 0
        for i in range(j + 1, j + 1 + kk):  # Self-SD proposes the low-confidence token, then stops
            f += 1
            proposed += 1
            if top1[i] < gamma:
                break
        run = 0
        while run < proposed and agree[j + 1 + run]:
            run += 1
        new = min(run + 1, budget)
        tokens += new
        drafted += proposed
        accepted += run
        cycles.append((f, proposed + 1))
        j += new
    return tokens, drafted, accepted, cycles


@dataclass
class Calibration:
    """One calibration prompt and the full model's greedy continuation of it."""

    prompt: list[int]
    continuation: list[int]


class ModelObjective:
    """Expected speed-up of a plan from teacher-forced agreement and a cost model (noise-free)."""

    def __init__(self, runner: Runner, calibration: list[Calibration], cost: CostModel, max_draft: int,
                 vocab: DraftVocab | None = None):
        self.runner, self.cost = runner, cost
        self.head = None if vocab is None else runner.draft_head(vocab.ids)  # the draft head plans are scored with
        self.head_share = 1.0 if vocab is None else vocab.head_share
        self.ks = [k for k in K_GRID if k < max_draft] + [max_draft]
        self.windows = []
        for item in calibration:
            seq = item.prompt + item.continuation
            n = len(seq) - 1  # seq[:n] in the cache; the window re-runs seq[P-1:n] and predicts seq[P:n+1]
            s = n - len(item.continuation)
            cache = runner.new_cache(n + len(item.continuation) + 1)
            ids = torch.tensor(seq, device=runner.device)
            with torch.no_grad():
                rows = Rows.one(cache, runner.embed(ids[:n]), torch.arange(n, device=runner.device), kind=ONCE)
                runner.run(Program(0, runner.num_layers), rows)
            self.windows.append(verified_window(runner, cache, n, s, ids[s:n], ids[s + 1:n + 1], "exact",
                                                layer_inputs=True))

    def agreement(self, plan: LayerPlan) -> tuple[list[list[bool]], list[list[float]]]:
        """Per calibration item: does the plan's argmax equal the full model's token, and its top-1 prob."""
        scored = [agreement(self.runner, window, plan, self.head) for window in self.windows]
        return [agree.tolist() for agree, _ in scored], [top1.tolist() for _, top1 in scored]

    def __call__(self, plan: LayerPlan) -> tuple[float, dict]:
        agree, top1 = self.agreement(plan)
        c = self.cost.draft(plan, self.head_share)
        best: tuple[float, dict] = (float("-inf"), {})
        matchness = sum(sum(a) for a in agree) / sum(len(a) for a in agree)
        for k in self.ks:
            for gamma in GAMMA_GRID:
                tokens = cycles = drafted = accepted = forwards = 0
                verify = 0.0
                for a, p in zip(agree, top1, strict=True):
                    t, d, acc, steps = replay(a, p, k, gamma)
                    tokens += t
                    cycles += len(steps)
                    drafted += d
                    accepted += acc
                    forwards += sum(f for f, _ in steps)
                    verify += sum(self.cost.verify_cost(v) for _, v in steps)
                speedup = cycle_speedup(tokens, forwards, c, verify) if cycles else 0.0
                if speedup > best[0]:
                    best = (speedup, {"k": k, "gamma": gamma, "acceptance_rate": accepted / drafted if drafted else 0.0,
                                      "tokens_per_verify": tokens / cycles if cycles else 0.0, "drafted": drafted,
                                      "tokens": tokens})
        value, metrics = best
        metrics.update(matchness=matchness, draft_cost=c, expected_speedup=value)
        return value, metrics


class SpeedObjective:
    """Measured self-speculative greedy decoding speed with a plan (Self-SD's objective).

    ``reference='interleaved'``: every prompt is decoded autoregressively right before it is
    decoded with the plan, and the value is the speed-up over that (a ratio measured in one run,
    robust to a shared machine's drift; each trial decodes twice). ``'once'``: the value is the
    plan's tokens/s, as in Self-SD, and the speed-up is against one baseline timed before the search.
    """

    def __init__(self, runner: Runner, prompts: list[list[int]], max_new_tokens: int, num_draft: int,
                 reference: str = "interleaved", vocab: DraftVocab | None = None):
        self.runner, self.prompts, self.num_draft, self.reference = runner, prompts, num_draft, reference
        self.vocab = vocab  # the draft head every plan drafts with (None: the full head)
        self.gen = DecodeConfig(max_new_tokens=max_new_tokens, stop_at_eos=False)
        self.baseline_engine = Engine(runner, build_drafter("autoregressive", runner))
        self.baseline_engine.generate(prompts[0], DecodeConfig(max_new_tokens=4, stop_at_eos=False))  # warm-up
        self.baseline = self._tokens_per_second(self.baseline_engine)

    def drafter_spec(self, plan: LayerPlan) -> Spec:
        """``decoding.py``'s defaults as ``searching.py`` uses them: k, gamma_0 = 0.8 adaptive, from 0.8 per prompt."""
        options = {"plan": plan, "num_draft": self.num_draft, "confidence": SPEED_SEARCH_CONFIDENCE,
                   "carry_confidence": False, "draft_vocab": self.vocab or "off"}
        return drafter_spec("self_sd", options)

    def _tokens_per_second(self, engine) -> float:
        results = [engine.generate(ids, self.gen) for ids in self.prompts]
        return sum(r.stats.new_tokens for r in results) / sum(r.stats.wall_time for r in results)

    def __call__(self, plan: LayerPlan) -> tuple[float, dict]:
        # a new engine per plan (a live engine's drafter is never swapped), drafting as the reference search does
        results, ar_tokens, ar_wall = [], 0, 0.0
        spec = self.drafter_spec(plan)
        with Engine(self.runner, SelfSDDrafter(self.runner, spec.config, spec.resolve(self.runner).inputs)) as engine:
            for ids in self.prompts:
                if self.reference == "interleaved":
                    ar = self.baseline_engine.generate(ids, self.gen).stats
                    ar_tokens, ar_wall = ar_tokens + ar.new_tokens, ar_wall + ar.wall_time
                results.append(engine.generate(ids, self.gen))
        tps = sum(r.stats.new_tokens for r in results) / sum(r.stats.wall_time for r in results)
        baseline = ar_tokens / ar_wall if self.reference == "interleaved" else self.baseline
        drafted = sum(r.stats.drafted for r in results)
        calls = sum(r.stats.verify_calls for r in results)
        metrics = {"tokens_per_second": tps, "speedup": tps / baseline, "autoregressive_tokens_per_second": baseline,
                   "acceptance_rate": sum(r.stats.accepted for r in results) / drafted if drafted else 0.0,
                   "drafted": drafted, "tokens": sum(r.stats.new_tokens for r in results),
                   "tokens_per_verify": sum(r.stats.new_tokens - 1 for r in results) / calls if calls else 0.0,
                   "final_confidence": statistics.mean(r.stats.drafter.confidence for r in results)}
        return (tps / baseline if self.reference == "interleaved" else tps), metrics


def calibration_set(runner: Runner, prompts: list[list[int]], max_new_tokens: int) -> list[Calibration]:
    """The full model's greedy continuations of the calibration prompts (EOS ignored)."""
    gen = DecodeConfig(max_new_tokens=max_new_tokens, stop_at_eos=False)
    with Engine(runner, build_drafter("autoregressive", runner)) as engine:
        return [Calibration(list(p), engine.generate(p, gen).tokens) for p in prompts]
