"""LayerSkip early-exit drafting: layers [0, E) + final norm + shared LM head, token by token.

With an exit adapter (``adapter=PATH``, ``infer.assets.adapter``) the drafts run layers [0, E), the adapter and the
shared head instead; E is the adapter's. The adapter's own cache follows the accepted tokens.

The draft's KV for layers < E and its hidden states at layer E are exactly what the full
model computes, so verification runs only layers >= E for the drafted positions (plus
layers < E for the last drafted token, which no draft pass has seen).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from infer.assets.adapter import AdapterForward, ExitAdapter, adapter_path, trained_vocab_size, vocab_note
from infer.drafters.base import (
    WHOLE_PROMPT,
    DecodeState,
    Draft,
    Drafter,
    DrafterStats,
    DraftInputs,
    DraftVocabOption,
    Needs,
    VerifyOutcome,
)
from infer.drafters.chain import ChainAsk, EarlyExitForward, check_size, draft_chains
from infer.drafters.costs import CostsOption
from infer.drafters.examples import ExampleModel
from infer.drafters.gate import COLD, GateOwner, RememberOption
from infer.drafters.inputs import draft_dtype, draft_head, draft_quant, draft_runner
from infer.drafters.prefix_copy import CopiedPrefixForward
from infer.drafters.shadow import ExitShadow
from infer.drafters.tree import TreeOption, chain_rows_kept, chain_tree
from infer.model.quant_weights import QUANT_DTYPES
from layerskip_core.draft_vocab import AUTO
from layerskip_core.errors import UserError
from layerskip_core.layers import check_exit_layer
from layerskip_core.options import check_fields


@dataclass
class EarlyExitDrafterConfig(DraftVocabOption, RememberOption, TreeOption, CostsOption):
    """Settings of the early-exit drafter."""

    exit_layer: int = 8
    """E: draft with decoder layers [0, E), then the final norm and LM head (1 <= E <= L); with an adapter, the
    adapter's E (leave it unset or give the same: any other is refused)."""
    num_draft: int = 6
    """k: most tokens drafted per verification."""
    confidence: float = 0.0
    """Stop drafting when the draft's top-1 probability falls below this (0 = always draft k)."""
    keep_last: bool = False
    """With confidence: propose the token that fell below it too, and end the chain after it (Kangaroo's rule: its
    forward is already paid, and one more verified row costs less than a cycle it might save); off: drop it."""
    adaptive: bool = False
    """Beyond LayerSkip: draft only while draft-verify cycles measure faster than plain steps; otherwise take
    plain steps and probe drafting again later, so an exit that does not pay costs little (state persists
    across the prompts a drafter instance decodes). Without an adapter it also watches the exit on plain steps
    (its shadow drafts' acceptance) and probes only where that and this model's costs predict drafting pays
    (infer.drafters.shadow)."""
    recheck_interval: int = 128
    """With adaptive: plain steps before drafting is probed again (doubling after each failed probe)."""
    watch: bool = True
    """With adaptive, no adapter and a float draft: score the exit's draft on plain steps (a draft-head row per
    observed step, within 1% of the decoding time) and probe drafting only where that acceptance and this model's
    costs predict it pays; off: probe on the gate's schedule whatever the exit's acceptance."""
    remember: str = "on"
    """With adaptive, what the gate measured (plain and drafting speed, its mode and back-off), kept in the toolkit
    cache per model, device, dtype, threads and these settings: on = start from it and save it (``finish``), read =
    start from it without changing it, off = start cold and save nothing."""

    adapter: str | None = None
    """An exit adapter trained on the frozen model (a file from train/layerskip.py's adapter: runs, or 'default':
    the one shipped for the default model): drafts run layers [0, E), the adapter and the shared head."""
    prefix: str = AUTO
    """Layers [0, E) of a draft: shared = the model's own, whose KV and exit states verification reuses (LayerSkip);
    copy = a copy of them in draft-dtype with its own KV cache (E/L of the weights again, in that precision), so a
    draft reads fewer bytes where draft-dtype is narrower than the model's, and verification runs layers [0, E)
    over the drafted tokens as well (infer.drafters.prefix_copy); shared_kv = (draft-dtype int8 or int4, no adapter)
    a quantized copy that attends over the model's own KV cache: the history it reads is the model's exact rows, its
    draft rows are rolled back by verification, which runs every layer over the drafted tokens (no second cache, no
    prefill of the copy); auto = shared_kv for int8 / int4 without an adapter, copy with an exit adapter where
    draft-dtype is narrower than the model's (an adapter's shallow exit: a small copy, most of a draft's cost; int8
    and int4 included), else shared. The output is the model's either way."""

    DRAFTER: ClassVar[str] = "early_exit"

    def __post_init__(self) -> None:
        check_fields(self, self.DRAFTER)
        DraftVocabOption.__post_init__(self)
        RememberOption.__post_init__(self)
        TreeOption.__post_init__(self)
        CostsOption.__post_init__(self)
        check_size(self.num_draft, "num-draft")
        if self.recheck_interval < 1:
            raise UserError(f"recheck-interval must be >= 1, got {self.recheck_interval}")
        if not 0.0 <= self.confidence < 1.0:
            raise UserError(f"confidence must be in [0, 1), got {self.confidence}")
        if self.prefix not in PREFIXES:
            raise UserError(f"prefix must be one of {', '.join(PREFIXES)}, got {self.prefix!r}")
        if self.prefix == SHARED_KV and (self.draft_dtype not in QUANT_DTYPES or self.adapter is not None):
            raise UserError(f"prefix={SHARED_KV} runs a quantized copy of layers [0, E) over the model's KV cache: it "
                            "needs draft-dtype int8 or int4 and no adapter (with an adapter use prefix=copy)")


SHARED_KV = "shared_kv"
PREFIXES = (AUTO, "shared", "copy", SHARED_KV)
"""The values of ``EarlyExitDrafterConfig.prefix``."""


@dataclass
class EarlyExitStats(DrafterStats):
    """What the early-exit drafter reports."""

    plain_steps: int = 0
    """Plain (undrafted) steps the adaptive gate took."""
    draft_vocab: int | None = None
    """Size of the reduced draft vocabulary (None: the full head)."""
    adapter_exit: int | None = None
    """The exit adapter's E (None: no adapter)."""
    mode: str | None = None
    """With adaptive: the gate's mode at the end ('draft' or 'plain')."""
    tps_plain: float | None = None
    """With adaptive: measured tokens/s of plain steps."""
    tps_draft: float | None = None
    """With adaptive: measured tokens/s of draft-verify cycles."""


class EarlyExitDrafter(GateOwner, Drafter):
    name = "early_exit"
    Config = EarlyExitDrafterConfig
    aliases = {"E": "exit_layer", "k": "num_draft"}
    WARM_UP = {"remember": "off"}

    @classmethod
    def examples(cls, model: ExampleModel) -> dict[str, dict]:
        """A chain and a token tree from the model's exit (``infer.drafters.examples``), and both through its exit
        adapter where it has one."""
        out = {"": {"exit_layer": model.exit, "num_draft": 3},
               "tree": {"exit_layer": model.exit, "num_draft": 4, "tree": True, "max_tree_nodes": 6}}
        if model.adapter is not None:
            out |= {"adapter": {"adapter": model.adapter, "num_draft": 3},
                    "adapter_tree": {"adapter": model.adapter, "num_draft": 3, "tree": True, "max_tree_nodes": 8}}
        return out

    @classmethod
    def resolve(cls, spec, runner, tokenizer=None) -> DraftInputs:
        """The draft head and, with ``adapter``, the exit adapter (its E checked against ``exit_layer``)."""
        config = spec.config
        adapter = None if config.adapter is None else \
            ExitAdapter.load(adapter_path(config.adapter, runner), runner, draft_dtype(config.draft_dtype, runner),
                             draft_quant(config.draft_dtype, runner))
        if adapter is not None and "exit_layer" in spec.given and config.exit_layer != adapter.exit_layer:
            raise UserError(f"the adapter was trained at exit layer {adapter.exit_layer}; drop --exit-layer "
                            f"{config.exit_layer} or give {adapter.exit_layer}")
        if adapter is None:
            check_exit_layer(runner.num_layers if config.exit_layer is None else config.exit_layer, runner.num_layers)
        vocab = draft_head(spec, runner, tokenizer, auto=None if adapter is None else trained_vocab_size(adapter))
        note = None if adapter is None else vocab_note(adapter, vocab)
        if note:
            print(note, file=sys.stderr)
        return DraftInputs(vocab=vocab, adapter=adapter)

    def __init__(self, runner, config: EarlyExitDrafterConfig, inputs: DraftInputs):
        self.config = config
        self.adapter, self.vocab = inputs.adapter, inputs.vocab  # the adapter, the draft head: None or given
        exit_layer = self.adapter.exit_layer if self.adapter is not None else \
            runner.num_layers if config.exit_layer is None else config.exit_layer
        dtype, quant = draft_dtype(config.draft_dtype, runner), draft_quant(config.draft_dtype, runner)
        if config.prefix == SHARED_KV or (config.prefix == AUTO and quant is not None and self.adapter is None):
            self.forward = EarlyExitForward(draft_runner(config.draft_dtype, runner, exit_layer), exit_layer,
                                            self.vocab, exact=False)
        elif config.prefix == "copy" or (config.prefix == AUTO and self.adapter is not None
                                         and (quant is not None or dtype.itemsize < runner.dtype.itemsize)):
            self.forward = CopiedPrefixForward(runner, exit_layer, dtype, self.adapter, self.vocab, quant)
        elif self.adapter is None:
            self.forward = EarlyExitForward(runner, exit_layer, self.vocab)
        else:
            self.forward = AdapterForward(runner, self.adapter, self.vocab)
        self.own_caches = not isinstance(self.forward, EarlyExitForward)
        """The draft forward keeps caches of its own (the adapter's, the copied prefix's), following the tokens."""
        self.init_gate(runner, self.config)
        self.shadow = None  # the exit's acceptance seen on plain steps: the adaptive gate's prediction
        watchable = not self.own_caches and quant is None and exit_layer < runner.num_layers  # a float exit's stream
        if config.adaptive and config.watch and watchable:  # (a quantized draft's differs from the model's at E)
            self.shadow = ExitShadow(runner, exit_layer, self.vocab, config.num_draft, config.costs == "measured")
            try:
                if "shadow" in self.remembered:
                    self.shadow.load(self.remembered["shadow"])
            except (KeyError, TypeError, ValueError):  # checked when the memory was read: not expected
                pass
        self.forwards = self.plain_steps = 0
        self._cycle_start: float | None = None

    def needs(self) -> Needs:
        c = self.config
        lookahead = c.most_nodes(c.num_draft) + 1
        if self.adapter is None:
            return Needs(lookahead=lookahead)
        # the prefill keeps the prompt's stream entering the adapter's exit, which fills the adapter's cache (and, with
        # a copied prefix, the copy takes the model's keys and values: ``CopiedPrefixForward.fill``)
        return Needs(lookahead=lookahead, prompt_layers=(self.adapter.exit_layer,), prompt_rows=WHOLE_PROMPT)

    def start(self, state: DecodeState) -> None:
        self.forwards = self.plain_steps = 0
        self._cycle_start = None
        if self.own_caches:
            # (P, d): the prompt's stream entering an adapter's exit, kept by the prefill where ``needs`` asked for it
            kept = None if self.adapter is None else (state.prompt_observed or {}).get(self.adapter.exit_layer)
            self.forward.start(state.cache, state.tokens[:state.n], kept)

    def propose(self, state: DecodeState) -> Draft | None:
        return self.propose_rows([(self, state)])[0]

    def begin_cycle(self) -> bool:
        """Start this cycle's clock (the adaptive gate weighs its time); whether this sequence drafts in it."""
        if not self.config.adaptive:
            return True
        self._cycle_start = time.perf_counter()
        return self.gate.mode != "plain"

    @classmethod
    def propose_rows(cls, rows: Sequence[tuple[EarlyExitDrafter, DecodeState]]) -> list[Draft | None]:
        """Each row's gate and adapter catch-up on its own, then the drafting rows' chains together (one packed
        draft forward per step, each chain with its own confidence stop); with ``tree``, each chain grows into its
        token tree (``infer.drafters.tree``)."""
        asks, drafting = [], []
        drafts: list[Draft | None] = [None] * len(rows)
        for j, (drafter, state) in enumerate(rows):
            if not drafter.begin_cycle():
                drafts[j] = drafter.plain_draft()
                continue
            if drafter.own_caches:
                drafter.forward.catch_up(state.cache, state.tokens, state.n)
            c = drafter.config
            asks.append(ChainAsk(state, drafter.forward, c.chain_depth(c.num_draft), c.confidence, c.keep_last))
            drafting.append(j)
        trees = any(rows[j][0].config.tree for j in drafting)
        for j, chain in zip(drafting, draft_chains(asks, keep_dists=trees), strict=True):
            drafter, state = rows[j]
            drafter.forwards += chain.forwards
            if chain.forwards:
                c = drafter.config
                drafts[j] = chain_tree(chain, state, c.max_tree_nodes) if c.tree else chain.draft
        return drafts

    def skip(self, state: DecodeState) -> Draft | None:
        self._cycle_start = None  # the caller's plain step: not timed as this gate's (``update`` counts it)
        return None

    def plain_draft(self) -> Draft | None:
        """A plain step: one that keeps the stream entering the exit for the shadow estimate when it wants one."""
        return Draft.plain((self.forward.exact_layers,)) if self.shadow is not None and self.shadow.wants() else None

    def kept_state(self) -> dict:
        return {} if self.shadow is None else {"shadow": self.shadow.to_dict()}

    def update(self, state: DecodeState, outcome: VerifyOutcome) -> None:
        if not outcome.drafted:
            self.plain_steps += 1
        if self.own_caches:
            hidden, draft = outcome.exit_hidden, outcome.draft
            if hidden is not None and draft is not None and draft.parents is not None:
                hidden = hidden[outcome.path]  # (len(path), d): the accepted path's rows, in sequence order
            self.forward.accept(outcome.start, hidden, state.n, outcome.start + chain_rows_kept(outcome))
        if self._cycle_start is not None:  # set by propose only when adaptive
            seconds = time.perf_counter() - self._cycle_start
            self.gate.record(len(outcome.tokens), seconds, drafted=outcome.drafted > 0)
            self.gate.decide(None if self.shadow is None else self._watch(outcome, seconds))

    def _watch(self, outcome: VerifyOutcome, seconds: float) -> float:
        """Count what this cycle shows of the exit's acceptance (an observed plain step, or a drafted chain) into the
        shadow estimate; its predicted speed-up."""
        shadow, exit_layer = self.shadow, self.forward.exact_layers
        shadow.decode_seconds += seconds
        if outcome.drafted and outcome.draft.parents is None:  # a chain (a tree's acceptance is not per token)
            shadow.learn_drafted(outcome.accepted, outcome.drafted)
        elif not outcome.drafted and exit_layer in outcome.observed:
            shadow.learn(outcome.observed[exit_layer][outcome.path], outcome.tokens)
        return shadow.predicted()

    def stats(self) -> EarlyExitStats:
        stats = EarlyExitStats(self.forwards, COLD if self.memory is None else self.memory.start_state,
                               self.plain_steps, None if self.vocab is None else self.vocab.size,
                               None if self.adapter is None else self.adapter.exit_layer)
        if self.config.adaptive:
            stats.mode, stats.tps_plain, stats.tps_draft = self.gate.mode, self.gate.plain.value, \
                self.gate.drafting.value
        return stats


@dataclass
class QuantSelfConfig(EarlyExitDrafterConfig):
    """Settings of the quantized self-draft (ML-SpecQD's baseline): early exit at the model's depth on its own
    int4 (or int8) copy; every early_exit option applies."""

    exit_layer: int | None = None
    """E: draft with layers [0, E) of the quantized copy, then the final norm and the draft head (1 <= E <= L);
    default the model's depth L: the whole model, quantized."""
    draft_dtype: str = "int4"
    """The copy's weights: int4 (layers in groups of 64, the draft head int8) or int8."""

    DRAFTER: ClassVar[str] = "quant_self"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.draft_dtype not in QUANT_DTYPES:
            raise UserError(f"quant_self drafts with a quantized copy of the model: draft-dtype int8 or int4, not "
                            f"{self.draft_dtype!r} (for float drafts use early_exit)")
        if self.adapter is not None:
            raise UserError("quant_self drafts with the model's own quantized layers, not an exit adapter: use "
                            "early_exit:adapter=...:draft_dtype=int4")


class QuantSelfDrafter(EarlyExitDrafter):
    """The model's own quantized copy as its drafter: ``early_exit`` at E = L with draft-dtype int4 (the same code;
    ``--drafter early_exit --exit-layer L --draft-dtype int4`` runs the same drafts)."""

    name = "quant_self"
    Config = QuantSelfConfig

    @classmethod
    def examples(cls, model: ExampleModel) -> dict[str, dict]:
        """The quantized copy's layers up to the model's exit, over the model's cache and with a cache of its own
        (``infer.drafters.examples``), in int8: its rows fit every width (int4's groups of 64 do not divide some small
        models' widths, which it refuses). They stop at the exit: a tiny model's whole int8 copy agrees with it on
        ~99.8% of sampled tokens, too few rejections for a test of sampling to exercise the rejection path; the whole
        copy runs in tests/infer/test_quant_draft.py (int8 and int4) and the sampling matrix's int4 case."""
        return {"": {"draft_dtype": "int8", "exit_layer": model.exit, "num_draft": 3},
                "copy": {"draft_dtype": "int8", "exit_layer": model.exit, "prefix": "copy", "num_draft": 3}}
