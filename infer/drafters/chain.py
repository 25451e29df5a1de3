"""Token-by-token chain drafting, shared by every drafter that drafts with part of the model.

A *draft forward* runs one token through a cheap version of the model and returns the hidden
state at the end of its exact prefix (the first layers that skip nothing) and the draft logits.
The chain loop around it handles greedy/sampled proposals and confidence-based stopping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from infer.drafters.base import DecodeState, Draft
from infer.model.kv_cache import KVCache, ints_to_device
from infer.model.plan import LayerPlan
from infer.model.program import Program, Rows, Segment
from infer.model.runner import DraftHead, Runner
from infer.model.sampling import probs_from_logits, sample
from layerskip_core.errors import UserError

MAX_DRAFT = 256
"""Most draft tokens (a chain's k, a tree's nodes) one verification may check: far beyond where drafting pays, and
every one of them is cache room reserved per sequence (k = 100000 took 7 GB)."""


def check_size(value: int, what: str) -> None:
    """Refuse a draft size (``num-draft``, ``max-tree-nodes``) outside 1..``MAX_DRAFT``."""
    if not 1 <= value <= MAX_DRAFT:
        raise UserError(f"{what} must be between 1 and {MAX_DRAFT} (draft tokens per verification), got {value}")


def one_per_row(caches: list[KVCache], hidden: Tensor, positions: list[int]) -> Rows:
    """R sequences' rows (R, d), one each, at ``positions`` in their own ``caches``, as packed rows."""
    return Rows(hidden, [Segment(cache, [p]) for cache, p in zip(caches, positions, strict=True)])


class EarlyExitForward:
    """Layers [0, E) then the final norm and LM head (LayerSkip); all of it is exact.

    ``vocab``: a reduced-vocabulary draft head (logits -inf outside its ids). ``exact`` False: ``runner`` is a
    quantized copy of the model's layers (``infer.model.quant_weights.quantized``) run over the model's own cache:
    its draft rows are the model's layout and dtype, none of them exact (``exact_layers`` 0: verification rolls them
    back and runs every layer over the drafted tokens), while each draft attends over the model's exact history."""

    def __init__(self, runner: Runner, exit_layer: int, vocab: DraftHead | None = None, exact: bool = True):
        self.runner, self.exact_layers, self.vocab = runner, exit_layer if exact else 0, vocab
        self.exit_layer = exit_layer
        self.program = Program(0, exit_layer, logits=True, vocab=vocab)

    def __call__(self, cache: KVCache, token: Tensor, position: int) -> tuple[Tensor, Tensor]:
        r = self.runner
        out = r.run(self.program, Rows.one(cache, r.embed(token), [position]))
        return out.hidden, out.logits  # (1, d), (1, V)

    def rows(self, forwards: list, caches: list[KVCache], tokens: Tensor,
             positions: list[int]) -> tuple[Tensor, Tensor]:
        """The forward of R sequences' tokens (R,) at once, each at its position in its own cache, as packed rows
        (``forwards``: each sequence's forward, all alike): (R, d), (R, V)."""
        r = self.runner
        out = r.run(self.program, one_per_row(caches, r.embed(tokens), positions))
        return out.hidden, out.logits


class ObservingForward(EarlyExitForward):
    """Early exit at E that also keeps the stream entering each observed layer below E (dynamic_exit's observations)."""

    def __init__(self, runner, exit_layer: int, layers: list[int], vocab=None, exact: bool = True):
        super().__init__(runner, exit_layer, vocab, exact)
        self.layers = [x for x in layers if x < exit_layer]
        self.kept: dict[int, list[Tensor]] = {x: [] for x in self.layers}
        self.program = Program(0, exit_layer, observe=tuple(self.layers), logits=True, vocab=vocab)

    def __call__(self, cache, token: Tensor, position: int) -> tuple[Tensor, Tensor]:
        r = self.runner
        out = r.run(self.program, Rows.one(cache, r.embed(token), [position]))
        for x in self.layers:
            self.kept[x].append(out.observed[x])  # (1, d)
        return out.hidden, out.logits  # (1, d), (1, V)

    def rows(self, forwards: list, caches: list, tokens: Tensor, positions: list[int]) -> tuple[Tensor, Tensor]:
        """The forward of R sequences' tokens (R,) at once as packed rows (a batch; ``forwards``: each sequence's
        own, alike), each keeping its row at every observed layer: (R, d), (R, V)."""
        r = self.runner
        out = r.run(self.program, one_per_row(caches, r.embed(tokens), positions))
        for x in self.layers:
            for forward, row in zip(forwards, out.observed[x].split(1), strict=True):
                forward.kept[x].append(row)  # (1, d)
        return out.hidden, out.logits  # (R, d), (R, V)

    def observed(self) -> dict[int, Tensor]:
        """(h, d) rows per observed layer below E, for the h draft forwards run."""
        return {x: torch.cat(rows) for x, rows in self.kept.items() if rows}


class PlanForward:
    """All layers under a sublayer skip plan; the layers before the first layer with a skip are exact.

    ``vocab``: a reduced-vocabulary draft head (logits -inf outside its ids). ``exact`` False: ``runner`` is a
    quantized copy over the model's cache, nothing exact (``EarlyExitForward``)."""

    def __init__(self, runner: Runner, plan: LayerPlan, vocab: DraftHead | None = None, exact: bool = True):
        self.runner, self.plan, self.vocab = runner, plan, vocab
        self.exact_layers = plan.exact_prefix if exact else 0
        self.program = Program(0, runner.num_layers, plan.exact_prefix, plan, logits=True, vocab=vocab)

    def __call__(self, cache: KVCache, token: Tensor, position: int) -> tuple[Tensor, Tensor]:
        r = self.runner
        out = r.run(self.program, Rows.one(cache, r.embed(token), [position]))
        return out.exact, out.logits  # (1, d), (1, V)

    def rows(self, forwards: list, caches: list[KVCache], tokens: Tensor,
             positions: list[int]) -> tuple[Tensor, Tensor]:
        """The forward of R sequences' tokens (R,) at once under the plan, as packed rows (``forwards``: each
        sequence's forward, all alike): (R, d) exact streams, (R, V) logits."""
        r = self.runner
        out = r.run(self.program, one_per_row(caches, r.embed(tokens), positions))
        return out.exact, out.logits


@dataclass
class ChainResult:
    draft: Draft
    """The proposed chain (possibly empty, still carrying the exact hidden states it computed)."""
    dists: list[Tensor] = field(default_factory=list)
    """(1, V) distribution each drafted position was chosen from (softmax, or the sampling q); kept only when
    asked for (``keep_dists``) or when sampling."""
    confidence: list[float] = field(default_factory=list)
    """Draft confidence at every forward (including the one that stopped the chain), read on the host only when
    a threshold needed it: the draft's softmax probability of the token it chose there (the top-1 probability
    when greedy; when sampling, the sampled token's for a chain that keeps its last token, as SWIFT's and Self-SD's
    code do, else the top-1 probability: see ``draft_chains``). Empty otherwise."""
    forwards: int = 0
    stopped: bool = False
    """The last forward fell below the confidence threshold (rather than the length cap ending the chain)."""
    eos: bool = False
    """The chain ended because it drafted an end-of-sequence token (proposed as its last token)."""


@dataclass
class ChainAsk:
    """One sequence's request for a draft chain (``draft_chains``)."""

    state: DecodeState
    forward: object
    """The sequence's draft forward (``EarlyExitForward``, ``PlanForward``, ``AdapterForward``): called on one row,
    or through its ``rows`` on the packed rows of every sequence still drafting."""
    max_draft: int
    """k: most tokens to draft."""
    confidence: float = 0.0
    """Stop at the first token whose draft probability is under this (0: no threshold, no host read)."""
    keep_last: bool = False
    """Propose that token too, and end the chain after it (``draft_chains``); else it is dropped."""


@dataclass
class _Chain:
    """A chain being drafted: what ``draft_chains`` keeps per sequence."""

    ask: ChainAsk
    k: int
    token: Tensor
    hiddens: list[Tensor] = field(default_factory=list)
    tokens: list[Tensor] = field(default_factory=list)
    dists: list[Tensor] = field(default_factory=list)
    conf: list[float] = field(default_factory=list)
    q: Tensor | None = None
    """(1, V) distribution the last token was chosen from, when kept."""
    stop: bool = False
    at_eos: bool = False
    done: bool = False


def draft_chain(state: DecodeState, forward, max_draft: int, confidence: float = 0.0,
                keep_last: bool = False, keep_dists: bool = False) -> ChainResult:
    """Draft up to ``max_draft`` tokens after the pending one, stopping where the draft's confidence is under
    ``confidence`` (the token there proposed only with ``keep_last``) or at EOS: ``draft_chains`` of one sequence."""
    return draft_chains([ChainAsk(state, forward, max_draft, confidence, keep_last)], keep_dists)[0]


def most_drafts(state: DecodeState, limit: int) -> int:
    """Most tokens a draft may hold this cycle: ``limit`` (the drafter's), within the token budget (a bonus token
    follows) and the caller's cap (``DecodeState.draft_cap``)."""
    cap = limit if state.draft_cap is None else state.draft_cap
    return min(limit, state.budget - 1, cap)


def draft_chains(asks: list[ChainAsk], keep_dists: bool = False) -> list[ChainResult]:
    """A draft chain for every sequence of ``asks``, drafted together: each step runs one draft forward over the
    packed rows of the sequences still drafting (one sequence: its own forward), and each chain stops on its own.

    Only chains with a threshold read the host (once per step for all of them, tokens and confidences together);
    without one a chain cannot see an EOS early and drafts all k tokens, and the engine cuts the output at the first
    accepted EOS.

    The stop keeps sampling exact. Speculative sampling accepts a proposed x with min(1, p(x)/q(x)), which is right
    only if x was drawn from q. With ``keep_last`` the token that fell below the threshold is proposed and the chain
    ends after it: whether the chain goes on depends on tokens already proposed, never on which tokens get proposed,
    so the stop may look at the sampled token's probability (SWIFT's and Self-SD's rule). Without ``keep_last`` the
    low-confidence token is dropped, and dropping a sampled x because q(x) is small would propose x from q restricted
    to its likely tokens (the output then over-weights them). There the stop is decided on the draft's top-1
    probability, a quantity fixed before the draw: the chain stops before proposing anything at that position, and
    a token it does propose is an unconditioned draw from q. Greedy drafts are deterministic (q is one-hot), and the
    top-1 probability is the chosen token's: both rules are the same there.
    """
    chains = [_Chain(a, most_drafts(a.state, a.max_draft), ints_to_device([a.state.pending], a.state.runner.device))
              for a in asks]  # each token (1,) via pinned memory on CUDA: no host sync
    active, step = [c for c in chains if c.k > 0], 0
    while active:
        outs = _chain_forwards(active, step)
        reads = []
        for c, (exact, logits) in zip(active, outs, strict=True):  # (1, d), (1, V)
            c.hiddens.append(exact)
            read, keep = c.ask.confidence > 0, keep_dists or not c.ask.state.sampling.greedy
            c.token, c.q, p_token = _next_token(logits, c.ask.state, need_p=read, keep_dists=keep,
                                                top1=not c.ask.keep_last)
            if read:
                reads.append(torch.cat([p_token.double(), c.token.double()]))  # (2,)
        host = torch.cat(reads).tolist() if reads else []  # the step's one sync, for every chain with a threshold
        for c in active:
            if c.ask.confidence > 0:
                p_host, token_host = host[:2]
                host = host[2:]
                c.conf.append(p_host)
                c.stop, c.at_eos = p_host < c.ask.confidence, int(token_host) in c.ask.state.eos
            c.done = c.stop or c.at_eos or len(c.hiddens) >= c.k
            if c.stop and not c.ask.keep_last:
                continue
            c.tokens.append(c.token)
            if c.q is not None:
                c.dists.append(c.q)
        active, step = [c for c in active if not c.done], step + 1
    return [_chain_result(c) for c in chains]


def _chain_forwards(active: list[_Chain], step: int) -> list[tuple[Tensor, Tensor]]:
    """Each active chain's draft forward at its ``step``-th position: (exact (1, d), logits (1, V)) per chain."""
    if len(active) == 1:
        c = active[0]
        return [c.ask.forward(c.ask.state.cache, c.token, c.ask.state.n + step)]
    groups: dict[tuple, list[int]] = {}  # chains whose forwards run the same layers, packed together
    for i, c in enumerate(active):
        groups.setdefault(_pack_key(c.ask.forward), []).append(i)
    outs: list[tuple[Tensor, Tensor] | None] = [None] * len(active)
    for members in groups.values():
        group = [active[i] for i in members]
        exact, logits = group[0].ask.forward.rows([c.ask.forward for c in group], [c.ask.state.cache for c in group],
                                                  torch.cat([c.token for c in group]),
                                                  [c.ask.state.n + step for c in group])  # (R, d), (R, V)
        for i, row in zip(members, zip(exact.split(1), logits.split(1), strict=True), strict=True):
            outs[i] = row
    return outs


def _pack_key(forward) -> tuple:
    """What must be alike for draft forwards to run as packed rows: their kind, exit, runner (the model's or a
    quantized copy), head, plan, observed layers, adapter, copied prefix (rows of one batch may draft from different
    exits: a dynamic exit's)."""
    return (type(forward), forward.exact_layers, getattr(forward, "exit_layer", None),
            id(getattr(forward, "runner", None)), id(getattr(forward, "vocab", None)),
            id(getattr(forward, "plan", None)), tuple(getattr(forward, "layers", ())),
            id(getattr(forward, "adapter", None)), id(getattr(forward, "prefix", None)))


def _chain_result(c: _Chain) -> ChainResult:
    state, device = c.ask.state, c.ask.state.runner.device
    if not c.hiddens:
        return ChainResult(Draft(torch.empty(0, dtype=torch.long)))
    greedy = state.sampling.greedy
    draft = Draft(tokens=torch.cat(c.tokens) if c.tokens else torch.empty(0, dtype=torch.long, device=device),
                  q=None if greedy or not c.dists else torch.cat(c.dists), exact_layers=c.ask.forward.exact_layers,
                  hidden=torch.cat(c.hiddens))
    return ChainResult(draft, c.dists, c.conf, len(c.hiddens), c.stop, c.at_eos and not c.stop)


def _next_token(logits: Tensor, state: DecodeState, need_p: bool, keep_dists: bool,
                top1: bool = True) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(token (1,), q (1, V) or None, draft confidence (1,) or None), all on the device.

    Greedy takes the argmax of the logits (no softmax unless its probability or distribution is needed);
    sampling draws from the processed distribution q. The confidence is a raw softmax probability: the top-1
    (``top1``, or greedy, where it is the chosen token's), else the drawn token's (see ``draft_chains``).
    """
    if state.sampling.greedy:
        token = logits.argmax(-1)  # (1,)
        if not (need_p or keep_dists):
            return token, None, None
        soft = torch.softmax(logits, -1)  # (1, V)
        p = soft.gather(-1, token[:, None])[:, 0] if need_p else None  # (1,)
        return token, soft if keep_dists else None, p
    q = probs_from_logits(logits, state.sampling)  # (1, V)
    token = sample(q, state.generator)  # (1,)
    if not need_p:
        return token, q, None
    soft = torch.softmax(logits, -1)  # (1, V)
    p = soft.amax(-1) if top1 else soft.gather(-1, token[:, None])[:, 0]  # (1,)
    return token, q, p
