"""Offline search of a sublayer skip plan for Self-SD (Zhang et al., ACL 2024, §3.2), with optuna.

The search space is the 2L binary choices "skip attention / MLP of layer l" (``infer.plan.PlanSpace``,
shared with SWIFT's online optimiser). Two objectives:

- ``speed``: measured end-to-end speed of self-speculative greedy decoding (the ``self_sd``
  drafter as the reference search runs it: k = 8, adaptive threshold from 0.8 on every prompt)
  on a few calibration prompts. What Self-SD optimises
  (as tokens/s); by default the value is the speed-up over autoregressive decoding of the same
  prompt timed just before, which cancels most of a shared machine's drift. Every trial decodes.
- ``model`` (alias ``acceptance``): a noise-free expected speed-up. The full model's greedy
  continuation of each calibration prompt is computed once; each plan is then run once,
  teacher-forced, over those continuations (one masked parallel forward per prompt) giving
  per-position agreement with the full model and the draft's top-1 probability (the scorer of
  ``infer.drafters.skipping`` in its 'exact' KV view). Each position is drafted as a real draft
  is after a verification: it attends to the full model's exact KV of
  every earlier (verified) token and to its own draft-mode KV (a draft deeper in a chain would
  also see the chain's earlier draft-mode rows; the replay ignores that). A replay of
  chain drafting over these vectors (draft k, stop below a confidence gamma, accept the
  matching prefix + one bonus token) gives tokens per cycle; the cycle cost is k·c + v(k+1),
  c the draft forward cost and v(T) the cost of verifying T tokens, both relative to one full
  single-token forward and either measured once before the search (``cost='measured'``) or
  counted in weights read (``cost='weights'``, fully deterministic). The value is the best
  expected speed-up (``infer.plan.cycle_speedup``) over a small (k, gamma) grid.

With ``skip_ratio`` the plan skips exactly round(ratio·2L) sublayers: the sampler still proposes
2L yes/no choices, and a deterministic repair adds skips (inner deep layers first) or drops them
(shallow layers first) until the count is right, so the value stays a function of the proposal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from infer.drafters import build_drafter
from infer.drafters.self_sd import SelfSDConfig, SelfSDDrafter
from infer.drafters.skipping import agreement, verified_window
from infer.engine import Engine, GenerationConfig
from infer.plan import CostModel, LayerPlan, PlanFile, PlanSpace, cycle_speedup, weights_cost
from infer.runner import Runner
from layerskip_core.errors import UserError

OBJECTIVES = {"model": "model", "acceptance": "model", "speed": "speed"}
SAMPLERS = ("tpe", "gp")
COSTS = ("measured", "weights")
SPEED_REFERENCES = ("interleaved", "once")
DEFAULT_NEW_TOKENS = {"model": 64, "speed": 32}
DEFAULT_NUM_DRAFT = {"model": 12, "speed": 8}
"""k per objective: the model objective replays up to Self-SD's evaluation k (12); the speed objective decodes as the
reference search does (``searching.py`` calls ``decoding.py``'s generate with its defaults: k = 8)."""
SPEED_SEARCH_CONFIDENCE = 0.8
"""The speed objective's threshold: ``decoding.py``'s default initial gamma, adaptive, restarted on every prompt
(the reference search passes no threshold, so each calibration prompt starts from it)."""
K_GRID = (1, 2, 3, 4, 6, 8, 12, 16)
GAMMA_GRID = (0.0, 0.5, 0.7, 0.8, 0.9)


# --------------------------------------------------------------------------- settings
@dataclass
class SearchConfig:
    """What `layerskip search` does."""

    objective: str = "model"
    """'model' (alias 'acceptance'): expected speed-up from teacher-forced agreement and draft cost;
    'speed': measured tokens/s of self-speculative decoding."""
    trials: int = 100
    """Distinct plans to evaluate in total (repeated proposals are free; a resumed study runs only the missing)."""
    skip_ratio: float | None = None
    """Skip exactly round(ratio * 2L) sublayers; None lets the search choose how many."""
    seed: int = 0
    """Seed of the optuna sampler."""
    timeout: float | None = None
    """Stop starting new trials after this many seconds of this run."""
    sampler: str = "tpe"
    """'tpe' (multivariate TPE) or 'gp' (Gaussian-process BO, as in Self-SD)."""
    n_prompts: int = 8
    """Calibration prompts, taken from the front of the data set."""
    max_new_tokens: int | None = None
    """Tokens per calibration prompt (default 64 for 'model', 32 for 'speed' as in Self-SD)."""
    num_draft: int | None = None
    """Most drafts per verification: the drafter's k for 'speed' (default 8, the reference search's), the largest k
    replayed for 'model' (default 12, Self-SD's evaluation k)."""
    cost: str = "measured"
    """'model' objective: draft/verify costs 'measured' once before the search, or counted in 'weights' read."""
    warm_start: bool = True
    """Enqueue uniform plans (evenly spread attention/MLP skips) as the first trials."""
    speed_reference: str = "interleaved"
    """'speed' objective: value = speed-up over autoregressive decoding timed right before each prompt
    ('interleaved', robust to machine drift, two decodes per prompt) or raw tokens/s ('once', as Self-SD)."""

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise UserError(f"unknown objective {self.objective!r}; choose speed, model or acceptance")
        self.objective = OBJECTIVES[self.objective]
        if self.sampler not in SAMPLERS:
            raise UserError(f"unknown sampler {self.sampler!r}; choose {' or '.join(SAMPLERS)}")
        if self.speed_reference not in SPEED_REFERENCES:
            raise UserError(f"unknown speed reference {self.speed_reference!r}; choose "
                            f"{' or '.join(SPEED_REFERENCES)}")
        if self.cost not in COSTS:
            raise UserError(f"unknown cost model {self.cost!r}; choose {' or '.join(COSTS)}")
        if self.trials < 1:
            raise UserError(f"--trials must be >= 1, got {self.trials}")
        if not 0 <= self.seed < 2**31:  # optuna's samplers seed numpy, which takes 32 bits (plus the trials done)
            raise UserError(f"--seed must be in [0, 2**31), got {self.seed}")
        if self.skip_ratio is not None and not 0.0 < self.skip_ratio < 1.0:
            raise UserError(f"--skip-ratio must be in (0, 1), got {self.skip_ratio}")
        if self.timeout is not None and self.timeout <= 0:
            raise UserError(f"--timeout must be > 0 seconds, got {self.timeout}")
        if self.n_prompts < 1:
            raise UserError(f"--n must be >= 1, got {self.n_prompts}")
        if self.max_new_tokens is None:
            self.max_new_tokens = DEFAULT_NEW_TOKENS[self.objective]
        if self.max_new_tokens < 4:
            raise UserError(f"--max-new-tokens must be >= 4, got {self.max_new_tokens}")
        if self.num_draft is None:
            self.num_draft = DEFAULT_NUM_DRAFT[self.objective]
        if self.num_draft < 1:
            raise UserError(f"--num-draft must be >= 1, got {self.num_draft}")

    def study_settings(self) -> dict:
        """What must not change when a study is resumed."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("trials", "timeout", "seed")}


# --------------------------------------------------------------------------- the optuna loop
@dataclass
class SearchResult:
    plan: LayerPlan
    """Best plan found."""
    value: float
    """Its objective value."""
    attrs: dict
    """Its metrics (acceptance, tokens per verify, chosen k, ...)."""
    completed: int
    """Distinct plans evaluated in the study."""
    best_trial: int
    """Number of the best trial."""
    wall_time: float
    """Seconds this run spent in the optimisation loop."""
    trial_time: float
    """Seconds all trials of the study took (over every run that contributed)."""
    history: list[float] = field(default_factory=list)
    """Best-so-far objective value after each evaluated plan."""
    proposals: int = 0
    """Completed trials including repeated proposals (which are not re-evaluated)."""


Evaluate = Callable[[LayerPlan], tuple[float, dict]]


# optuna is optional (an extra) and slow to import: it is imported inside the functions that optimise.


def _sampler(name: str, seed: int, startup: int, deterministic: bool):
    import optuna

    if name == "gp":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.GPSampler(seed=seed, n_startup_trials=startup,
                                             deterministic_objective=deterministic)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, multivariate=True)


def open_study(storage_path: Path | None, settings: dict, fresh: bool = False):
    """Create or resume the study stored in a journal file (None: in memory)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = None
    if storage_path is not None:
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        storage_path.parent.mkdir(parents=True, exist_ok=True)
        if fresh and storage_path.exists():
            storage_path.unlink()
        _remove_stale_lock(storage_path)
        _check_journal(storage_path)
    try:
        if storage_path is not None:
            storage = JournalStorage(JournalFileBackend(str(storage_path)))
        study = optuna.create_study(storage=storage, study_name="self_sd", direction="maximize", load_if_exists=True)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:  # JSONDecodeError is a ValueError
        raise UserError(f"the study journal {storage_path} is damaged ({type(e).__name__}); pass --fresh to "
                        "start the search over") from None
    stored = study.user_attrs.get("settings")
    if stored is None:
        study.set_user_attr("settings", settings)
    elif stored != settings:
        diff = ", ".join(f"{k}: {stored.get(k)!r} -> {settings.get(k)!r}" for k in sorted(set(stored) | set(settings))
                         if stored.get(k) != settings.get(k))
        raise UserError(f"the study in {storage_path} was run with other settings ({diff}); pass --fresh to "
                        "start over or choose another --out")
    return study


def _check_journal(journal: Path) -> None:
    """Refuse a journal cut short (no final newline) or holding a line that is not JSON, before optuna reads it."""
    try:
        data = journal.read_bytes() if journal.exists() else b""
        ok = not data or data.endswith(b"\n")
        for line in data.splitlines() if ok else ():
            if line.strip():
                json.loads(line)
    except (OSError, ValueError):
        ok = False
    if not ok:
        raise UserError(f"the study journal {journal} is damaged (cut short or not a journal); pass --fresh to "
                        "start the search over")


def _remove_stale_lock(journal: Path, stale_after: float = 2.0) -> None:
    """Remove the journal's lock left by a killed search (optuna would wait 30 s for it).

    The lock is held only while one log line is written (milliseconds), so one older than a couple
    of seconds belongs to a process that is gone.
    """
    lock = journal.with_name(journal.name + ".lock")
    try:
        age = time.time() - lock.lstat().st_mtime
    except OSError:
        return
    if age > stale_after:
        with contextlib.suppress(OSError):
            lock.unlink()


def run_search(evaluate: Evaluate, space: PlanSpace, cfg: SearchConfig, study, on_best=None,
               progress: bool = True, deterministic: bool = True) -> SearchResult:
    """Evaluate plans until the study holds ``cfg.trials`` distinct ones (or the timeout); return the best.

    ``evaluate(plan) -> (value, metrics)`` is maximised. A plan the sampler proposes again is not
    re-evaluated: its trial gets the stored value at no cost and does not count toward
    ``cfg.trials`` (a deterministic objective gains nothing from a repeat, and samplers repeat a lot
    once they converge). ``on_best(result)`` is called whenever the best value improves.
    """
    import optuna

    complete = optuna.trial.TrialState.COMPLETE
    done = [t for t in study.trials if t.state == complete]
    known: dict[LayerPlan, tuple[float, dict]] = {}
    history: list[float] = []
    best = float("-inf")
    for t in done:
        if "plan" in t.user_attrs and not t.user_attrs.get("repeat"):
            known[LayerPlan.from_dict(t.user_attrs["plan"])] = (t.value, dict(t.user_attrs))
            best = max(best, t.value)
            history.append(best)
    warm = space.uniform_plans() if cfg.warm_start else []
    if not study.trials:
        for plan in warm:
            study.enqueue_trial(space.params(plan), user_attrs={"warm_start": True})
    # Re-seed by progress so that a resumed study does not replay the random start-up trials.
    study.sampler = _sampler(cfg.sampler, cfg.seed + len(study.trials), len(warm) + 10, deterministic)

    def objective(trial) -> float:
        plan = space.suggest(trial)  # a frozen LayerPlan: repeated proposals hit the same key
        if plan in known:
            trial.set_user_attr("repeat", True)
        else:
            known[plan] = evaluate(plan)
        value, metrics = known[plan]
        for name, v in metrics.items():
            if name not in ("plan", "warm_start", "repeat"):
                trial.set_user_attr(name, v)
        trial.set_user_attr("plan", plan.to_dict())
        return value

    bar = tqdm(total=cfg.trials, initial=min(len(known), cfg.trials), desc="plan search", disable=not progress,
               dynamic_ncols=True)
    proposals_cap = 20 * cfg.trials  # ends the run if the sampler only repeats itself (tiny search spaces)

    def callback(study, trial) -> None:
        nonlocal best
        if trial.state == complete and not trial.user_attrs.get("repeat"):
            bar.update()
            if trial.value > best:
                best = trial.value
                if on_best is not None:
                    on_best(_result(study, time.perf_counter() - t0, history + [best]))
            history.append(best)
            plan = LayerPlan.from_dict(study.best_trial.user_attrs["plan"])
            bar.set_postfix_str(f"best {best:.4g} (trial {study.best_trial.number}, skip {plan.skip_ratio:.0%})")
        if len(known) >= cfg.trials or len(study.trials) >= proposals_cap:
            study.stop()

    t0 = time.perf_counter()
    if len(known) < cfg.trials:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            try:
                study.optimize(objective, n_trials=proposals_cap, timeout=cfg.timeout, callbacks=[callback])
            finally:
                bar.close()
    else:
        bar.close()
    if not any(t.state == complete for t in study.trials):
        raise UserError("no trial completed (is --timeout too short?)")
    return _result(study, time.perf_counter() - t0, history)


def _result(study, wall: float, history: list[float]) -> SearchResult:
    import optuna

    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    best = study.best_trial
    trial_time = sum(t.duration.total_seconds() for t in complete if t.duration is not None)
    attrs = {k: v for k, v in best.user_attrs.items() if k not in ("plan", "warm_start", "repeat")}
    evaluated = sum(1 for t in complete if not t.user_attrs.get("repeat"))
    return SearchResult(LayerPlan.from_dict(best.user_attrs["plan"]), float(best.value), attrs, evaluated,
                        best.number, wall, trial_time, list(history), len(complete))


# --------------------------------------------------------------------------- costs
@torch.no_grad()
def measure_cost(runner: Runner, context: Sequence[int], max_tokens: int, repeats: int = 7) -> CostModel:
    """Time single-token forwards under all-attention / all-MLP / everything skipped, and T-token verifies."""
    L = runner.num_layers
    cache = runner.new_cache(len(context) + max_tokens + 8)
    ids = torch.tensor(list(context), device=runner.device)
    runner.forward_layers(cache, runner.embed(ids), torch.arange(len(context), device=runner.device))
    n = len(context)

    def timed(plan: LayerPlan | None, T: int) -> float:
        tok = ids[-1:].repeat(T)  # (T,)
        pos = torch.arange(n, n + T, device=runner.device)
        times = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            runner.logits(runner.forward_layers(cache, runner.embed(tok), pos, plan=plan))
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

    def __init__(self, runner: Runner, calibration: list[Calibration], cost: CostModel, max_draft: int):
        self.runner, self.cost = runner, cost
        self.ks = [k for k in K_GRID if k < max_draft] + [max_draft]
        self.windows = []
        for item in calibration:
            seq = item.prompt + item.continuation
            n = len(seq) - 1  # seq[:n] in the cache; the window re-runs seq[P-1:n] and predicts seq[P:n+1]
            s = n - len(item.continuation)
            cache = runner.new_cache(n + len(item.continuation) + 1)
            ids = torch.tensor(seq, device=runner.device)
            with torch.no_grad():
                runner.forward_layers(cache, runner.embed(ids[:n]), torch.arange(n, device=runner.device))
            self.windows.append(verified_window(runner, cache, n, s, ids[s:n], ids[s + 1:n + 1], "exact",
                                                layer_inputs=True))

    def agreement(self, plan: LayerPlan) -> tuple[list[list[bool]], list[list[float]]]:
        """Per calibration item: does the plan's argmax equal the full model's token, and its top-1 prob."""
        scored = [agreement(self.runner, window, plan) for window in self.windows]
        return [agree.tolist() for agree, _ in scored], [top1.tolist() for _, top1 in scored]

    def __call__(self, plan: LayerPlan) -> tuple[float, dict]:
        agree, top1 = self.agreement(plan)
        c = self.cost.draft(plan)
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
                                      "tokens_per_verify": tokens / cycles if cycles else 0.0})
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
                 reference: str = "interleaved"):
        self.runner, self.prompts, self.num_draft, self.reference = runner, prompts, num_draft, reference
        self.gen = GenerationConfig(max_new_tokens=max_new_tokens, stop_at_eos=False)
        self.baseline_engine = Engine(runner, build_drafter("autoregressive", runner))
        self.baseline_engine.generate(prompts[0], GenerationConfig(max_new_tokens=4, stop_at_eos=False))  # warm-up
        self.baseline = self._tokens_per_second(self.baseline_engine)

    def drafter_config(self, plan: LayerPlan) -> SelfSDConfig:
        """``decoding.py``'s defaults as ``searching.py`` uses them: k, gamma_0 = 0.8 adaptive, from 0.8 per prompt."""
        return SelfSDConfig(plan=plan, num_draft=self.num_draft, confidence=SPEED_SEARCH_CONFIDENCE,
                            carry_confidence=False)

    def _tokens_per_second(self, engine) -> float:
        results = [engine.generate(ids, self.gen) for ids in self.prompts]
        return sum(r.stats.new_tokens for r in results) / sum(r.stats.wall_time for r in results)

    def __call__(self, plan: LayerPlan) -> tuple[float, dict]:
        # a new engine per plan (a live engine's drafter is never swapped), drafting as the reference search does
        results, ar_tokens, ar_wall = [], 0, 0.0
        with Engine(self.runner, SelfSDDrafter(self.runner, self.drafter_config(plan))) as engine:
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
                   "tokens_per_verify": sum(r.stats.new_tokens - 1 for r in results) / calls if calls else 0.0,
                   "final_confidence": statistics.mean(r.stats.drafter["confidence"] for r in results)}
        return (tps / baseline if self.reference == "interleaved" else tps), metrics


# --------------------------------------------------------------------------- glue for the CLI
def study_path_for(out: Path) -> Path:
    """The optuna journal beside the plan: plans/x.json -> plans/x.study.log."""
    return out.with_name(out.stem + ".study.log")


def calibration_set(runner: Runner, prompts: list[list[int]], max_new_tokens: int) -> list[Calibration]:
    """The full model's greedy continuations of the calibration prompts (EOS ignored)."""
    gen = GenerationConfig(max_new_tokens=max_new_tokens, stop_at_eos=False)
    with Engine(runner, build_drafter("autoregressive", runner)) as engine:
        return [Calibration(list(p), engine.generate(p, gen).tokens) for p in prompts]


def build_objective(runner: Runner, prompts: list[list[int]], cfg: SearchConfig) -> tuple[Evaluate, dict]:
    """The objective function and what it measured during setup (recorded in the plan file)."""
    if cfg.objective == "speed":
        objective = SpeedObjective(runner, prompts, cfg.max_new_tokens, cfg.num_draft, cfg.speed_reference)
        return objective, {"autoregressive_tokens_per_second_at_start": round(objective.baseline, 3)}
    calibration = calibration_set(runner, prompts, cfg.max_new_tokens)
    if cfg.cost == "measured":
        context = max(prompts, key=len)
        cost = measure_cost(runner, context, cfg.num_draft + 1)
    else:
        cost = weights_cost(runner.spec, cfg.num_draft + 1)
    return ModelObjective(runner, calibration, cost, cfg.num_draft), {"cost_model": cost.to_dict()}


def search_plan(runner: Runner, prompts: list[list[int]], cfg: SearchConfig, out: Path, task: str = "",
                study_path: Path | None = None, fresh: bool = False, progress: bool = True,
                extra: dict | None = None) -> tuple[SearchResult, PlanFile]:
    """Search, saving the best plan to ``out`` (atomically) whenever it improves; returns the final result."""
    t_start = time.perf_counter()
    space = PlanSpace(runner.num_layers, cfg.skip_ratio)
    settings = cfg.study_settings() | {"model": runner.identity(), "task": task, "prompts": len(prompts)}
    study = open_study(study_path, settings, fresh)
    evaluate, setup = build_objective(runner, prompts, cfg)
    setup_time = time.perf_counter() - t_start

    def save(result: SearchResult) -> PlanFile:
        search = {"sampler": cfg.sampler, "seed": cfg.seed, "trials": result.completed, "proposals": result.proposals,
                  "best_trial": result.best_trial,
                  "skip_ratio": cfg.skip_ratio, "prompts": len(prompts), "max_new_tokens": cfg.max_new_tokens,
                  "num_draft": cfg.num_draft, "warm_start": cfg.warm_start,
                  "wall_time_s": round(time.perf_counter() - t_start, 1), "setup_time_s": round(setup_time, 1),
                  "trial_time_s": round(result.trial_time, 1),
                  "study": str(study_path) if study_path else None} | setup | (extra or {})
        objective = {"name": cfg.objective, "value": result.value} | result.attrs
        if cfg.objective == "model":
            objective["cost"] = cfg.cost
        plan_file = PlanFile(result.plan, runner.identity(), task, objective, search, source="self_sd")
        plan_file.save(out)
        return plan_file

    result = run_search(evaluate, space, cfg, study, on_best=save, progress=progress,
                        deterministic=cfg.objective == "model")
    return result, save(result)
