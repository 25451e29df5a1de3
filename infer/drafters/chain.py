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
from infer.plan import LayerPlan
from infer.runner import KVCache, Runner, ints_to_device
from infer.sampling import probs_from_logits, sample


class EarlyExitForward:
    """Layers [0, E) then the final norm and LM head (LayerSkip); all of it is exact."""

    def __init__(self, runner: Runner, exit_layer: int):
        self.runner, self.exact_layers = runner, exit_layer

    def __call__(self, cache: KVCache, token: Tensor, position: int) -> tuple[Tensor, Tensor]:
        r = self.runner
        out = r.span(cache, r.embed(token), [position], 0, self.exact_layers, logits=True)
        return out.hidden, out.logits  # (1, d), (1, V)


class PlanForward:
    """All layers under a sublayer skip plan; the layers before the first layer with a skip are exact."""

    def __init__(self, runner: Runner, plan: LayerPlan):
        self.runner, self.plan, self.exact_layers = runner, plan, plan.exact_prefix

    def __call__(self, cache: KVCache, token: Tensor, position: int) -> tuple[Tensor, Tensor]:
        r = self.runner
        out = r.span(cache, r.embed(token), [position], 0, r.num_layers, exact_until=self.exact_layers,
                     plan=self.plan, logits=True)
        return out.exact, out.logits  # (1, d), (1, V)


@dataclass
class ChainResult:
    draft: Draft
    """The proposed chain (possibly empty, still carrying the exact hidden states it computed)."""
    dists: list[Tensor] = field(default_factory=list)
    """(1, V) distribution each drafted position was chosen from (softmax, or the sampling q)."""
    confidence: list[float] = field(default_factory=list)
    """Draft confidence at every forward (including the one that stopped the chain): the draft's softmax
    probability of the token it chose there (the top-1 probability when greedy, the sampled token's when
    sampling, as SWIFT's and Self-SD's code do)."""
    forwards: int = 0
    stopped: bool = False
    """The last forward fell below the confidence threshold (rather than the length cap ending the chain)."""


def draft_chain(state: DecodeState, forward, max_draft: int, confidence: float = 0.0,
                keep_last: bool = False) -> ChainResult:
    """Draft up to ``max_draft`` tokens after the pending one; stop early below ``confidence``.

    A token whose draft probability (of the token chosen: the argmax when greedy, the sampled one
    when sampling) is under ``confidence`` ends the chain; it is proposed only with ``keep_last``
    (Self-SD proposes it; SWIFT verifies that last, uncertain position with many candidates).
    Greedy decoding proposes the argmax; sampling draws from the processed draft distribution q.
    """
    runner = state.runner
    greedy = state.sampling.greedy
    k = min(max_draft, state.budget - 1)
    token = ints_to_device([state.pending], runner.device)  # (1,), via pinned memory on CUDA: no host sync
    hiddens, tokens, dists, conf = [], [], [], []
    stop = False
    for i in range(max(k, 0)):
        exact, logits = forward(state.cache, token, state.n + i)  # (1, d), (1, V)
        hiddens.append(exact)
        soft = torch.softmax(logits, -1)  # (1, V)
        q = soft if greedy else probs_from_logits(logits, state.sampling)  # (1, V)
        token = logits.argmax(-1) if greedy else sample(q, state.generator)  # (1,)
        p_token = soft[0, token[0]]  # () on the device
        # reading it on the host syncs the GPU: only when a threshold needs the value now
        conf.append(float(p_token) if confidence > 0 else p_token)
        stop = confidence > 0 and conf[-1] < confidence
        if stop and not keep_last:
            break
        tokens.append(token)
        dists.append(q)
        if stop:
            break
    if confidence <= 0 and conf:
        conf = torch.stack(conf).tolist()  # one host sync per chain instead of one per token
    if not hiddens:
        return ChainResult(Draft(torch.empty(0, dtype=torch.long)))
    draft = Draft(tokens=torch.cat(tokens) if tokens else torch.empty(0, dtype=torch.long, device=runner.device),
                  q=None if greedy or not dists else torch.cat(dists), exact_layers=forward.exact_layers,
                  hidden=torch.cat(hiddens))
    return ChainResult(draft, dists, conf, len(hiddens), stop)
