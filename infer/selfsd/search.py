"""Offline search of a sublayer skip plan for Self-SD (Zhang et al., ACL 2024, §3.2), with optuna or, as the
reference does (``--paper``), GP-UCB on a continuous point.

The search space is the 2L binary choices "skip attention / MLP of layer l" (``infer.model.plan.PlanSpace``,
shared with SWIFT's online optimiser). Two objectives:

- ``speed``: measured end-to-end speed of self-speculative greedy decoding (the ``self_sd``
  drafter as the reference search runs it: k = 8, adaptive threshold from 0.8 on every prompt)
  on a few calibration prompts. What Self-SD optimises
  (as tokens/s); by default the value is the speed-up over autoregressive decoding of the same
  prompt timed just before, which cancels most of a shared machine's drift. Every trial decodes.
- ``model``: a noise-free expected speed-up. The full model's greedy
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
  expected speed-up (``infer.model.plan.cycle_speedup``) over a small (k, gamma) grid.

One draft head per search: both objectives and the cost model score plans with the head ``draft_vocab`` names,
resolved once (``search_plan``) and recorded in the plan file, whose plans ``self_sd`` then drafts with that head.

``paper``: the reference's search (``searching.py``): bayes_opt GP-UCB (kappa 2.576, alpha 1e-2;
``infer.drafters.gp_ucb``) over a continuous point in [0, 1]^{2L}, a sublayer skipped where its coordinate exceeds 0.5,
``iterations`` suggestions (1,000 there), the full LM head, the speed objective unless another is named. It keeps no
study journal (an interrupted paper search starts over).

With ``skip_ratio`` the plan skips exactly round(ratio·2L) sublayers: the sampler still proposes
2L yes/no choices, and a deterministic repair adds skips (inner deep layers first) or drops them
(shallow layers first) until the count is right, so the value stays a function of the proposal.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from infer.drafters.gp_ucb import GPUCB, GPUCBConfig
from infer.model.plan import CostModel, LayerPlan, PlanFile, PlanSpace, head_record, weights_cost
from infer.model.runner import Runner
from infer.selfsd.search_objectives import Calibration, ModelObjective, SpeedObjective, calibration_set, measure_cost
from infer.selfsd.study import holding_search, open_study
from layerskip_core.draft_vocab import DraftVocab, check_draft_vocab_option, resolve_draft_vocab_option
from layerskip_core.errors import UserError
from layerskip_core.options import check_fields

OBJECTIVES = ("model", "speed")
SAMPLERS = ("tpe", "gp")
PAPER_KAPPA = 2.576
"""UCB's exploration weight in the reference search (bayes_opt's default kappa)."""
PAPER_ALPHA = 1e-2
"""The GP's noise term in the reference search (``set_gp_params(alpha=1e-2)``)."""
PAPER_THRESHOLD = 0.5
"""A sublayer is skipped where the continuous point's coordinate exceeds this."""
COSTS = ("measured", "weights")
SPEED_REFERENCES = ("interleaved", "once")
DEFAULT_NEW_TOKENS = {"model": 64, "speed": 32}
DEFAULT_NUM_DRAFT = {"model": 12, "speed": 8}
"""k per objective: the model objective replays up to Self-SD's evaluation k (12); the speed objective decodes as the
reference search does (``searching.py`` calls ``decoding.py``'s generate with its defaults: k = 8)."""


# --------------------------------------------------------------------------- settings
@dataclass
class SearchConfig:
    """What `layerskip search` does."""

    objective: str | None = None
    """'model': expected speed-up from teacher-forced agreement and draft cost;
    'speed': measured tokens/s of self-speculative decoding. Default: 'model', or 'speed' with paper."""
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
    draft_vocab: str | DraftVocab | None = "auto"
    """The one draft head of the search (both objectives and the cost model): 'auto', a size, a file, a
    ``DraftVocab`` or 'off' (the full head), as the drafters' option; recorded in the plan file. Off with paper."""
    paper: bool = False
    """The reference's search: GP-UCB on a continuous point thresholded at 0.5, ``iterations`` suggestions, the
    full head (sampler, trials, warm_start and draft_vocab do not apply)."""
    iterations: int = 1000
    """paper: GP-UCB suggestions to evaluate (the reference's 1,000); a repeated plan is not re-evaluated."""

    def __post_init__(self) -> None:
        check_fields(self, "search")  # types, and no NaN or infinite number (a timeout of .inf, a ratio of NaN)
        if self.objective is None:
            self.objective = "speed" if self.paper else "model"
        check_draft_vocab_option(self.draft_vocab)
        if self.paper:
            self.draft_vocab = "off"
        if self.iterations < 1:
            raise UserError(f"--iterations must be >= 1, got {self.iterations}")
        if self.objective not in OBJECTIVES:
            raise UserError(f"unknown objective {self.objective!r}; choose {' or '.join(OBJECTIVES)}")
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
        """What must not change when a study is resumed (a draft vocabulary by its size and ids' digest)."""
        settings = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                    if f.name not in ("trials", "timeout", "seed", "iterations")}
        if isinstance(self.draft_vocab, DraftVocab):
            digest = hashlib.sha256(json.dumps(self.draft_vocab.ids).encode()).hexdigest()[:16]
            settings["draft_vocab"] = f"{self.draft_vocab.size} ids {digest}"
        return settings


# --------------------------------------------------------------------------- the optuna loop
CALIBRATION = "calibration"
"""The study's user attribute holding the model objective's calibration (prompts, continuations, costs)."""


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
    known, history = _completed(study)
    best = history[-1] if history else float("-inf")
    warm = space.uniform_plans() if cfg.warm_start else []
    if not study.trials:
        for plan in warm:
            study.enqueue_trial(space.params(plan), user_attrs={"warm_start": True})
    # Re-seed by progress so that a resumed study does not replay the random start-up trials.
    study.sampler = _sampler(cfg.sampler, cfg.seed + len(study.trials), len(warm) + 10, deterministic)

    objective = _trial_objective(evaluate, space, known)
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


def _trial_objective(evaluate: Evaluate, space: PlanSpace, known: dict) -> Callable:
    """optuna's objective: the trial's plan evaluated once (``known`` keeps every value; a repeat is free)."""

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

    return objective


def _completed(study) -> tuple[dict[LayerPlan, tuple[float, dict]], list[float]]:
    """The distinct plans a (resumed) study already evaluated, with their values, and the best value after each."""
    import optuna

    known: dict[LayerPlan, tuple[float, dict]] = {}
    history: list[float] = []
    for t in study.trials:
        if t.state == optuna.trial.TrialState.COMPLETE and "plan" in t.user_attrs and not t.user_attrs.get("repeat"):
            known[LayerPlan.from_dict(t.user_attrs["plan"])] = (t.value, dict(t.user_attrs))
            history.append(max(t.value, history[-1]) if history else t.value)
    return known, history


def _result(study, wall: float, history: list[float]) -> SearchResult:
    import optuna

    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    best = study.best_trial
    trial_time = sum(t.duration.total_seconds() for t in complete if t.duration is not None)
    attrs = {k: v for k, v in best.user_attrs.items() if k not in ("plan", "warm_start", "repeat")}
    evaluated = sum(1 for t in complete if not t.user_attrs.get("repeat"))
    return SearchResult(LayerPlan.from_dict(best.user_attrs["plan"]), float(best.value), attrs, evaluated,
                        best.number, wall, trial_time, list(history), len(complete))


# --------------------------------------------------------------------------- glue for the CLI
def build_objective(runner: Runner, prompts: list[list[int]], cfg: SearchConfig,
                    vocab: DraftVocab | None = None, study=None, progress: bool = False) -> tuple[Evaluate, dict]:
    """The objective function, scoring with the draft head of ``vocab`` (None: the full head), and what it measured
    during setup (recorded in the plan file). The model objective's calibration (the full model's continuations
    and the measured costs) is stored with ``study``, so a resumed study reuses it instead of paying it again."""
    if cfg.objective == "speed":
        objective = SpeedObjective(runner, prompts, cfg.max_new_tokens, cfg.num_draft, cfg.speed_reference, vocab)
        return objective, {"autoregressive_tokens_per_second_at_start": round(objective.baseline, 3)}
    stored = study.user_attrs.get(CALIBRATION) if study is not None else None
    if stored is not None and stored["prompts"] == [list(p) for p in prompts]:
        calibration = [Calibration(list(p), c) for p, c in zip(prompts, stored["continuations"], strict=True)]
        cost = CostModel(**stored["cost"])
    else:
        shown = tqdm(prompts, desc="calibration (the full model's outputs)", disable=not progress, leave=False,
                     dynamic_ncols=True)  # most of a short search's time: not a silent wait
        calibration = calibration_set(runner, shown, cfg.max_new_tokens)
        cost = (measure_cost(runner, max(prompts, key=len), cfg.num_draft + 1) if cfg.cost == "measured"
                else weights_cost(runner.spec, cfg.num_draft + 1))
        if study is not None:
            study.set_user_attr(CALIBRATION, {"prompts": [list(p) for p in prompts], "cost": dataclasses.asdict(cost),
                                              "continuations": [c.continuation for c in calibration]})
    return ModelObjective(runner, calibration, cost, cfg.num_draft, vocab), {"cost_model": cost.to_dict()}


def search_plan(runner: Runner, prompts: list[list[int]], cfg: SearchConfig, out: Path, task: str = "",
                study_path: Path | None = None, fresh: bool = False, progress: bool = True,
                extra: dict | None = None, lock: bool = True) -> tuple[SearchResult, PlanFile]:
    """Search, saving the best plan to ``out`` (atomically) whenever it improves; returns the final result.

    ``cfg.draft_vocab`` is resolved here, once, against the runner's weights (the CLI resolves it with the
    tokenizer first and passes the ``DraftVocab``); its head is the one the plan file records. The search holds
    :func:`holding_search`'s locks on ``out`` and the study while it runs (``lock=False``: the caller holds them
    already, as the CLI does from before the model loads)."""
    if lock:
        with holding_search(out, None if cfg.paper else study_path):
            return search_plan(runner, prompts, cfg, out, task, study_path, fresh, progress, extra, lock=False)
    t_start = time.perf_counter()
    vocab = resolve_draft_vocab_option(cfg.draft_vocab, runner)
    head = None if vocab is None else runner.draft_head(vocab.ids)
    space = PlanSpace(runner.num_layers, cfg.skip_ratio)
    study = None
    if not cfg.paper:
        settings = cfg.study_settings() | {"model": runner.identity(), "task": task, "prompts": len(prompts)}
        study = open_study(study_path, settings, fresh)
    evaluate, setup = build_objective(runner, prompts, cfg, vocab, study, progress)
    setup_time = time.perf_counter() - t_start

    def save(result: SearchResult) -> PlanFile:
        search = {"sampler": "gp_ucb (paper)" if cfg.paper else cfg.sampler, "seed": cfg.seed,
                  "trials": result.completed, "proposals": result.proposals, "best_trial": result.best_trial,
                  "skip_ratio": cfg.skip_ratio, "prompts": len(prompts), "max_new_tokens": cfg.max_new_tokens,
                  "num_draft": cfg.num_draft, "warm_start": cfg.warm_start and not cfg.paper,
                  "wall_time_s": round(time.perf_counter() - t_start, 1), "setup_time_s": round(setup_time, 1),
                  "trial_time_s": round(result.trial_time, 1),
                  "study": str(study_path) if study is not None and study_path else None} | setup | (extra or {})
        objective = {"name": cfg.objective, "value": result.value} | result.attrs
        if cfg.objective == "model":
            objective["cost"] = cfg.cost
        plan_file = PlanFile(result.plan, runner.identity(), task, objective, search, source="self_sd",
                             draft_head=head_record(head))
        plan_file.save(out)
        return plan_file

    if cfg.paper:
        result = run_gp_ucb(evaluate, space, cfg, on_best=save, progress=progress)
    else:
        result = run_search(evaluate, space, cfg, study, on_best=save, progress=progress,
                            deterministic=cfg.objective == "model")
    return result, save(result)


def run_gp_ucb(evaluate: Evaluate, space: PlanSpace, cfg: SearchConfig, on_best=None,
               progress: bool = True) -> SearchResult:
    """The reference's optimiser: ``cfg.iterations`` GP-UCB suggestions x in [0, 1]^{2L} (kappa 2.576, alpha 1e-2),
    each decoded to the plan skipping the sublayers whose coordinate exceeds 0.5 (repaired to ``skip_ratio`` when
    one is set) and registered at x with its plan's value. A plan suggested again reuses its value (the reference
    re-measures it); the first suggestion is uniform random, as bayes_opt's with no observation is."""
    gp = GPUCB(len(space.names), cfg.seed, GPUCBConfig(kappa=PAPER_KAPPA, noise=PAPER_ALPHA))
    known: dict[LayerPlan, tuple[float, dict]] = {}
    best: tuple[float, LayerPlan | None, int] = (float("-inf"), None, -1)
    history: list[float] = []
    t0 = time.perf_counter()
    trial_time = 0.0
    for step in tqdm(range(cfg.iterations), desc="plan search (GP-UCB)", disable=not progress, dynamic_ncols=True):
        if cfg.timeout is not None and time.perf_counter() - t0 > cfg.timeout:
            break
        point = gp.suggest()  # (2L,) in [0, 1]
        plan = space.decode({name: bool(v > PAPER_THRESHOLD) for name, v in zip(space.names, point.tolist(),
                                                                                   strict=True)})
        if plan not in known:
            t = time.perf_counter()
            known[plan] = evaluate(plan)
            trial_time += time.perf_counter() - t
        value = known[plan][0]
        gp.observe(point, value)
        if value > best[0]:
            best = (value, plan, step)
            if on_best is not None:
                on_best(_gp_result(best, known, t0, trial_time, history + [value], step + 1))
        history.append(best[0])
    if best[1] is None:
        raise UserError("no plan was evaluated (is --timeout too short?)")
    return _gp_result(best, known, t0, trial_time, history, len(history))


def _gp_result(best: tuple, known: dict, t0: float, trial_time: float, history: list[float],
               proposals: int) -> SearchResult:
    value, plan, step = best
    attrs = {k: v for k, v in known[plan][1].items() if k != "plan"}
    return SearchResult(plan, float(value), attrs, len(known), step, time.perf_counter() - t0, trial_time,
                        list(history), proposals)
