"""SWIFT: on-the-fly self-speculative decoding (Xia et al., ICLR 2025).

The skip set is optimised *during* generation from the tokens the full model already
produced: each candidate set of skipped attention/MLP sublayers is scored by one parallel
draft-mode forward over a window of verified context (matchness = fraction of positions where
the draft's argmax equals the full model's token). Candidates come from random search and,
every ``bo_interval`` steps, from Bayesian optimisation fitted to every scored candidate (optuna
TPE when optuna is installed, random search otherwise; with ``paper=true`` the reference's
GP-UCB, ``infer.gp_ucb``). Drafting is confidence-aware and verified as a dynamic top-k token tree.

Beyond the paper: the drafter measures its own tokens/s in drafting and in plain decoding and
falls back to plain steps while drafting does not pay, re-checking later; optimisation time is
capped at a fraction of decoding time (a larger share while drafting pays than while it does
not), so ``swift`` stays close to ``autoregressive`` on models without exploitable redundancy.

``paper=true`` turns all of that off and runs SWIFT as its released code does: no fallback, no
optimisation budget (an optimisation step after every verification until a stop criterion), the
paper's tree widths at every depth with no cap on the number of tree nodes, a GP-UCB Bayesian step
whose continuous suggestion keeps its top-n sublayers, one global best matchness (never rescored), the
window of each prompt's first γ+1 generated tokens scored on the prompt's KV only, the odd inner
layers as the starting plan, and the released evaluation script's window (50) and match threshold
(0.93) unless they are set.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from infer.drafters.base import DecodeState, Draft, Drafter, DraftVocabOption, VerifyOutcome
from infer.drafters.chain import ChainResult, PlanForward, draft_chain, draft_head_for
from infer.drafters.gate import COLD, FallbackGate, GateMemory, Rate, check_remember
from infer.drafters.skipping import matchness_span
from infer.drafters.swift_search import LayerSetSearch
from infer.kv_cache import ints_to_device
from infer.plan import (
    LayerPlan,
    PlanFile,
    check_plan_option,
    cycle_speedup,
    head_record,
    iid_tokens_per_cycle,
    odd_inner_plan,
    plan_for,
    weights_cost,
)
from layerskip_core.errors import UserError
from layerskip_core.options import check_fields

GREEDY_WIDTHS = (3, 5, 8, 10)  # candidates per depth for top-1 prob > 0.95, > 0.8, > 0.5, else (paper)
SAMPLING_WIDTHS = (1, 3, 5, 10)
WIDTH_THRESHOLDS = (0.95, 0.8, 0.5)
DEFAULT_WINDOW = 32  # inference_swift.py's --context-window default
DEFAULT_MATCH = 0.95  # inference_swift.py's --max-score default
SCRIPT_WINDOW = 50  # what eval_llama.sh, the released evaluation script, passes (paper=true)
SCRIPT_MATCH = 0.93


@dataclass
class SwiftConfig(DraftVocabOption):
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
    max_tree_nodes: int = 12
    """Cap on drafted tree nodes: on CPU, verifying T tokens costs ~2-3x one step at T = 4-16 (docs/RESULTS.md)."""
    opt_budget: float = 0.25
    """Most fraction of wall time spent optimising while drafting pays off (or is still being assessed)."""
    adaptive: bool = True
    """Draft only while draft-verify cycles measure faster than plain steps, else fall back to plain decoding and
    re-check later (the same gate as early_exit's; was ``fallback``)."""
    fallback_opt_budget: float = 0.03
    """Most fraction of wall time spent optimising while in the fallback (plain) mode (at most 0.01 when the
    remembered best plan is predicted not to pay)."""
    recheck_interval: int = 128
    """In fallback, probe drafting again after this many plain steps (doubling after each failed probe), if the
    cost model does not rule it out; sooner when a better plan is predicted to pay."""
    plan: str | LayerPlan | None = None
    """Initial plan: a plan file (a self_sd or swift plan JSON) or a ``LayerPlan`` for this model; default: a uniform
    plan at skip_ratio."""
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
        super().__post_init__()
        check_remember(self.remember)
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
            (self.num_draft >= 1 and self.max_tree_nodes >= 1, "num-draft and max-tree-nodes must be >= 1"),
            (0.0 <= self.fallback_opt_budget <= self.opt_budget < 1.0,
             "need 0 <= fallback-opt-budget <= opt-budget < 1"),
            (self.recheck_interval >= 1, "recheck-interval must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)


# --------------------------------------------------------------------------- the drafter
class SwiftDrafter(Drafter):
    name = "swift"
    Config = SwiftConfig
    aliases = {"r": "skip_ratio", "k": "num_draft", "beta": "bo_interval"}

    PROBE = FallbackGate.PROBE  # drafting cycles measured before drafting is judged
    REPROBE_GAIN = 0.05  # matchness gain since the last probe that triggers an early re-check
    HOPELESS_OPT_BUDGET = 0.01
    """Most fraction of its time a drafter spends optimising while plain when what it restored says no plan pays
    (the remembered best plan's predicted speed-up below 1, from the remembered draft and verify costs)."""

    def __init__(self, runner, config: SwiftConfig | None = None):
        self.config = cfg = config or SwiftConfig()
        self.runner = runner
        # a reduced-vocabulary draft head, or None; the references all draft with the full head
        self.draft_vocab = None if cfg.paper else cfg.draft_vocab
        self.vocab = draft_head_for(runner, self.draft_vocab)
        if runner.num_layers < 3:
            raise UserError("swift needs a model with at least 3 layers (the first and last always run)")
        self.search = LayerSetSearch(runner.num_layers, cfg.skip_ratio, cfg.bo_interval, cfg.opt_seed,
                                     bayes="gp_ucb" if cfg.paper else "tpe")
        # the reference starts from the odd inner layers (whatever the skip ratio); ours from a uniform plan
        self.best = odd_inner_plan(runner.num_layers) if cfg.paper else self.search.uniform_plan()
        if cfg.plan:
            self.best = plan_for(cfg.plan, runner.identity())
        self.best_score = -1.0  # best matchness found; < 0 = not scored yet
        # the reference optimises at least once (it checks its step limit after a step) and not with a cached plan
        self.stop_reason = "plan given (paper: no optimisation)" if cfg.paper and cfg.plan else ""
        self.optimising = not self.stop_reason and (cfg.max_opt_steps > 0 or cfg.paper)
        self._forward: PlanForward | None = None
        self.fallback = cfg.adaptive and not cfg.paper
        self.gate = FallbackGate(cfg.recheck_interval, enabled=self.fallback)
        self.draft_forward, self.verify = Rate(), Rate()  # forwards per second, verifications per second
        self.score_at_probe = -1.0
        self.opt_time_total = 0.0  # this drafter's own, over every prompt it decoded (never restored)
        self.decode_time = 0.0
        self.opt_step = Rate()  # seconds per scored candidate (its ``seconds``; remembered)
        self.trajectory: list[tuple[int, float]] = []
        self.window: tuple[int, int] | None = None
        self._reset_prompt_stats()
        self.hopeless = False  # what was restored says no plan pays: optimise within HOPELESS_OPT_BUDGET
        self.memory = GateMemory.for_drafter(runner, self.name, cfg) if self.fallback else None
        if self.memory is not None:
            self._restore(self.memory.load() or {})

    # -------------------------------------------------------------- protocol
    @property
    def mode(self) -> str:
        return self.gate.mode

    @property
    def plain(self) -> Rate:
        return self.gate.plain

    @property
    def drafting(self) -> Rate:
        return self.gate.drafting

    @property
    def forward(self) -> PlanForward:
        """The draft forward of the current best plan, so drafting always uses the optimised plan."""
        if self._forward is None or self._forward.plan != self.best:
            self._forward = PlanForward(self.runner, self.best, self.vocab)
        return self._forward

    @property
    def lookahead(self) -> int:
        return max(self.tree_nodes, self.config.num_draft) + self.config.context_window + 2

    @property
    def tree_nodes(self) -> int:
        """Most drafted tree nodes per verification (paper mode: a full tree of the widest width)."""
        cfg = self.config
        return cfg.num_draft * max(GREEDY_WIDTHS + SAMPLING_WIDTHS) if cfg.paper else cfg.max_tree_nodes

    def start(self, state: DecodeState) -> None:
        self.window: tuple[int, int] | None = None
        self._reset_prompt_stats()
        self._cycle_start = None

    def propose(self, state: DecodeState) -> Draft | None:
        self._cycle_start = time.perf_counter()
        self._draft_seconds = 0.0
        if self.mode == "plain":
            return None
        chain = draft_chain(state, self.forward, self.config.num_draft, self.config.confidence, keep_last=True,
                            keep_dists=self.config.tree)
        self.forwards += chain.forwards
        if not chain.forwards:
            return None
        self._draft_seconds = time.perf_counter() - self._cycle_start
        self.draft_forward.add(chain.forwards, self._draft_seconds)
        return self._tree(chain, state) if self.config.tree else chain.draft

    def update(self, state: DecodeState, outcome: VerifyOutcome) -> None:
        if self._cycle_start is not None:
            seconds = time.perf_counter() - self._cycle_start
            self.decode_time += seconds
            self.gate.record(len(outcome.tokens), seconds, drafted=outcome.draft is not None)
            if outcome.draft is not None:
                self.verify.add(1, seconds - self._draft_seconds)
        self._choose_mode()
        if self.optimising and self._window_ready(state) and self.within_budget():
            t0 = time.perf_counter()
            scored = self._optimise_step(state)
            spent = time.perf_counter() - t0
            self.opt_time += spent
            self.opt_time_total += spent
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
            if "plan" in saved and not self.config.plan:  # an explicit --plan wins over what was remembered
                L = self.runner.num_layers
                plan = LayerPlan(L, frozenset(saved["plan"]["attn"]), frozenset(saved["plan"]["mlp"]))
                if all(0 <= i < L for i in plan.skip_attn | plan.skip_mlp):
                    self.best, self.best_score = plan, float(saved["score"])
                    self.score_at_probe = self.best_score
                    self.hopeless = self.mode == "plain" and (self.predicted_speedup(self.best_score) or 0.0) < 1.0
        except (KeyError, TypeError, ValueError):
            self.gate = FallbackGate(self.config.recheck_interval, enabled=self.fallback)

    def stats(self) -> dict:
        return {"draft_forwards": self.forwards, "opt_time": self.opt_time, "opt_steps": self.opt_steps,
                "plain_steps": self.plain_steps, "best_matchness": self.best_score, "skip_ratio": self.best.skip_ratio,
                "plan": self.best.describe(), "mode": self.mode, "optimising": self.optimising,
                "stop_reason": self.stop_reason, "tps_plain": self.plain.value, "tps_draft": self.drafting.value,
                "predicted_speedup": self.predicted_speedup(self.best_score),
                "opt_step_time": self.opt_step.seconds if self.opt_step.cycles else None,
                "bayes": self.search.method, "window": self.window,
                "draft_vocab": None if self.vocab is None else self.vocab.size,
                "start_state": COLD if self.memory is None else self.memory.start_state, "hopeless": self.hopeless,
                "matchness_trajectory": self.trajectory[self._traj_mark:]}

    # -------------------------------------------------------------- tree building
    def _tree(self, chain: ChainResult, state: DecodeState) -> Draft:
        """Chain nodes first (positions 1..m), then siblings of each chain node, shallow depths first.

        Candidates for every depth are chosen on the device at once and read in one transfer (with the
        chain's confidences when the chain did not read them): one host sync per tree, not several per depth.
        """
        draft = chain.draft
        m = draft.size
        room = self.tree_nodes - m
        if m == 0 or room <= 0:
            return draft
        greedy = state.sampling.greedy
        widths = GREEDY_WIDTHS if greedy else SAMPLING_WIDTHS
        dists = torch.cat(chain.dists[:m])  # (m, V)
        n_max = min(max(widths) - 1, room, dists.shape[1] - 1)
        candidates = _candidates(dists, draft.tokens, n_max, greedy, state.generator)  # (m, n_max), -1 = none
        if len(chain.confidence) >= m:
            rows, conf = candidates.tolist(), chain.confidence[:m]  # the tree's one sync
        else:  # the chain read nothing: its confidences come along in the same transfer
            p1 = dists.gather(-1, draft.tokens[:, None])  # (m, 1)
            host = torch.cat([candidates.double(), p1.double()], 1).tolist()  # the tree's one sync
            rows, conf = [[int(c) for c in r[:-1]] for r in host], [r[-1] for r in host]
        extra_tok, extra_parent = [], []
        for depth in range(m):
            width = next((w for t, w in zip(WIDTH_THRESHOLDS, widths, strict=False) if conf[depth] > t), widths[-1])
            siblings = [c for c in rows[depth] if c >= 0][:min(width - 1, room)]
            room -= len(siblings)
            extra_tok += siblings
            extra_parent += [depth] * len(siblings)  # depth d's siblings hang off chain position d
            if room <= 0:
                break
        if not extra_tok:
            return draft
        tokens = torch.cat([draft.tokens, ints_to_device(extra_tok, draft.tokens.device)])  # pinned copy: no sync
        # a sibling was drawn from the same distribution as the chain node at its depth
        q = None if draft.q is None else draft.q.index_select(0, ints_to_device(list(range(m)) + extra_parent,
                                                                                 draft.q.device))
        return Draft(tokens, list(range(m)) + extra_parent, q, draft.exact_layers, draft.hidden)

    # -------------------------------------------------------------- optimisation
    def within_budget(self) -> bool:
        """Would one more optimisation step keep optimisation within its share of decode + optimisation time?

        The share is ``opt_budget`` while drafting (paying, or being probed) and ``fallback_opt_budget`` while
        taking plain steps (the fallback, and before the first probe, which waits for a scored plan), of this
        drafter's own time: what earlier commands decoded is not credit (their plan, when remembered, was paid
        for then); plain, at most ``HOPELESS_OPT_BUDGET`` when what was restored says no plan pays. The step's cost
        is what scoring a plan took so far (remembered across commands; 0 before any), twice when the window is
        new (the incumbent is rescored too), so a step the prompt's own decoding cannot pay for is not taken up
        front, while a long prompt or a stream still earns steps (whose better plan can bring an early probe).
        """
        if self.config.paper:
            return True
        step = (self.opt_step.seconds if self.opt_step.cycles else 0.0) * (2 if self.window is None else 1)
        share = self.config.opt_budget if self.mode == "draft" else self.config.fallback_opt_budget
        if self.hopeless and self.mode == "plain":
            share = min(share, self.HOPELESS_OPT_BUDGET)
        spent = self.opt_time_total
        return spent + step <= share * (self.decode_time + spent + step)

    def _window_ready(self, state: DecodeState) -> bool:
        """Whether this prompt has the γ verified tokens the optimiser scores candidates on."""
        return self.window is not None or state.n - state.prompt_len >= self.config.context_window

    def _optimise_step(self, state: DecodeState) -> int:
        """Score one candidate on this prompt's window (the incumbent too when the window is new, outside paper
        mode); returns the number of plans scored."""
        scored = 0
        if self.window is None:
            if not self._window_ready(state):
                return 0  # context accumulation: draft with the current plan until γ verified tokens exist
            self.window = self._new_window(state)
            if not self.config.paper:
                # the window changed: rescore the incumbent on it so comparisons are like for like
                self.best_score = matchness_span(state, [self.best], *self.window, vocab=self.vocab)[0]
                scored += 1
        plan, proposal = self.search.propose()
        score = matchness_span(state, [plan], *self.window, vocab=self.vocab)[0]
        self.search.record(plan, proposal, score)
        self.opt_steps += 1
        # paper mode keeps the reference's one global best score, which starts at 0 and is never rescored
        if score > (max(self.best_score, 0.0) if self.config.paper else self.best_score):
            self.best, self.best_score = plan, score
            self.search.since_improved = 0
        else:
            self.search.since_improved += 1
        self.trajectory.append((self.search.steps, self.best_score))
        self.check_stop()
        return scored + 1

    def _new_window(self, state: DecodeState) -> tuple[int, int]:
        """[start, end): the tokens re-run to score a plan (each predicts the next verified token).

        Ours: the latest γ verified tokens. Paper mode: the prompt's first γ+1 generated tokens (the
        first γ re-run, each predicting the next), whose draft-mode rows see only the prompt's KV, as the
        reference's ``swift_optimization`` scores them on a copy of the prompt's prefilled cache.
        """
        gamma = self.config.context_window
        if self.config.paper:
            return state.prompt_len, state.prompt_len + gamma
        return state.n - gamma, state.n

    def check_stop(self) -> None:
        """The stop criteria; paper mode compares strictly, as the reference does (score > threshold, more than
        patience steps without improvement, more than max-opt-steps steps)."""
        cfg = self.config
        strict = cfg.paper
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
        probe, or when the best matchness has gained ``REPROBE_GAIN`` since the last probe (an early probe if
        it predicts >= 1). Before drafting was ever timed it is an optimistic bound (``predicted_speedup``), and
        before any plan was scored nothing is known, so the first probe waits for a score: a plan that cannot
        pay is never drafted with, and a cold start costs what plain decoding costs.
        """
        if not self.fallback:
            return
        predicted = None
        early = False
        if self.mode == "plain":
            self.plain_steps += 1
            gained = self.best_score >= self.score_at_probe + self.REPROBE_GAIN
            first = self.gate.drafting.cycles == 0
            if first or gained or self.gate.mode_cycles + 1 >= self.gate.recheck:
                predicted = self.predicted_speedup(self.best_score)
                if predicted is None and first and self.optimising:
                    predicted = 0.0  # no plan scored yet (the optimiser will score one): wait for it
                early = gained and (predicted or 0.0) >= 1.0
        if self.gate.decide(predicted, early_probe=early):
            self.score_at_probe = self.best_score

    def predicted_speedup(self, matchness: float) -> float | None:
        """Cost-model speed-up of drafting over plain steps: max_k M(a, k) / (k c + v), from measured times.

        a = matchness (per-token acceptance), M(a, k) = (1 - a^(k+1)) / (1 - a) tokens per chain of k drafts
        (Leviathan et al. 2023), c and v the measured draft-forward and verification times over a plain step.
        Before any draft was timed: an optimistic bound with c = the share of the weights the plan's draft
        reads (a draft cannot cost less than reading them where decoding is memory-bound) and v = 1 (a
        verification costs at least a plain step). None when the plan has no score yet. Without a score and
        while optimising, the first probe waits for one; with optimisation off it follows the gate's schedule.
        """
        if matchness < 0:
            return None
        if self.plain.value and self.draft_forward.value and self.verify.value:
            step = 1.0 / self.plain.value
            c = 1.0 / self.draft_forward.value / step
            v = 1.0 / self.verify.value / step
        else:
            head_share = 1.0 if self.vocab is None else self.vocab.size / self.runner.spec.vocab_size
            c, v = weights_cost(self.runner.spec, 1).draft(self.best, head_share), 1.0
        a = min(matchness, 0.999)
        return max(cycle_speedup(iid_tokens_per_cycle(a, k), k, c, v) for k in range(1, self.config.num_draft + 1))

    # -------------------------------------------------------------- persistence
    def save(self, path: str) -> None:
        """The best plan as a self_sd-compatible plan file."""
        PlanFile(self.best, self.runner.identity(), task="swift-stream",
                 objective={"name": "matchness", "value": None if self.best_score < 0 else self.best_score},
                 search={"steps": self.search.steps, "skip_ratio": self.config.skip_ratio,
                         "context_window": self.config.context_window, "bo_interval": self.config.bo_interval,
                         "stop_reason": self.stop_reason}, source="swift",
                 draft_head=head_record(self.vocab)).save(path)

    def _reset_prompt_stats(self) -> None:
        self.forwards = 0
        self.opt_time = 0.0
        self.opt_steps = 0
        self.plain_steps = 0
        self._traj_mark = len(self.trajectory)


def _candidates(dists: torch.Tensor, chosen: torch.Tensor, n: int, greedy: bool, generator) -> torch.Tensor:
    """(m, n) more candidates per depth besides ``chosen`` (m,), in order, -1 where a depth has fewer.

    Greedy: the next most likely tokens of each row of ``dists`` (m, V). Sampling: an ordered draw without
    replacement from each row with the chosen token removed, by the Gumbel-top-k trick (top-n of
    log p + Gumbel noise is distributed as n sequential draws without replacement), so all depths are
    drawn at once.
    """
    rest = dists.scatter(1, chosen[:, None], 0.0)  # (m, V)
    if greedy:
        values, index = torch.topk(rest, n, dim=-1)  # (m, n)
        return torch.where(values > 0, index, -1)
    u = torch.rand(rest.shape, generator=generator, device=rest.device).clamp_min(1e-20)  # (m, V)
    keys = rest.log() - (-u.log()).log()  # (m, V): -inf where rest is 0
    values, index = torch.topk(keys, n, dim=-1)  # (m, n)
    return torch.where(values > float("-inf"), index, -1)
