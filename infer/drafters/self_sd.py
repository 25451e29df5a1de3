"""Self-speculative decoding (Draft & Verify, Zhang et al., ACL 2024): a fixed sublayer skip plan.

The plan (skipped attention and MLP sublayers) is found offline by ``layerskip search`` and
stored as JSON tied to the model. Drafting runs the model under the plan token by token and
stops when the draft's top-1 probability falls below a threshold gamma, which adapts during
generation (the paper's §3.3 "adaptive draft-exiting"; defaults from its reference code):

    acc   <- b1 * acc + (1 - b1) * accepted / drafted          (smoothed acceptance, acc_0 = 0)
    g'    =  gamma + eps   if acc < alpha                        (too many rejections: draft less)
             gamma         if acc >= alpha and the chain drafted all k tokens
             gamma - eps   otherwise                             (drafts are good: draft more)
    gamma <- b2 * gamma + (1 - b2) * g'

with alpha = 0.9, eps = 0.01, b1 = 0.5, b2 = 0.9, gamma_0 = 0.6 and at most 12 drafts. As in the
reference code, the token whose confidence falls below gamma is still proposed and ends the chain.

What lives how long follows the reference's evaluations (``evaluate_sum.ipynb``, ``evaluate_code.ipynb``): gamma
starts at 0.6 in their adaptive runs and is handed from one prompt to the next (each call starts from the previous
call's final ``th_stop_draft``), while the smoothed acceptance ``acc`` is a local of ``decoding.py``'s generate
function and restarts at 0 on every prompt. Here one drafter instance is one such run: ``start`` resets ``acc``
and keeps gamma (``carry_confidence=false`` restarts gamma from ``confidence`` on every prompt instead).
Like the reference (``decoding.py``), the middle case looks only at the chain's length: a chain
that drafted all k tokens keeps gamma even when its last token fell below gamma, and a chain
cut short by the token budget lowers it like one stopped by gamma. The confidence is the draft's
probability of the token it proposes: its top-1 when greedy, the sampled token's when sampling.

The layers before the first layer with a skipped sublayer (``plan.exact_prefix``) compute exactly
what the full model does, so their KV and hidden states are handed to verification; every row the
draft wrote in deeper layers is rolled back by the engine and rewritten by the verification forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
from infer.drafters.chain import ChainAsk, PlanForward, check_size, draft_chains
from infer.drafters.examples import ExampleModel
from infer.drafters.gate import COLD
from infer.drafters.inputs import draft_dtype, draft_head, draft_quant, draft_runner, given_plan, load_plan, plan_head
from infer.model.plan import check_plan_option
from infer.model.runner import Runner
from layerskip_core.errors import UserError
from layerskip_core.options import check_fields


@dataclass
class SelfSDConfig(DraftVocabOption):
    """Settings of the Self-SD drafter."""

    plan: str | None = None
    """The skip plan (required): the path of a plan JSON made by `layerskip search` or `layerskip plan import` for
    this model (from Python, a ``LayerPlan`` object may be given instead: what the search evaluates). A plan file
    that records its draft head (`layerskip search` writes it) is drafted with that head instead of
    ``draft_vocab``'s."""
    num_draft: int = 12
    """k: most tokens drafted per verification (Self-SD evaluates with 12)."""
    confidence: float = 0.6
    """Stop drafting when the draft's top-1 probability falls below this (Self-SD's initial threshold gamma; 0.6 as
    the reference's adaptive evaluation runs start)."""
    carry_confidence: bool = True
    """Keep the adapted threshold from one generate call to the next, as the reference's evaluations do (only the
    smoothed acceptance restarts per prompt); off = gamma restarts from ``confidence`` on every prompt."""
    adapt_confidence: bool = True
    """Adapt the confidence threshold after every verification (Self-SD §3.3); off = fixed threshold."""
    target_acceptance: float = 0.9
    """alpha: the threshold rises while the smoothed acceptance rate is below this and falls when above."""
    confidence_step: float = 0.01
    """epsilon: size of one threshold adjustment."""
    acceptance_momentum: float = 0.5
    """beta1: smoothing of the acceptance rate that drives the adjustments."""
    confidence_momentum: float = 0.9
    """beta2: smoothing of the threshold itself."""

    def __post_init__(self) -> None:
        check_fields(self, "self_sd")
        super().__post_init__()
        if self.plan:
            check_plan_option(self.plan, "self_sd")  # before any model is loaded
        check_size(self.num_draft, "num-draft")
        if not 0.0 <= self.confidence < 1.0:
            raise UserError(f"confidence must be in [0, 1), got {self.confidence}")
        if not 0.0 < self.target_acceptance <= 1.0:
            raise UserError(f"target-acceptance must be in (0, 1], got {self.target_acceptance}")
        if not 0.0 <= self.confidence_step < 1.0:
            raise UserError(f"confidence-step must be in [0, 1), got {self.confidence_step}")
        for name in ("acceptance_momentum", "confidence_momentum"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UserError(f"{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")


class AdaptiveThreshold:
    """Self-SD's draft-exiting threshold: nudged up when drafts get rejected, down when they pass."""

    def __init__(self, config: SelfSDConfig):
        self.config = config
        self.value = config.confidence
        self.acceptance = 0.0  # smoothed acceptance rate; the reference code starts it at 0
        self.updates = 0
        self.start_value = self.value

    def new_prompt(self) -> None:
        """A new generate call: the smoothed acceptance and the update count restart; gamma is kept unless
        ``carry_confidence`` is off (the reference passes the previous prompt's final gamma on)."""
        self.acceptance = 0.0
        self.updates = 0
        if not self.config.carry_confidence:
            self.value = self.config.confidence
        self.start_value = self.value

    def update(self, accepted: int, drafted: int) -> None:
        c = self.config
        if not c.adapt_confidence or drafted == 0:
            return
        self.acceptance = c.acceptance_momentum * self.acceptance + (1 - c.acceptance_momentum) * accepted / drafted
        if self.acceptance < c.target_acceptance:
            proposal = self.value + c.confidence_step
        elif drafted >= c.num_draft:  # drafts pass and the chain already ran to k: nothing to gain by lowering
            proposal = self.value
        else:  # drafts pass but the chain ended early (threshold or token budget): draft more
            proposal = self.value - c.confidence_step
        value = c.confidence_momentum * self.value + (1 - c.confidence_momentum) * proposal
        self.value = min(max(value, 0.0), 1.0)  # a probability threshold; the reference code does not clamp
        self.updates += 1


@dataclass
class SelfSDStats(DrafterStats):
    """What the Self-SD drafter reports."""

    confidence: float = 0.0
    """The adapted confidence threshold gamma at the end (rounded to 4 places)."""
    confidence_start: float = 0.0
    """gamma at the start of this prompt."""
    threshold_updates: int = 0
    """Threshold adjustments made on this prompt."""
    skip_ratio: float = 0.0
    """Fraction of sublayers the plan skips."""
    exact_layers: int = 0
    """Layers before the plan's first skip (their KV is exact and handed to verification)."""
    draft_vocab: int | None = None
    """Size of the reduced draft vocabulary (None: the full head)."""


class SelfSDDrafter(Drafter):
    """Drafts with a fixed sublayer skip plan, stopping at an adaptive confidence threshold."""

    name = "self_sd"
    Config = SelfSDConfig
    aliases = {"k": "num_draft", "gamma": "confidence"}

    @classmethod
    def examples(cls, model: ExampleModel) -> dict[str, dict]:
        """Drafting under the model's example skip plan (``infer.drafters.examples``)."""
        return {"": {"plan": model.skip_plan, "num_draft": 4}}

    @classmethod
    def check_spec(cls, spec) -> None:
        if spec.plan is None and not spec.config.plan:
            raise UserError("the self_sd drafter needs a plan: --plan PLAN.json (or self_sd:plan=PLAN.json); "
                            "make one with `layerskip search` or `layerskip plan import`")

    @classmethod
    def resolve(cls, spec, runner: Runner, tokenizer=None) -> DraftInputs:
        """The plan (a file made for this model, or an object of its depth) and the draft head: the one the plan
        file records, else ``draft_vocab``'s."""
        if spec.plan is not None:
            return DraftInputs(draft_head(spec, runner, tokenizer), given_plan(spec.plan, runner))
        plan_file = load_plan(spec.config.plan, runner)  # refused unless made for this model (its depth too)
        option = spec.config.draft_dtype
        head = plan_head(runner, plan_file, draft_dtype(option, runner), draft_quant(option, runner)) \
            if plan_file.draft_head else draft_head(spec, runner, tokenizer)
        return DraftInputs(head, plan_file.plan)

    def __init__(self, runner: Runner, config: SelfSDConfig, inputs: DraftInputs):
        self.config = config
        self.plan, self.vocab = inputs.plan, inputs.vocab  # the plan, the draft head (None: the full one)
        # int8 / int4: the plan runs on a quantized copy of the layers over the model's cache, nothing exact
        quant = draft_quant(config.draft_dtype, runner)
        self.forward = PlanForward(draft_runner(config.draft_dtype, runner), self.plan, self.vocab, quant is None)
        self.threshold = AdaptiveThreshold(config)
        self.forwards = 0

    def needs(self) -> Needs:
        return Needs(lookahead=self.config.num_draft + 1)

    def start(self, state: DecodeState) -> None:
        self.threshold.new_prompt()
        self.forwards = 0

    def propose(self, state: DecodeState) -> Draft | None:
        return self.propose_rows([(self, state)])[0]

    @classmethod
    def propose_rows(cls, rows: Sequence[tuple[SelfSDDrafter, DecodeState]]) -> list[Draft | None]:
        """The rows' chains under the one plan together (one packed draft forward per step), each stopping at its
        own sequence's threshold."""
        # Like Self-SD, the token whose confidence falls below the threshold is still proposed
        # (one more verified row costs far less than the draft forward already spent) and ends the chain.
        asks = [ChainAsk(state, d.forward, d.config.num_draft, d.threshold.value, keep_last=True) for d, state in rows]
        drafts: list[Draft | None] = []
        for (drafter, _), chain in zip(rows, draft_chains(asks), strict=True):
            drafter.forwards += chain.forwards
            drafts.append(chain.draft if chain.forwards else None)
        return drafts

    def update(self, state: DecodeState, outcome: VerifyOutcome) -> None:
        self.threshold.update(outcome.accepted, outcome.drafted)

    def finish(self) -> None:
        """Nothing to save: the plan is fixed."""

    def stats(self) -> SelfSDStats:
        return SelfSDStats(self.forwards, COLD, round(self.threshold.value, 4), round(self.threshold.start_value, 4),
                           self.threshold.updates, self.plan.skip_ratio, self.forward.exact_layers,
                           None if self.vocab is None else self.vocab.size)

