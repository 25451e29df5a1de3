"""Dynamic exit: the exit layer E and the draft length k chosen per context, online, from per-exit acceptance
estimated while decoding (the idea of DEL, "Context-Aware Dynamic Exit Layer for Efficient Self-Speculative
Decoding", Entezari Zarch et al., COLM 2025; docs/DYNAMIC_EXIT.md says where this differs).

Every few cycles (``observe_every``) the verification forward is split at the candidate exits
(the draft's ``observe``), so it hands back the residual stream entering each of them at every verified
position; the draft head scores those rows in one call and each exit's top token is compared with the token the
target emitted there (its "shadow" draft), and its probability with each candidate confidence stop. Discounted
counts give, per exit and stop, how often a draft would be proposed and accepted and how such positions run on
(``infer.drafters.exit_choice``). A cost model prices a draft forward at exit e (layers [0, e) and the draft head)
and a verification of T rows (the first row's layers [e, L) and full head, then a slope per row) in plain steps, as
this model measured them once on this machine (``infer.drafters.costs``; ``costs=weights``: by the weights each
reads); the (E, k, stop) with the most expected tokens per unit of cost drafts next, or a plain step when none is
predicted to beat plain decoding. The
``--adaptive`` fallback gate (``infer.drafters.gate``) sits on top: it times plain steps and draft cycles and takes
plain steps while measured drafting does not pay, so a cost model that is wrong for this machine costs little.

Drafting from E is LayerSkip's early exit (``infer.drafters.chain.EarlyExitForward``): the draft's KV of layers
< E and its stream at E are exact, so verification runs only layers >= E for the drafted rows, whichever E drafts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from torch import Tensor

from infer.drafters.base import (
    DecodeState,
    Draft,
    Drafter,
    DrafterStats,
    DraftInputs,
    DraftVocabOption,
    Needs,
    VerifyOutcome,
)
from infer.drafters.chain import ChainAsk, EarlyExitForward, ObservingForward, check_size, draft_chains
from infer.drafters.costs import (
    CostsOption,
    CycleTiming,
    exit_prices,
    measured_exit_prices,
    realised_cost,
    verify_prices,
)
from infer.drafters.examples import ExampleModel
from infer.drafters.exit_choice import Choice, RunEstimates, best_choice, parse_stops
from infer.drafters.gate import COLD, GateOwner, RememberOption
from infer.drafters.inputs import draft_head, draft_quant, draft_runner
from infer.model.kv_cache import ints_to_device
from infer.model.quant_weights import byte_share
from layerskip_core import inputs
from layerskip_core.errors import UserError
from layerskip_core.options import check_fields, load_yaml

AUTO = "auto"
EXPLORE_FLOOR = 0.85
"""Predicted speed-up from which an exploration draft is worth its price (``explore_every``)."""
SPARSE_OBSERVE = 4
"""Observation windows come this many times less often while the cost model takes plain steps (its best choice is
predicted under ``min_speedup``): each costs a head call that plain decoding does not, and a plain step adds one
position to the estimates, not a drafted window's several (explorations are still observed)."""
PRIORS = (AUTO, "depth", "flat")
"""Values of the ``prior`` option."""
SWITCH_MARGIN = 0.03
"""Another exit becomes the choice only when predicted this much faster than the current exit's best k and stop:
estimates a few observed positions apart differ by noise, and each switch drafts from an exit measured less."""
WEIGHTS_SLOPE = 0.13
"""``verify_slope`` with ``costs`` weights: the default model's on the machines of docs/RESULTS.md."""
OBSERVE_SHARE = 0.02
"""Most share of its decoding time the drafter spends scoring observed positions while the cost model takes plain
steps (a head call per observed cycle: with Gemma 3's full 262144-token head most of a step)."""
MAX_SCHEDULE = 200
"""Most changes of choice a generation's stats list (``DynamicExitStats.schedule``)."""


@dataclass
class DynamicExitConfig(DraftVocabOption, RememberOption, CostsOption):
    """Settings of the dynamic-exit drafter."""

    exits: str = AUTO
    """Candidate exit layers E (1 <= E < L), separated by '/' or ',' (e.g. 8/16/24); auto: the exits the checkpoint
    was trained with (early_exit.exits of the training run's config.yaml beside the model folder), else L/4, L/2 and
    3L/4."""
    num_draft: int = 8
    """k: most tokens drafted per verification (the cost model picks k in 1..this)."""
    stops: str = AUTO
    """Confidence stops chosen among per context: a chain stops at the first draft whose top-1 probability is under
    the stop ('/'-separated thresholds in [0, 1), 0 = draft all k; one value: always that stop); auto = 0/0.5/0.7/0.9.
    """
    verify_slope: float | None = None
    """Cost of each verified row beyond the first, in plain steps; default: this model's, measured with ``costs``
    measured ((v(k + 1) - 1) / k), 0.13 with costs weights (the default model's on the machines of docs/RESULTS.md)."""
    min_speedup: float = 1.05
    """Draft only when the cost model predicts at least this speed-up over a plain step (0: the cost model always
    drafts its best (E, k); with adaptive the gate may still take plain steps); above 1 because a prediction near
    even is within the model's error (docs/DYNAMIC_EXIT.md)."""
    decay: float = 0.97
    """Weight each observed position's hit or miss keeps per later observed position (the estimates' memory: about
    1 / (1 - decay) positions)."""
    observe_every: int = 2
    """Estimate every exit's acceptance on one cycle's verified positions of every this many (two cycles in a row
    of every 2n; 1 = every cycle)."""
    prior: str = AUTO
    """Each exit's P(good) before anything is observed (worth 4 positions): depth = E / L (deeper exits agree more
    with the last layer, so the deepest candidate drafts first and what it observes decides from there on); flat =
    0.1 for every exit; auto = depth for a checkpoint whose training run recorded its early exits (config.yaml
    beside the model folder: they were trained to agree), else flat."""
    prompt_rows: int = 0
    """First estimates from the prompt: the prefill keeps each candidate exit's stream at the prompt's last this many
    positions, and each exit's top token there is compared with the target's (a draft-head call of exits x this
    rows and a full-head call of this rows per prompt), so the first drafts follow this context's own acceptance
    instead of a flat prior (0: none)."""
    explore_every: int = 16
    """While it takes plain steps (the cost model's or the gate's choice) but predicts at least 0.85x for its best
    choice, draft that choice once every this many cycles: how acceptance runs on (a good draft after a good one) is
    only seen in drafted text (0 = never)."""
    calibrate: bool = True
    """Divide every drafting choice's predicted speed-up by the measured cost of drafting: seconds per unit of
    priced cost of the drafted cycles against a plain step's seconds (``CycleTiming``); off: the prices alone
    (``costs``; deterministic choices with costs weights)."""
    adaptive: bool = False
    """Also time plain steps and draft cycles (the fallback gate of early_exit --adaptive) and take plain steps
    while measured drafting does not beat them; off (default): the cost model alone decides, its drafting predictions
    already divided by the measured cost of drafting (``calibrate``); why off: docs/DYNAMIC_EXIT.md."""
    recheck_interval: int = 128
    """With adaptive: plain steps before drafting is probed again (doubling after each failed probe)."""

    def __post_init__(self) -> None:
        check_fields(self, "dynamic_exit")
        DraftVocabOption.__post_init__(self)
        RememberOption.__post_init__(self)
        CostsOption.__post_init__(self)
        check_size(self.num_draft, "num-draft")
        parse_exits(self.exits)
        try:
            parse_stops(self.stops)
        except ValueError as e:
            raise UserError(str(e)) from None
        if self.prior not in PRIORS:
            raise UserError(f"prior must be one of {', '.join(PRIORS)}, got {self.prior!r}")
        if not 0 <= self.prompt_rows <= 4096:
            raise UserError(f"prompt-rows must be between 0 and 4096 prompt positions (0 = none), "
                            f"got {self.prompt_rows}")
        if self.explore_every < 0:
            raise UserError(f"explore-every must be >= 0 cycles (0 = never), got {self.explore_every}")
        if self.verify_slope is not None and not 0.0 <= self.verify_slope <= 10.0:
            raise UserError(f"verify-slope must be in [0, 10] (plain steps per extra verified row), "
                            f"got {self.verify_slope}")
        if not 0.0 <= self.min_speedup <= 100.0:
            raise UserError(f"min-speedup must be in [0, 100], got {self.min_speedup}")
        if not 0.0 < self.decay < 1.0:
            raise UserError(f"decay must be in (0, 1), got {self.decay}")
        if not 1 <= self.observe_every <= 10**6:
            raise UserError(f"observe-every must be between 1 and 1000000 cycles, got {self.observe_every}")
        if self.recheck_interval < 1:
            raise UserError(f"recheck-interval must be >= 1, got {self.recheck_interval}")


def parse_exits(text: str) -> list[int] | None:
    """``'8/16/24'`` (or ``'8,16,24'``) -> [8, 16, 24]; None for auto; anything else is refused in one line."""
    if text == AUTO:
        return None
    parts = text.replace(",", "/").split("/")
    if not all(p.strip().isascii() and p.strip().isdigit() for p in parts):  # not '²', which int() refuses
        raise UserError(f"exits must be layer numbers separated by '/' (e.g. 8/16/24) or 'auto', got {text!r}")
    exits = [int(p) for p in parts]
    if len(set(exits)) != len(exits):
        raise UserError(f"exits has duplicates: {text!r}")
    return sorted(exits)


def trained_exits(runner) -> list[int] | None:
    """The early exits the checkpoint's training run enabled (early_exit.exits in the config.yaml beside its model
    folder, as ``layerskip train`` writes runs/NAME/{config.yaml,final/}), those below L; None when not recorded."""
    folder = getattr(runner.config, "name_or_path", "") or ""
    config = Path(folder).parent / "config.yaml" if folder and Path(folder).is_dir() else None
    if config is None or not config.is_file():
        return None
    try:
        exits = load_yaml(inputs.read_text(config, "training config"))["early_exit"]["exits"]
    except (UserError, yaml.YAMLError, KeyError, TypeError):  # load_yaml: a nesting too deep is a YAMLError too
        return None
    if not isinstance(exits, list) or not all(isinstance(e, int) and not isinstance(e, bool) for e in exits):
        return None
    return sorted({e for e in exits if 1 <= e < runner.num_layers}) or None


def candidate_exits(text: str, runner) -> list[int]:
    """The candidate exits of option ``exits`` on ``runner``'s model (refused unless 1 <= E < L)."""
    L = runner.num_layers
    exits = parse_exits(text) or trained_exits(runner) or sorted({max(1, min(L - 1, round(L * i / 4)))
                                                                  for i in (1, 2, 3)})
    bad = [e for e in exits if not 1 <= e < L]
    if bad or L < 2:
        raise UserError(f"exit {bad[0] if bad else 1} is out of range: the model has {L} layers, so candidate "
                        f"exits lie in 1 <= E < {L}")
    return exits


@dataclass
class DynamicExitStats(DrafterStats):
    """What the dynamic-exit drafter reports."""

    plain_steps: int = 0
    """Cycles that drafted nothing (the cost model or the gate chose a plain step)."""
    exits: list[int] = field(default_factory=list)
    """The candidate exits."""
    acceptance: list[float] = field(default_factory=list)
    """Estimated per-token acceptance of each candidate exit without a stop, at the end (the order of ``exits``)."""
    drafted_cycles: list[int] = field(default_factory=list)
    """Cycles drafted from each candidate exit (the order of ``exits``)."""
    stops: list[float] = field(default_factory=list)
    """The candidate confidence stops."""
    schedule: list[list[float]] = field(default_factory=list)
    """[cycle, E, k, stop] each time the choice changed (E = k = 0: plain steps), the first ``MAX_SCHEDULE``."""
    observed_rows: int = 0
    """Verified positions whose stream was scored at every candidate exit for the estimates."""
    prompt_rows: int = 0
    """Prompt positions scored at every candidate exit before the first draft (``prompt_rows`` option)."""
    observe_seconds: float = 0.0
    """Time spent scoring those and the verified positions (inside the update time, the prompt's in the first cycle
    asking for a draft; the split forwards themselves cost no extra layers)."""
    explored_cycles: int = 0
    """Cycles drafted to explore while the cost model predicted under ``min_speedup`` (``explore_every``)."""
    draft_vocab: int | None = None
    """Size of the reduced draft vocabulary (None: the full head)."""
    mode: str | None = None
    """With adaptive: the gate's mode at the end ('draft' or 'plain')."""


class DynamicExitDrafter(GateOwner, Drafter):
    name = "dynamic_exit"
    Config = DynamicExitConfig
    aliases = {"k": "num_draft"}
    WARM_UP = {"remember": "off"}

    @classmethod
    def examples(cls, model: ExampleModel) -> dict[str, dict]:
        """Choosing among several exits from counts alone (``infer.drafters.examples``): every cycle drafts (no
        speed-up required, no gate, no confidence stop, no timing calibration) and observes."""
        return {"": {"exits": model.exits, "num_draft": 3, "min_speedup": 0, "adaptive": False, "observe_every": 1,
                     "calibrate": False, "stops": "0", "costs": "weights"}}

    @classmethod
    def resolve(cls, spec, runner, tokenizer=None) -> DraftInputs:
        """The draft head; the candidate exits are checked against the model here, before decoding."""
        candidate_exits(spec.config.exits, runner)
        return DraftInputs(vocab=draft_head(spec, runner, tokenizer))

    def __init__(self, runner, config: DynamicExitConfig, inputs: DraftInputs):
        self.runner, self.config, self.vocab = runner, config, inputs.vocab
        self.exits = candidate_exits(config.exits, runner)
        quant = draft_quant(config.draft_dtype, runner)  # int8 / int4: drafts on a quantized copy, nothing exact
        self.quant, self.exact = quant, quant is None
        self.drafting = draft_runner(config.draft_dtype, runner, max(self.exits))
        self.prices, self.verify_prices, slope = self._prices()
        self.slope = slope if config.verify_slope is None else config.verify_slope
        self.timing = CycleTiming()
        self.forwards_at = {e: EarlyExitForward(self.drafting, e, self.vocab, self.exact) for e in self.exits}
        depth = config.prior == "depth" or (config.prior == AUTO and trained_exits(runner) is not None)
        prior = {e: e / runner.num_layers for e in self.exits} if depth else None
        self.estimates = RunEstimates(self.exits, parse_stops(config.stops), config.decay, prior)
        self.init_gate(runner, config)
        self.choice: Choice | None = None  # none yet: the first choice has no current exit to stay with
        self.choice = self._best()
        self._gate_exit: int | None = None  # the exit drafting when the gate last started a probe
        self._observe: tuple[int, ...] = ()  # what this cycle's draft asks the verification to keep
        self._unscored: DecodeState | None = None  # a started sequence whose prompt streams are not scored yet
        self._reset_counts()

    def _prices(self) -> tuple[dict[int, float], dict[int, float], float]:
        """Each exit's draft forward and verification price and the slope of extra verified rows, in plain steps: this
        model's, measured once per model, dtype, draft dtype and threads (``costs`` measured:
        ``infer.drafters.costs``), or by the weights each reads (a quantized draft's at its bytes per weight; it reuses
        nothing at verification)."""
        if self.config.costs == "measured":
            copy = None if self.exact else self.drafting
            p = measured_exit_prices(self.runner, self.exits, self.vocab, self.config.num_draft, copy, self.quant)
            return p.draft, p.verify, p.slope
        rows = self.runner.spec.vocab_size if self.vocab is None else self.vocab.size
        spec, dtype = self.runner.spec, self.runner.dtype
        shares = (byte_share(self.quant, dtype), byte_share(self.quant, dtype, True))
        return exit_prices(spec, self.exits, rows, shares), verify_prices(spec, self.exits, self.exact), WEIGHTS_SLOPE

    def _reset_counts(self) -> None:
        self.forwards = self.plain_steps = self.cycle = self.observed_rows = self.explored = self.prompt_scored = 0
        self._since_draft = 0
        self._next_start = -1  # the position after the last observed window
        self.observe_seconds = self.decode_seconds = 0.0
        self.drafted_at = dict.fromkeys(self.exits, 0)
        self.schedule: list[list[float]] = []
        self._cycle_start: float | None = None
        self._cost = 0.0  # the drafted cycle's realised cost by weight count (``realised_cost``)
        self._forward: ObservingForward | None = None

    def needs(self) -> Needs:
        return Needs(lookahead=self.config.num_draft + 1, prompt_layers=tuple(self.exits),
                     prompt_rows=self.config.prompt_rows)

    def _best(self) -> Choice:
        args = (self.estimates, self.prices, self.config.num_draft, self.slope, self.verify_prices)
        best, current = best_choice(*args), self.choice
        if current is not None and best.exit != current.exit:
            stay = best_choice(*args, exits=[current.exit])  # the current exit's best k and stop under new estimates
            best = best if best.speedup > stay.speedup * (1 + SWITCH_MARGIN) else stay
        scale = self.timing.scale() if self.config.calibrate else 1.0
        return Choice(best.exit, best.k, best.stop, best.speedup / scale)

    def start(self, state: DecodeState) -> None:
        self._reset_counts()
        self._unscored = state  # the prompt's streams are scored at the first cycle this drafter is asked to draft

    def _score_prompt(self) -> None:
        """The prompt's last positions scored at every exit: this context's first estimates, at the first cycle asking
        for a draft (a batch taking plain steps never pays the head over its prompts: Gemma 3's is 262k wide)."""
        state, self._unscored = self._unscored, None
        kept = state.prompt_observed
        if kept and state.depth in kept:
            t0 = time.perf_counter()
            target = self.runner.logits(kept[state.depth]).argmax(-1)  # (m,): what greedy verification accepts
            self._count({e: kept[e] for e in self.exits if e in kept}, target, continues=False)
            self.prompt_scored = len(target)
            self.observe_seconds += time.perf_counter() - t0
            self.choice = self._best()

    def propose(self, state: DecodeState) -> Draft | None:
        return self.propose_rows([(self, state)])[0]

    @classmethod
    def propose_rows(cls, rows: Sequence[tuple[DynamicExitDrafter, DecodeState]]) -> list[Draft | None]:
        """Each row chooses its exit, length and stop on its own estimates; the drafting rows' chains then run together
        (``draft_chains``: one packed draft forward per step for the rows at the same exit)."""
        drafts: list[Draft | None] = [None] * len(rows)
        asks, drafting = [], []
        for j, (drafter, state) in enumerate(rows):
            ask = drafter.cycle_ask(state)
            if ask is None:
                drafts[j] = drafter.plain_step()
            else:
                asks.append(ask)
                drafting.append(j)
        for j, chain in zip(drafting, draft_chains(asks), strict=True):
            drafts[j] = rows[j][0]._drafted(chain)
        return drafts

    def cycle_ask(self, state: DecodeState) -> ChainAsk | None:
        """Start this sequence's cycle: its chain request under the current choice, or None for a plain step."""
        if self._unscored is not None:
            self._score_prompt()
        self._cycle_start = time.perf_counter()
        self.cycle += 1
        c = self.choice
        drafts = self._drafts(c)
        # an exploration is always observed: what it drafts is what it is for
        observe = self._observes() or (drafts and self._since_draft > 0)
        self._observe = tuple(self.exits) if observe else ()
        if not drafts:
            return None
        self._forward = ObservingForward(self.runner, c.exit, self.exits, self.vocab) \
            if observe and c.exit > self.exits[0] and self.exact else None  # inexact drafts: verification observes
        return ChainAsk(state, self._forward or self.forwards_at[c.exit], c.k, c.stop)

    def _drafted(self, chain) -> Draft | None:
        """This sequence's draft from its chain (None: the chain drafted nothing, a plain step)."""
        c = self.choice
        self._cost = realised_cost(self.prices[c.exit], self.verify_prices[c.exit], self.slope,
                                   chain.forwards, len(chain.draft.tokens))
        self.forwards += chain.forwards
        if not chain.forwards:
            return self.plain_step()
        if self._forward is not None:
            chain.draft.observed = self._forward.observed()
        chain.draft.observe = self._observe
        self._note(c.exit, c.k, c.stop)
        self.drafted_at[c.exit] += 1
        self._since_draft = 0
        return chain.draft

    def _observes(self) -> bool:
        """Observe two cycles in a row of every ``2 observe_every`` (a share of 1 / observe_every; ``SPARSE_OBSERVE``
        times fewer while the cost model takes plain steps): consecutive windows, so that plain steps too show
        whether a good position follows a good one. While it takes plain steps, scoring stays within ``OBSERVE_SHARE``
        of the decoding time."""
        plain = self.choice.speedup < self.config.min_speedup
        if plain and self.observe_seconds > OBSERVE_SHARE * self.decode_seconds:
            return False
        n = 2 * self.config.observe_every * (SPARSE_OBSERVE if plain else 1)
        return self.cycle % n in (n - 1, 0)  # cycles count from 1: n - 1 and n, 2n - 1 and 2n, ...

    def _drafts(self, c: Choice) -> bool:
        """Whether this cycle drafts ``c``: the cost model predicts a gain and the gate is not in plain mode, or ``c``
        is nearly even and the last draft was ``explore_every`` cycles ago (an exploration, so that runs of good
        drafts can be seen at all; one cycle, whatever the gate's mode)."""
        if c.speedup >= self.config.min_speedup and self.gate.mode != "plain":
            return True
        explore = self.config.explore_every and c.speedup >= EXPLORE_FLOOR \
            and self._since_draft >= self.config.explore_every
        self.explored += bool(explore)
        return bool(explore)

    def skip(self, state: DecodeState) -> Draft | None:
        self._cycle_start, self._observe, self.cycle = None, (), self.cycle + 1  # not timed, nothing observed
        return self.plain_step()

    def plain_step(self) -> Draft | None:
        """A plain step this cycle (None, or an empty draft that still asks for the cycle's observations)."""
        self.plain_steps += 1
        self._since_draft += 1
        self._note(0, 0, 0.0)
        return Draft.plain(self._observe)

    def _note(self, exit: int, k: int, stop: float) -> None:
        last = self.schedule[-1][1:] if self.schedule else None
        if last != [exit, k, stop] and len(self.schedule) < MAX_SCHEDULE:
            self.schedule.append([self.cycle, exit, k, stop])

    def update(self, state: DecodeState, outcome: VerifyOutcome) -> None:
        drafted = outcome.drafted > 0  # a plain step that observes verifies an empty draft
        if self._cycle_start is not None:  # timed before an observation's scoring, which either choice pays
            seconds = time.perf_counter() - self._cycle_start
            self.decode_seconds += seconds
            if drafted:
                self.timing.cycle(seconds, self._cost)
            else:
                self.timing.plain_step(seconds)
        if outcome.observed:  # the estimates change only here
            self._learn(outcome)
            self.choice = self._best()
        if self._cycle_start is not None:
            seconds = time.perf_counter() - self._cycle_start
            self.gate.record(len(outcome.tokens), seconds, drafted=drafted)
            c = self.choice  # a new exit predicted to pay is probed early: the gate measured another one
            moved = c.exit != self._gate_exit and c.speedup >= self.config.min_speedup
            if self.gate.decide(predicted=c.speedup, early_probe=self.gate.mode == "plain" and moved):
                self._gate_exit = c.exit

    def _learn(self, outcome: VerifyOutcome) -> None:
        """Score the verified path's rows at every observed exit with the draft head, in one call, and count where
        each exit's top token is the token the target emitted after that position, with its probability."""
        t0 = time.perf_counter()
        path, P = outcome.path, len(outcome.path)
        target = ints_to_device(outcome.tokens, self.runner.device)  # (P,): accepted drafts, then the bonus token
        streams = {e: outcome.observed[e][path] for e in self.exits if e in outcome.observed}  # (P, d) each
        self._count(streams, target, continues=outcome.start == self._next_start)
        self._next_start = outcome.start + P
        self.observed_rows += P
        self.observe_seconds += time.perf_counter() - t0

    def _count(self, streams: dict[int, Tensor], target: Tensor, continues: bool) -> None:
        """Count, per exit, where the draft head's top token on its stream (P, d) is ``target`` (P,) (consecutive
        positions), with its probability; ``continues``: they follow the last window counted."""
        if not streams:
            return
        exits, P = list(streams), len(target)
        rows = torch.cat([streams[e] for e in exits])  # (n_exits P, d)
        probs, shadow = self.runner.logits(rows, self.vocab).float().softmax(-1).max(-1)  # (n_exits P,) each
        hits = shadow.view(len(exits), P) == target.to(shadow.device)[None]  # (n_exits, P)
        host = torch.stack([probs.view(len(exits), P).double(), hits.double()]).tolist()  # the update's one sync
        for e, p_row, hit_row in zip(exits, host[0], host[1], strict=True):
            self.estimates.add(e, p_row, [h > 0.5 for h in hit_row], continues)

    def stats(self) -> DynamicExitStats:
        alpha = self.estimates.alpha()
        return DynamicExitStats(
            self.forwards, COLD if self.memory is None else self.memory.start_state, self.plain_steps,
            list(self.exits), [round(alpha[e], 4) for e in self.exits], [self.drafted_at[e] for e in self.exits],
            list(self.estimates.stops), [list(s) for s in self.schedule], self.observed_rows, self.prompt_scored,
            self.observe_seconds,
            self.explored,
            None if self.vocab is None else self.vocab.size, self.gate.mode if self.config.adaptive else None)
