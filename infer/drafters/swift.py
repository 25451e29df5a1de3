"""SWIFT: on-the-fly self-speculative decoding (Xia et al., ICLR 2025).

The skip set is optimised *during* generation from the tokens the full model already produced: each candidate set of
skipped attention/MLP sublayers is scored by one parallel draft-mode forward over a window of verified context
(matchness = fraction of positions where the draft's argmax equals the full model's token). Candidates come from
random search and, every ``bo_interval`` steps, from Bayesian optimisation fitted to every scored candidate (optuna
TPE when optuna is installed, random search otherwise). Drafting is confidence-aware and verified as a dynamic top-k
token tree (``infer.drafters.tree``).

Beyond the paper: the drafter falls back to plain steps while drafting measures slower, and what looking for a plan
costs (optimisation, probes) is bounded by what drafting could gain (``infer.drafters.swift_budget``), so ``swift``
stays close to ``autoregressive`` on models without exploitable redundancy.

``paper=true`` runs SWIFT as its released code does instead: ``infer.drafters.swift_paper``, a subclass that
shares this search, scoring and drafting code.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import ClassVar

from infer.drafters.base import (
    NO_INPUTS,
    DecodeState,
    Draft,
    Drafter,
    DrafterStats,
    DraftInputs,
    DraftVocabOption,
    Needs,
    VerifyOutcome,
)
from infer.drafters.chain import PlanForward, check_size, draft_chain
from infer.drafters.costs import CostsOption, plan_prices
from infer.drafters.gate import COLD, FallbackGate, GateMemory, Rate, RememberOption
from infer.drafters.inputs import draft_head, draft_quant, draft_runner, given_plan
from infer.drafters.skipping import matchness_span
from infer.drafters.swift_budget import PROBE_BAR, draft_share, needed_matchness, plain_share, within
from infer.drafters.swift_search import LayerSetSearch
from infer.drafters.tree import TreeOption, chain_depth, chain_tree
from infer.model.plan import (
    LayerPlan,
    PlanFile,
    check_plan_option,
    cycle_speedup,
    head_record,
    iid_tokens_per_cycle,
    plan_for,
)
from layerskip_core.errors import UserError
from layerskip_core.options import check_fields

DEFAULT_WINDOW = 32  # inference_swift.py's --context-window default
DEFAULT_MATCH = 0.95  # inference_swift.py's --max-score default
SCRIPT_WINDOW = 50  # what eval_llama.sh, the released evaluation script, passes (paper=true)
SCRIPT_MATCH = 0.93


@dataclass
class SwiftConfig(DraftVocabOption, RememberOption, TreeOption, CostsOption):
    """Settings of the SWIFT drafter (paper defaults where the paper has one)."""

    skip_ratio: float = 0.45
    """Fraction of the 2(L-2) sublayers of layers 1..L-2 that a candidate skips (first and last layer kept)."""
    context_window: int | None = None
    """γ: verified tokens of the current prompt used to score candidates (and needed before optimising); default 32
    (inference_swift.py's default), 50 with paper=true (what the released eval_llama.sh passes)."""
    bo_interval: int = 25
    """β: every β-th optimisation step proposes by Bayesian optimisation instead of random search."""
    max_opt_steps: int = 1000
    """Stop optimising after this many scored candidates."""
    patience: int = 300
    """Stop optimising after this many candidates without improvement."""
    match_threshold: float | None = None
    """Stop optimising once the best candidate's matchness exceeds this; default 0.95 (inference_swift.py's default),
    0.93 with paper=true (what the released eval_llama.sh passes)."""
    confidence: float = 0.8
    """Stop drafting when the draft's top-1 probability falls below this."""
    num_draft: int = 25
    """k: most draft forwards (chain depth) per verification."""
    tree: bool = True
    """Verify a dynamic top-k tree (candidates per depth from the draft's confidence); off = chain only."""
    opt_budget: float = 0.25
    """Most fraction of wall time spent optimising while drafting pays off (or is still being assessed)."""
    adaptive: bool = True
    """Draft only while draft-verify cycles measure faster than plain steps, else fall back to plain decoding and
    re-check later (the same gate as early_exit's)."""
    fallback_opt_budget: float = 0.03
    """Most fraction of wall time spent optimising while in the fallback (plain) mode (at most 0.01 when the
    remembered best plan is predicted not to pay)."""
    recheck_interval: int = 128
    """In fallback, probe drafting again after this many plain steps (doubling after each failed probe), if the
    cost model does not rule it out; sooner when a better plan is predicted to pay."""
    plan: str | None = None
    """Initial plan: a plan file (a self_sd or swift plan JSON) for this model (from Python, a ``LayerPlan`` object
    may be given instead); default: a uniform plan at skip_ratio."""
    save_plan: str | None = None
    """Write the best plan found to this JSON file (self_sd-compatible) when decoding is finished."""
    opt_seed: int = 0
    """Seed of the random search and of the Bayesian step (optuna's TPE, or GP-UCB with paper=true)."""
    remember: str = "on"
    """With adaptive, what earlier commands learned (the gate's plain and drafting speed, draft and verification
    rates, mode and back-off; the best plan and its matchness), kept in the toolkit cache per model, device, dtype,
    threads and these settings: on = start from it and save it at the end, read = start from it without changing
    it, off = start cold and save nothing. Stats say which (``start_state``)."""
    paper: bool = False
    """SWIFT as its released code runs: no fallback, no optimisation budget, the paper's tree widths with no node
    cap, GP-UCB, one global best matchness, the window of each prompt's first γ+1 tokens, the odd inner layers to
    start, the full LM head, and with a plan file no optimisation (the reference's cached-plan mode); overrides
    adaptive, opt-budget, fallback-opt-budget, max-tree-nodes and draft-vocab; context-window and match-threshold
    default to the released script's 50 and 0.93."""

    def __post_init__(self) -> None:
        check_fields(self, "swift")
        DraftVocabOption.__post_init__(self)
        RememberOption.__post_init__(self)
        CostsOption.__post_init__(self)
        check_size(self.num_draft, "num-draft")
        TreeOption.__post_init__(self)
        if self.plan:
            check_plan_option(self.plan, "swift")  # before any model is loaded
        if self.context_window is None:
            self.context_window = SCRIPT_WINDOW if self.paper else DEFAULT_WINDOW
        if self.match_threshold is None:
            self.match_threshold = SCRIPT_MATCH if self.paper else DEFAULT_MATCH
        checks = [
            (0.0 < self.skip_ratio < 1.0, f"skip-ratio must be in (0, 1), got {self.skip_ratio}"),
            (self.context_window >= 2, f"context-window must be >= 2, got {self.context_window}"),
            (self.bo_interval >= 1, f"bo-interval must be >= 1, got {self.bo_interval}"),
            (self.max_opt_steps >= 0 and self.patience >= 1, "max-opt-steps must be >= 0 and patience >= 1"),
            (0.0 < self.match_threshold <= 1.0, f"match-threshold must be in (0, 1], got {self.match_threshold}"),
            (0.0 <= self.confidence < 1.0, f"confidence must be in [0, 1), got {self.confidence}"),
            (0.0 <= self.fallback_opt_budget <= self.opt_budget < 1.0,
             "need 0 <= fallback-opt-budget <= opt-budget < 1"),
            (self.recheck_interval >= 1, "recheck-interval must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)


@dataclass
class SwiftStats(DrafterStats):
    """What the SWIFT drafter reports (per prompt, except where it says the drafter's whole life)."""

    opt_time: float = 0.0
    """Seconds spent optimising on this prompt."""
    opt_steps: int = 0
    """Candidates scored on this prompt."""
    plain_steps: int = 0
    """Plain (undrafted) steps the fallback gate took."""
    best_matchness: float | None = None
    """Matchness of the best plan (None: no plan scored yet)."""
    skip_ratio: float = 0.0
    """Fraction of sublayers the best plan skips."""
    plan: str = ""
    """The best plan, described."""
    mode: str = "draft"
    """The gate's mode at the end ('draft' or 'plain')."""
    optimising: bool = False
    """Whether the optimiser is still running."""
    stop_reason: str = ""
    """Why optimisation stopped ('' while it runs)."""
    tps_plain: float = 0.0
    """Measured tokens/s of plain steps."""
    tps_draft: float = 0.0
    """Measured tokens/s of draft-verify cycles."""
    predicted_speedup: float | None = None
    """The cost model's speed-up of drafting with the best plan (None: no plan scored)."""
    opt_step_time: float | None = None
    """Seconds per scored candidate (None: none scored)."""
    bayes: str = ""
    """What proposes candidates ('tpe', 'gp_ucb', or 'random' and why)."""
    window: tuple[int, int] | None = None
    """[start, end) of the verified tokens candidates are scored on (None: not enough tokens yet)."""
    draft_vocab: int | None = None
    """Size of the reduced draft vocabulary (None: the full head)."""
    hopeless: bool = False
    """What was restored says no plan pays: optimisation gets the smallest budget."""
    matchness_trajectory: list[tuple[int, float]] = field(default_factory=list)
    """(optimisation step, best matchness) after each step on this prompt."""


class SwiftDrafter(Drafter):
    name = "swift"
    Config = SwiftConfig
    aliases = {"r": "skip_ratio", "k": "num_draft", "beta": "bo_interval"}
    WARM_UP = {"remember": "off", "save_plan": None}

    PROBE = FallbackGate.PROBE  # drafting cycles measured before drafting is judged
    REPROBE_GAIN = 0.05  # matchness gain since the last probe that triggers an early re-check
    HOPELESS_OPT_BUDGET = 0.01
    """Most fraction of its time a drafter spends optimising while plain when what it restored says no plan pays
    (the remembered best plan's predicted speed-up below 1, from the remembered draft and verify costs)."""

    bayes: ClassVar[str] = "tpe"  # what proposes the Bayesian candidates (``infer.drafters.swift_search.BAYES``)
    strict_stop: ClassVar[bool] = False  # stop criteria compare with > rather than >=
    examples: ClassVar[dict] = {"": {"context_window": 8, "opt_budget": 0.95, "max_opt_steps": 40, "adaptive": False,
                                     "confidence": 0.013}}  # trees from the first cycles (infer.drafters.examples)

    @classmethod
    def resolve(cls, spec, runner, tokenizer=None) -> DraftInputs:
        """The draft head and the starting plan, if one was given (a file made for this model, or an object)."""
        plan = spec.plan if spec.plan is None else given_plan(spec.plan, runner)
        if plan is None and spec.config.plan:
            plan = plan_for(spec.config.plan, runner.identity())
        return DraftInputs(draft_head(spec, runner, tokenizer), plan)

    def __init__(self, runner, config: SwiftConfig, inputs: DraftInputs = NO_INPUTS):
        self.config = cfg = config
        self.runner, self.quant = runner, draft_quant(cfg.draft_dtype, runner)
        self.draft_layers = draft_runner(cfg.draft_dtype, runner)  # int8 / int4: every layer quantized once
        self.vocab = inputs.vocab  # a reduced-vocabulary draft head, or None
        if runner.num_layers < 3:
            raise UserError("swift needs a model with at least 3 layers (the first and last always run)")
        self.search = LayerSetSearch(runner.num_layers, cfg.skip_ratio, cfg.bo_interval, cfg.opt_seed, self.bayes)
        self.plan_given = inputs.plan is not None
        self.best = inputs.plan if self.plan_given else self.start_plan()
        self.best_score = -1.0  # best matchness found; < 0 = not scored yet
        self.stop_reason = self.initial_stop()
        self.optimising = not self.stop_reason
        self._forward: PlanForward | None = None
        self.gate = FallbackGate(cfg.recheck_interval, enabled=self.fallback, bar=PROBE_BAR)
        self.draft_forward, self.verify = Rate(), Rate()  # forwards per second, verifications per second
        self.score_at_probe = -1.0
        self.opt_time_total = 0.0  # this drafter's own, over every prompt it decoded (never restored)
        self.drafted_cycles = 0  # this drafter's own drafted verifications (what --save-plan's line reports)
        self.decode_time = 0.0
        self.draft_time = 0.0  # of decode_time and opt_time_total: spent in draft mode (its share's base)
        self.opt_step = Rate()  # seconds per scored candidate (its ``seconds``; remembered)
        self.trajectory: list[tuple[int, float]] = []
        self.window: tuple[int, int] | None = None
        self._reset_prompt_stats()
        self.hopeless = False  # what was restored says no plan pays: optimise within HOPELESS_OPT_BUDGET
        tokens = max(chain_depth(cfg.num_draft, cfg.tree, self.tree_nodes), cfg.context_window) + 1  # verified, scored
        self.prices = plan_prices(runner, self.vocab, tokens, measured=cfg.costs == "measured" and self.fallback,
                                  drafting=None if self.quant is None else self.draft_layers, quant=self.quant)
        self.memory = GateMemory.for_drafter(runner, self.name, cfg) if self.fallback else None
        if self.memory is not None:
            self._restore(self.memory.load() or {})

    fallback = property(lambda self: self.config.adaptive)
    """Whether the gate may fall back to plain steps (``adaptive``)."""

    def start_plan(self) -> LayerPlan:
        """The plan drafting starts from when none was given: a uniform one at ``skip_ratio``."""
        return self.search.uniform_plan()

    def initial_stop(self) -> str:
        """Why no optimisation runs at all ('' when it does): ``max_opt_steps`` 0."""
        return "" if self.config.max_opt_steps > 0 else "max-opt-steps 0"

    # -------------------------------------------------------------- protocol
    mode = property(lambda self: self.gate.mode)
    plain = property(lambda self: self.gate.plain)
    drafting = property(lambda self: self.gate.drafting)

    @property
    def forward(self) -> PlanForward:
        """The draft forward of the current best plan, so drafting always uses the optimised plan."""
        if self._forward is None or self._forward.plan != self.best:
            self._forward = PlanForward(self.draft_layers, self.best, self.vocab, self.quant is None)
        return self._forward

    def needs(self) -> Needs:
        return Needs(lookahead=max(self.tree_nodes, self.config.num_draft) + self.config.context_window + 2)

    @property
    def tree_nodes(self) -> int:
        """Most drafted tree nodes per verification."""
        return self.config.max_tree_nodes

    def start(self, state: DecodeState) -> None:
        self.window: tuple[int, int] | None = None
        self._reset_prompt_stats()
        self._cycle_start = None

    def propose(self, state: DecodeState) -> Draft | None:
        self._cycle_start = time.perf_counter()
        self._draft_seconds = 0.0
        if self.mode == "plain":
            return None
        depth = chain_depth(self.config.num_draft, self.config.tree, self.tree_nodes)
        chain = draft_chain(state, self.forward, depth, self.config.confidence, keep_last=True,
                            keep_dists=self.config.tree)
        self.forwards += chain.forwards
        if not chain.forwards:
            return None
        self._draft_seconds = time.perf_counter() - self._cycle_start
        self.draft_forward.add(chain.forwards, self._draft_seconds)
        return chain_tree(chain, state, self.tree_nodes) if self.config.tree else chain.draft

    def skip(self, state: DecodeState) -> Draft | None:
        self._cycle_start, self._draft_seconds, self.plain_steps = None, 0.0, self.plain_steps + 1  # not timed here
        return None

    def update(self, state: DecodeState, outcome: VerifyOutcome) -> None:
        if self._cycle_start is not None:
            seconds = time.perf_counter() - self._cycle_start
            self.decode_time += seconds
            self.draft_time += seconds if self.mode == "draft" else 0.0
            self.gate.record(len(outcome.tokens), seconds, drafted=outcome.draft is not None)
            if outcome.draft is not None:
                self.verify.add(1, seconds - self._draft_seconds)
                self.drafted_cycles += 1
        self._choose_mode()
        if self.optimising and self._window_ready(state) and self.within_budget():
            t0 = time.perf_counter()
            scored = self._optimise_step(state)
            spent = time.perf_counter() - t0
            self.opt_time += spent
            self.opt_time_total += spent
            self.draft_time += spent if self.mode == "draft" else 0.0
            if scored:
                self.opt_step.add(1, spent / scored)

    def finish(self) -> None:
        """Decoding is over: write --save-plan (once) and keep the gate's measurements for the next command."""
        if self.config.save_plan:
            self.save(self.config.save_plan)
        if self.memory is not None:
            self.memory.save({"gate": self.gate.to_dict(), "draft_forward": self.draft_forward.to_dict(),
                              "verify": self.verify.to_dict(), "opt_step": self.opt_step.to_dict(),
                              "plan": {"attn": sorted(self.best.skip_attn), "mlp": sorted(self.best.skip_mlp)},
                              "score": self.best_score})

    def _restore(self, saved: dict) -> None:
        """Continue from what an earlier command measured (nothing when ``saved`` is empty or unusable)."""
        try:
            self.gate.load(saved.get("gate", {}))
            if "draft_forward" in saved:
                self.draft_forward.load(saved["draft_forward"])
                self.verify.load(saved["verify"])
            if "opt_step" in saved:
                self.opt_step.load(saved["opt_step"])
            if "plan" in saved and not self.plan_given:  # an explicit --plan wins over what was remembered
                L = self.runner.num_layers
                plan = LayerPlan(L, frozenset(saved["plan"]["attn"]), frozenset(saved["plan"]["mlp"]))
                if all(0 <= i < L for i in plan.skip_attn | plan.skip_mlp):
                    self.best, self.best_score = plan, float(saved["score"])
                    self.score_at_probe = self.best_score
                    self.hopeless = self.mode == "plain" and (self.predicted_speedup(self.best_score) or 0) < PROBE_BAR
        except (KeyError, TypeError, ValueError):
            self.gate = FallbackGate(self.config.recheck_interval, enabled=self.fallback, bar=PROBE_BAR)

    def stats(self) -> SwiftStats:
        return SwiftStats(
            self.forwards, COLD if self.memory is None else self.memory.start_state, self.opt_time, self.opt_steps,
            self.plain_steps, self.best_score if self.best_score >= 0 else None, self.best.skip_ratio,
            self.best.describe(), self.mode, self.optimising,
            self.stop_reason, self.plain.value, self.drafting.value, self.predicted_speedup(self.best_score),
            self.opt_step.seconds if self.opt_step.cycles else None, self.search.method, self.window,
            None if self.vocab is None else self.vocab.size, self.hopeless, self.trajectory[self._traj_mark:])

    # -------------------------------------------------------------- optimisation
    def within_budget(self) -> bool:
        """Would one more step keep optimisation within what this drafter's own time earns, each mode's time at its
        share (``shares``; earlier commands' decoding is no credit)? The step costs what scoring a plan took so far
        (remembered; before any, ``PlanPrices.seconds``), twice when the window is new (the incumbent is rescored)."""
        step = (self.opt_step.seconds if self.opt_step.cycles else self.prices.seconds(self.config.context_window)) \
            * (2 if self.window is None else 1)
        plain_time = self.decode_time + self.opt_time_total - self.draft_time
        ceiling = (self.config.fallback_opt_budget, self.config.opt_budget)  # no share exceeds these: tested first
        return all(within(self.opt_time_total, step, shares(), plain_time, self.draft_time, self.mode == "draft")
                   for shares in (lambda: ceiling, self.shares))

    def shares(self) -> tuple[float, float]:
        """The optimiser's shares of plain and of drafting time (``within_budget``)."""
        cfg = self.config
        if not self.fallback:
            return cfg.fallback_opt_budget, cfg.opt_budget  # always drafting: no never-slower promise to keep
        plain = plain_share(cfg.fallback_opt_budget, self.best_score,
                            None if self.best_score < 0 else needed_matchness(self.predicted_speedup))
        if self.hopeless:
            plain = min(plain, self.HOPELESS_OPT_BUDGET)
        measured = self.drafting.value / self.plain.value if self.drafting.cycles and self.plain.value else None
        return plain, draft_share(cfg.opt_budget, plain, measured or self.predicted_speedup(self.best_score))

    def _window_ready(self, state: DecodeState) -> bool:
        """Whether this prompt has the γ verified tokens the optimiser scores candidates on."""
        return self.window is not None or state.n - state.prompt_len >= self.config.context_window

    def _optimise_step(self, state: DecodeState) -> int:
        """Score one candidate on this prompt's window (the incumbent too when the window is new: ``rescore``);
        returns the number of plans scored."""
        scored = 0
        if self.window is None:
            if not self._window_ready(state):
                return 0  # context accumulation: draft with the current plan until γ verified tokens exist
            self.window = self.new_window(state)
            scored += self.rescore(state)
        plan, proposal = self.search.propose()
        score = matchness_span(state, [plan], *self.window, self.vocab, self.draft_layers)[0]
        self.search.record(plan, proposal, score)
        self.opt_steps += 1
        if score > self.to_beat():
            self.best, self.best_score = plan, score
            self.search.since_improved = 0
        else:
            self.search.since_improved += 1
        self.trajectory.append((self.search.steps, self.best_score))
        self.check_stop()
        return scored + 1

    def rescore(self, state: DecodeState) -> int:
        """The window changed: rescore the incumbent on it, so comparisons are like for like (plans scored)."""
        self.best_score = matchness_span(state, [self.best], *self.window, self.vocab, self.draft_layers)[0]
        return 1

    def to_beat(self) -> float:
        """The score a candidate must exceed to become the best plan."""
        return self.best_score

    def new_window(self, state: DecodeState) -> tuple[int, int]:
        """[start, end): the tokens re-run to score a plan (each predicts the next verified token): the latest γ
        verified tokens."""
        return state.n - self.config.context_window, state.n

    def check_stop(self) -> None:
        """The stop criteria: the best matchness reaches the threshold, patience or max-opt-steps is used up
        (``strict_stop``: exceeds, more than)."""
        cfg = self.config
        strict = self.strict_stop
        over = (lambda value, limit: value > limit) if strict else (lambda value, limit: value >= limit)
        if over(self.best_score, cfg.match_threshold):
            self.stop_reason = f"matchness {self.best_score:.2f} {'>' if strict else '>='} {cfg.match_threshold}"
        elif over(self.search.since_improved, cfg.patience):
            self.stop_reason = f"no improvement in {self.search.since_improved} steps"
        elif over(self.search.steps, cfg.max_opt_steps):
            self.stop_reason = f"{self.search.steps} steps"
        self.optimising = not self.stop_reason

    # -------------------------------------------------------------- fallback
    def _choose_mode(self) -> None:
        """Draft while it is measurably faster than plain decoding; otherwise decode plainly and re-check,
        sooner when the optimiser has found a plan the cost model expects to pay.

        The cost model is evaluated only when the gate will read it: at a periodic re-check, before the first
        probe, or when the best matchness has gained ``REPROBE_GAIN`` since the last probe. Any probe needs a
        prediction that clears the gate (``PROBE_BAR``). Before drafting was ever timed it uses this model's measured
        costs (``predicted_speedup``), and before any plan was scored nothing is known, so the first probe waits for
        a score: a plan predicted not to pay is never drafted with, and a cold start costs what plain decoding costs.
        """
        if not self.fallback:
            return
        predicted, early = None, False
        if self.mode == "plain":
            self.plain_steps += 1
            gained = self.best_score >= self.score_at_probe + self.REPROBE_GAIN
            first = self.gate.drafting.cycles == 0
            if first or gained or self.gate.mode_cycles + 1 >= self.gate.recheck:
                predicted = self.predicted_speedup(self.best_score)
                if predicted is None and first and self.optimising:
                    predicted = 0.0  # no plan scored yet (the optimiser will score one): wait for it
                early = gained and (predicted or 0.0) >= PROBE_BAR
        if self.gate.decide(predicted, early_probe=early):
            self.score_at_probe = self.best_score

    def predicted_speedup(self, matchness: float) -> float | None:
        """Cost-model speed-up of drafting over plain steps: max_k M(a, k) / (k c + v), from measured times.

        a = matchness (per-token acceptance), M(a, k) = (1 - a^(k+1)) / (1 - a) tokens per chain of k drafts
        (Leviathan et al. 2023), c and v the measured draft-forward and verification times over a plain step.
        Before any draft was timed: ``PlanPrices.speedup`` (this model's measured c and v(k + 1), or by weights).
        None when the plan has no score yet. Without a score and while optimising, the first probe waits for one;
        with optimisation off it follows the gate's schedule.
        """
        if matchness < 0:
            return None
        a = min(matchness, 0.999)
        depth = chain_depth(self.config.num_draft, self.config.tree, self.tree_nodes)  # k: the chain's draft forwards
        if self.plain.value and self.draft_forward.value and self.verify.value:
            step = 1.0 / self.plain.value
            c = 1.0 / self.draft_forward.value / step
            v = 1.0 / self.verify.value / step
            return max(cycle_speedup(iid_tokens_per_cycle(a, k), k, c, v) for k in range(1, depth + 1))
        return self.prices.speedup(self.best, a, depth)

    # -------------------------------------------------------------- persistence
    def save(self, path: str) -> None:
        """The best plan as a self_sd-compatible plan file."""
        PlanFile(self.best, self.runner.identity(), task="swift-stream",
                 objective={"name": "matchness", "value": None if self.best_score < 0 else self.best_score},
                 search={"steps": self.search.steps, "skip_ratio": self.config.skip_ratio,
                         "context_window": self.config.context_window, "bo_interval": self.config.bo_interval,
                         "stop_reason": self.stop_reason, "drafted_verifications": self.drafted_cycles},
                 source="swift", draft_head=head_record(self.vocab)).save(path)
        found = "no plan scored: the starting plan" if self.best_score < 0 else f"matchness {self.best_score:.3f}"
        tried = f"drafted with in {self.drafted_cycles} verification(s)" if self.drafted_cycles else "never drafted" \
            " with (every step was plain), so its speed is untried: compare it with --drafter self_sd --plan first"
        print(f"layerskip: swift: wrote {path}: {self.best.describe()}, {found} after {self.search.steps} optimisation "
              f"step(s); {tried}", file=sys.stderr, flush=True)

    def _reset_prompt_stats(self) -> None:
        self.forwards, self.opt_time, self.opt_steps, self.plain_steps = 0, 0.0, 0, 0
        self._traj_mark = len(self.trajectory)
