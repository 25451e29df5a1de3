"""The drafter base class: what every drafter gives the engine and gets back from it."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from infer.assets.adapter import ExitAdapter
from infer.drafters.gate import FallbackGate, HandedOver, hand_over
from infer.model.kv_cache import KVCache, ints_to_device
from infer.model.plan import LayerPlan
from infer.model.runner import DraftHead, Runner
from infer.model.sampling import SamplingConfig
from layerskip_core.draft_vocab import AUTO, check_draft_vocab_option
from layerskip_core.errors import UserError


@dataclass
class Draft:
    """Proposed tokens, as a chain or a tree hanging off the pending token (tree position 0).

    Tree positions 1..m are the drafted nodes in topological order. The drafter also tells the
    engine which cache rows it already computed exactly, so verification skips that work.
    """

    tokens: Tensor
    """(m,) drafted token ids for tree positions 1..m."""
    parents: list[int] | None = None
    """Parent tree position of each drafted node (0 = pending token); None means a chain."""
    q: Tensor | None = None
    """(m, V) draft distribution each node was drawn from (sampling); None = deterministic."""
    exact_layers: int = 0
    """E: cache layers [0, E) already hold exact KV for tree positions [0, h) (h = len(hidden))."""
    hidden: Tensor | None = None
    """(h, d) residual stream at the input of layer E for tree positions [0, h); chain order."""
    observed: dict[int, Tensor] | None = None
    """For the layers in ``observe`` below E: (h, d) residual stream entering layer l for tree positions [0, h), as
    the draft forwards computed it (verification computes the other rows; ``VerifyOutcome.observed``)."""
    observe: tuple[int, ...] = ()
    """Layers l (0 < l < the target's depth) at whose input this cycle's verification keeps the residual stream of
    every verified position (``VerifyOutcome.observed``): its forward is run in pieces split there, the same layers
    on the same rows, so the output is unchanged. What a drafter asks of one cycle travels with its draft."""

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @classmethod
    def plain(cls, observe: tuple[int, ...] = ()) -> Draft | None:
        """A plain step (no drafted token) that still asks for ``observe``; None when it asks for nothing."""
        return cls(torch.empty(0, dtype=torch.long), observe=observe) if observe else None


@dataclass
class VerifyOutcome:
    """What one verification step decided (given to ``Drafter.update``)."""

    draft: Draft | None
    """The draft that was verified (None for a plain autoregressive step)."""
    path: list[int]
    """Tree positions of the accepted path, starting with the pending token (0)."""
    tokens: list[int]
    """Tokens appended to the output by this step: accepted drafts, then the bonus token."""
    start: int
    """Sequence index of the pending token (= cache length before the step)."""
    target_argmax: list[int] = field(default_factory=list)
    """Full model's argmax at each tree position (greedy decoding only)."""
    exit_hidden: Tensor | None = None
    """(T, d) residual stream entering layer ``draft.exact_layers`` at every verified tree position, as verification
    used it (the draft's rows, then those verification computed); None for a plain step or E = 0."""
    observed: dict[int, Tensor] = field(default_factory=dict)
    """(T, d) residual stream entering each of the draft's ``observe`` layers at every verified tree position, as
    the verification forward (split there) and the draft forwards (``Draft.observed``) computed it; a layer < E whose
    draft rows the draft did not give is left out."""

    @property
    def accepted(self) -> int:
        return len(self.path) - 1

    @property
    def drafted(self) -> int:
        return 0 if self.draft is None else self.draft.size


def cut_layers(layers, depth: int) -> tuple[int, ...]:
    """Where a target forward of ``depth`` layers is cut to keep the stream entering ``layers`` (a draft's
    ``observe`` or a drafter's ``Needs.prompt_layers``): the distinct ones strictly inside it, in order. Cutting
    there runs the same layers on the same rows, so the forward's output is unchanged."""
    return tuple(sorted({int(x) for x in layers if 0 < x < depth}))


@dataclass
class DecodeState:
    """The engine's view of one sequence being decoded, shared with the drafter."""

    runner: Runner
    cache: KVCache
    sampling: SamplingConfig
    generator: torch.Generator
    tokens: list[int]
    """Prompt followed by every generated token, including the pending one."""
    prompt_len: int
    n: int = 0
    """tokens[:n] are in the cache (all layers); tokens[n] is the pending token."""
    budget: int = 0
    """How many more tokens may be appended (accepted drafts + bonus) before max_new_tokens."""
    draft_cap: int | None = None
    """Most tokens this cycle's draft may hold, a tree's included (a batch's gate sets it: at B rows a draft of k
    costs a verification of B (k + 1) rows, ``infer.decode.batch_gate``); None: the drafter's own."""
    eos: frozenset[int] = frozenset()
    """Token ids that end the generation (empty when it does not stop at EOS): a draft chain stops after one."""
    depth: int | None = None
    """Layers of the target (the model's count, or a lossy target exit's; None: the model's count)."""
    prompt_observed: dict[int, Tensor] | None = None
    """What the prefill kept for the drafter's ``Needs.prompt_layers``: layer l -> (m, d) stream entering it at the
    prompt's last m positions, and the target's depth -> (m, d) stream after its last layer (before the final
    norm); None when the drafter asked for nothing."""

    def __post_init__(self) -> None:
        if self.depth is None:
            self.depth = getattr(self.runner, "num_layers", None)  # stand-in runners of unit tests may have none

    @property
    def pending(self) -> int:
        return self.tokens[self.n]

    def ids(self, start: int, end: int) -> Tensor:
        """tokens[start:end] as a (end - start,) long tensor on the runner's device (a pinned copy: no host sync)."""
        return ints_to_device(self.tokens[start:end], self.runner.device)


@dataclass(frozen=True)
class Needs:
    """What a drafter asks of a generation beyond its drafts (``Drafter.needs``, read once before the prefill)."""

    lookahead: int = 0
    """Most cache slots past the pending token one ``propose``/``update`` may write."""
    prompt_layers: tuple[int, ...] = ()
    """Layers l (0 < l < the target's depth) at whose input the prefill keeps the residual stream of the prompt's
    last ``prompt_rows`` positions, with the stream after the last layer (``DecodeState.prompt_observed``): for a
    drafter that estimates from the prompt before it drafts. The prefill is run in pieces split there, the same
    layers on the same rows, so the output is unchanged."""
    prompt_rows: int = 0
    """How many of the prompt's last positions ``prompt_layers`` keeps (0: none; ``WHOLE_PROMPT``: all)."""


NO_NEEDS = Needs()
WHOLE_PROMPT = sys.maxsize
"""``Needs.prompt_rows`` that keeps every position of the prompt, however long."""


DRAFT_DTYPES = (AUTO, "model", "fp32", "bf16", "fp16", "int8", "int4")
"""The values of ``DraftVocabOption.draft_dtype``."""


@dataclass
class DraftVocabOption:
    """The option of every drafter that drafts with the LM head (its Config subclasses this)."""

    draft_vocab: str = AUTO
    """Reduced-vocabulary draft head: drafts score only these token ids, verification always the full head (output
    unchanged). auto: the most frequent ids (draft_vocab.AUTO_SIZE of them) of the counts shipped for this
    model, or, for a vocabulary of 32768 ids or more without shipped counts (Gemma 3), of counts built once from
    the model's own generations on built-in prompts and kept in the toolkit cache (coverage printed when built),
    else the full head (with an exit adapter whose head was trained on the top N of those counts: that N); N: the N
    most frequent; a file made by `layerskip draft-vocab`; off: the full head."""
    draft_dtype: str = AUTO
    """Precision of the weights only drafts read: the reduced draft head and (early exit) an exit adapter. auto:
    bf16 where the model runs in fp32 on a CPU whose kernel has native bf16 dot products (AVX512_BF16: half the
    bytes a draft reads there; eager executor), else the model's; model; fp32; bf16; fp16; int8, int4: weight-only
    quantized drafts (a quarter / an eighth of fp32's bytes; activations stay in the model's dtype; CPU only): the
    draft head (int8 under int4) and every layer a draft runs get a quantized copy (early exit's layers [0, E), a
    Self-SD or SWIFT plan's layers, an exit adapter's), so the draft no longer reuses the model's own layers.
    Verification never reads them, so the output is unchanged (drafts may differ). With the full head
    (draft-vocab off) drafts read the model's own head in its dtype (int8, int4: a quantized copy of it)."""

    def __post_init__(self) -> None:
        check_draft_vocab_option(self.draft_vocab)
        if self.draft_dtype not in DRAFT_DTYPES:
            raise UserError(f"draft-dtype must be one of {', '.join(DRAFT_DTYPES)}, got {self.draft_dtype!r}")


@dataclass(frozen=True)
class DraftInputs:
    """What a drafter spec resolves to on a loaded model (``infer.drafters.spec.Spec.resolve``), once: the drafter's
    constructor takes these as they are."""

    vocab: DraftHead | None = None
    """The reduced-vocabulary draft head on the runner, or None for the full head."""
    plan: LayerPlan | None = None
    """The sublayer skip plan to draft with (self_sd), or to start from (swift; None: its own start)."""
    adapter: ExitAdapter | None = None
    """The exit adapter to draft through (early_exit), or None."""


NO_INPUTS = DraftInputs()
"""The inputs of a drafter that needs none (the full head, no plan, no adapter)."""


@dataclass
class DrafterStats:
    """What every drafter reports after a generation (``GenerationStats.drafter``); a drafter with more to say
    reports a subclass. Serialised with the generation's statistics (``GenerationStats.to_dict``)."""

    draft_forwards: int = 0
    """Draft forwards run (a chain's every token, including one a confidence stop did not propose)."""
    start_state: str = "cold"
    """What the drafter started from: 'cold', or the remembered state it read (``infer.drafters.gate``)."""


class Drafter:
    """One way to propose tokens; the engine verifies them losslessly (the model: transformers'
    ``CandidateGenerator``). Subclasses set ``name`` and ``Config``, take ``(runner, config, inputs)`` (the
    ``DraftInputs`` their ``resolve`` made) and override ``propose`` (one sequence) or ``propose_rows`` (several
    at once: the cycle's hook); the other methods default to doing nothing.

    What the decode cycle reads of a drafter: ``needs`` (once, before the prefill), ``start``, ``propose_rows``,
    ``update``, ``stats``, ``finish``, and ``drafts``. What it asks of one cycle (the layers whose streams the
    verification keeps) travels in its ``Draft``.

    A drafter may write anything into the cache beyond ``state.n`` in layers >= its
    ``Draft.exact_layers``: verification rolls those layers back before it writes.
    """

    name: ClassVar[str] = ""
    Config: ClassVar[type] = object
    """The drafter's options: a dataclass with one docstring per field."""
    aliases: ClassVar[dict[str, str]] = {}
    """Short option names of compact specs (``early_exit:E=8:k=6``) -> Config fields."""
    drafts: ClassVar[bool] = True
    """False for a drafter that never proposes (plain decoding): only such a drafter may decode a lossy target."""
    WARM_UP: ClassVar[dict] = {}
    """Config fields set for an untimed run, which must leave no trace (no remembered state read or written, no
    file written)."""
    @classmethod
    def check_spec(cls, spec) -> None:
        """Refuse a spec (``infer.drafters.spec.Spec``) that lacks what this drafter needs, before any model loads."""

    @classmethod
    def resolve(cls, spec, runner: Runner, tokenizer=None) -> DraftInputs:
        """The inputs ``spec`` names, made for ``runner``'s model (``infer.drafters.inputs``)."""
        return DraftInputs()

    def needs(self) -> Needs:
        """What this drafter asks of the next generation beyond its drafts (cache lookahead, prompt streams)."""
        return NO_NEEDS

    def start(self, state: DecodeState) -> None:
        """A new sequence has been prefilled (state.n = prompt length)."""

    def propose(self, state: DecodeState) -> Draft | None:
        """Draft tokens after the pending one, or None for a plain autoregressive step."""
        raise NotImplementedError

    @classmethod
    def propose_rows(cls, rows: Sequence[tuple[Drafter, DecodeState]]) -> list[Draft | None]:
        """Drafts for several sequences at once (the batched engine, ``infer.decode.batch``), each sequence with its own
        drafter of this class (a drafter keeps per-sequence state). By default each row's ``propose`` in turn;
        drafters that draft token by token with part of the model override it to run the rows' draft forwards as
        one packed forward."""
        return [drafter.propose(state) for drafter, state in rows]

    def skip(self, state: DecodeState) -> Draft | None:
        """The caller takes a plain step for this sequence without asking for a draft (a batch's gate chose plain
        steps for every row: ``infer.decode.batch_gate``); what the step asks for (None: nothing). ``update`` then sees
        the plain outcome as usual; a drafter that times its own cycles does not count this one as its own."""
        return None

    def hand_over_gate(self) -> HandedOver | None:
        """From now on a caller's gate chooses this sequence's plain steps (a batch's: one gate for every row,
        measuring the batch's cycles): a drafter with a fallback gate of its own (its ``gate``, what it remembers its
        ``memory``) stops choosing (it drafts whenever asked) and keeps nothing for later commands. Returns what it
        handed over (its memory, beside which the caller may keep its own), or None: it had no enabled gate."""
        return hand_over(self) if isinstance(getattr(self, "gate", None), FallbackGate) else None

    def update(self, state: DecodeState, outcome: VerifyOutcome) -> None:
        """Learn from a verification (the cache now holds state.n exact rows)."""

    def stats(self) -> DrafterStats:
        """This drafter's statistics for the result (e.g. optimisation time); no side effects."""
        return DrafterStats()

    def finish(self) -> None:
        """Decoding with this drafter is over (called once by its owner): save plans or learned state."""
