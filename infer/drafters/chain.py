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
from infer.kv_cache import KVCache, ints_to_device
from infer.plan import LayerPlan
from infer.runner import DraftHead, Runner
from infer.sampling import probs_from_logits, sample
from layerskip_core.errors import UserError

MAX_DRAFT = 256
"""Most draft tokens (a chain's k, a tree's nodes) one verification may check: far beyond where drafting pays, and
every one of them is cache room reserved per sequence (k = 100000 took 7 GB)."""


def check_size(value: int, what: str) -> None:
    """Refuse a draft size (``num-draft``, ``max-tree-nodes``) outside 1..``MAX_DRAFT``."""
    if not 1 <= value <= MAX_DRAFT:
        raise UserError(f"{what} must be between 1 and {MAX_DRAFT} (draft tokens per verification), got {value}")


class EarlyExitForward:
    """Layers [0, E) then the final norm and LM head (LayerSkip); all of it is exact.

    ``vocab``: a reduced-vocabulary draft head (logits -inf outside its ids)."""

    def __init__(self, runner: Runner, exit_layer: int, vocab: DraftHead | None = None):
        self.runner, self.exact_layers, self.vocab = runner, exit_layer, vocab

    def __call__(self, cache: KVCache, token: Tensor, position: int) -> tuple[Tensor, Tensor]:
        r = self.runner
        out = r.span(cache, r.embed(token), [position], 0, self.exact_layers, logits=True, vocab=self.vocab)
        return out.hidden, out.logits  # (1, d), (1, V)


class PlanForward:
    """All layers under a sublayer skip plan; the layers before the first layer with a skip are exact.

    ``vocab``: a reduced-vocabulary draft head (logits -inf outside its ids)."""

    def __init__(self, runner: Runner, plan: LayerPlan, vocab: DraftHead | None = None):
        self.runner, self.plan, self.exact_layers, self.vocab = runner, plan, plan.exact_prefix, vocab

    def __call__(self, cache: KVCache, token: Tensor, position: int) -> tuple[Tensor, Tensor]:
        r = self.runner
        out = r.span(cache, r.embed(token), [position], 0, r.num_layers, exact_until=self.exact_layers,
                     plan=self.plan, logits=True, vocab=self.vocab)
        return out.exact, out.logits  # (1, d), (1, V)


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
    when greedy, the sampled token's when sampling, as SWIFT's and Self-SD's code do). Empty otherwise."""
    forwards: int = 0
    stopped: bool = False
    """The last forward fell below the confidence threshold (rather than the length cap ending the chain)."""
    eos: bool = False
    """The chain ended because it drafted an end-of-sequence token (proposed as its last token)."""


def draft_chain(state: DecodeState, forward, max_draft: int, confidence: float = 0.0,
                keep_last: bool = False, keep_dists: bool = False) -> ChainResult:
    """Draft up to ``max_draft`` tokens after the pending one, stopping at the first token whose probability is
    under ``confidence`` (proposed only with ``keep_last``) or at EOS.

    Only a chain with a threshold reads the host (once per step, token and confidence together); without one it
    cannot see an EOS early and drafts all k tokens, and the engine cuts the output at the first accepted EOS.
    """
    runner = state.runner
    greedy = state.sampling.greedy
    read = confidence > 0  # the host needs each step's confidence now (LayerSkip's and Self-SD's one sync a step)
    keep_dists = keep_dists or not greedy  # sampling: q is what verification accepts against
    k = min(max_draft, state.budget - 1)
    token = ints_to_device([state.pending], runner.device)  # (1,), via pinned memory on CUDA: no host sync
    hiddens, tokens, dists, conf = [], [], [], []
    stop = at_eos = False
    for i in range(max(k, 0)):
        exact, logits = forward(state.cache, token, state.n + i)  # (1, d), (1, V)
        hiddens.append(exact)
        token, q, p_token = _next_token(logits, state, need_p=read, keep_dists=keep_dists)
        if read:
            p_host, token_host = torch.cat([p_token.double(), token.double()]).tolist()  # the step's one sync
            conf.append(p_host)
            stop = p_host < confidence
            at_eos = int(token_host) in state.eos
        if stop and not keep_last:
            break
        tokens.append(token)
        if keep_dists:
            dists.append(q)
        if stop or at_eos:
            break
    if not hiddens:
        return ChainResult(Draft(torch.empty(0, dtype=torch.long)))
    draft = Draft(tokens=torch.cat(tokens) if tokens else torch.empty(0, dtype=torch.long, device=runner.device),
                  q=None if greedy or not dists else torch.cat(dists), exact_layers=forward.exact_layers,
                  hidden=torch.cat(hiddens))
    return ChainResult(draft, dists, conf, len(hiddens), stop, at_eos and not stop)


def _next_token(logits: Tensor, state: DecodeState, need_p: bool,
                keep_dists: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(token (1,), q (1, V) or None, draft probability of the token (1,) or None), all on the device.

    Greedy takes the argmax of the logits (no softmax unless its probability or distribution is needed);
    sampling draws from the processed distribution q, and the confidence is the raw softmax probability of
    the drawn token.
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
    p = torch.softmax(logits, -1).gather(-1, token[:, None])[:, 0] if need_p else None  # (1,)
    return token, q, p
