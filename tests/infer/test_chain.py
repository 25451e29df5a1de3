"""Chain drafting: the confidence that stops a chain is the draft's probability of the token it chose."""

import math

import torch

from infer.drafters.base import DecodeState
from infer.drafters.chain import draft_chain
from infer.model.sampling import SamplingConfig

V = 16


class FixedForward:
    """A stand-in draft forward: the same logits at every position (top-1 probability 0.5)."""

    exact_layers = 0

    def __init__(self):
        probs = torch.full((1, V), 0.5 / (V - 1))  # (1, V)
        probs[0, 3] = 0.5
        self.logits = probs.log()  # (1, V)

    def __call__(self, cache, token, position):
        return torch.zeros(1, 4), self.logits  # (1, d), (1, V)


def state(sampling: SamplingConfig) -> DecodeState:
    return DecodeState(runner=type("R", (), {"device": "cpu"})(), cache=None, sampling=sampling,
                       generator=sampling.generator(), tokens=[1], prompt_len=1, n=0, budget=100)


def test_sampled_chain_that_drops_its_last_token_stops_on_the_top1_probability():
    """Top-1 is 0.5 >= 0.3 everywhere: a chain that drops its low-confidence token (early exit's) must not stop
    because a sampled non-top token (p = 0.033) came up, or it would propose q restricted to likely tokens."""
    result = draft_chain(state(SamplingConfig(temperature=1.0, seed=0)), FixedForward(), 8, confidence=0.3)
    assert not result.stopped and result.forwards == 8 and result.draft.size == 8
    assert all(math.isclose(c, 0.5, rel_tol=1e-6) for c in result.confidence)
    assert set(result.draft.tokens.tolist()) != {3}  # unconditioned draws from q: not only the top token
    stopped = draft_chain(state(SamplingConfig(temperature=1.0, seed=0)), FixedForward(), 8, confidence=0.6)
    assert stopped.stopped and stopped.forwards == 1 and stopped.draft.size == 0  # top-1 0.5 < 0.6: nothing drawn


def test_sampled_chain_that_keeps_its_last_token_stops_after_a_low_probability_draw():
    """SWIFT's and Self-SD's rule: the sampled token is proposed, and a low probability ends the chain after it."""
    result = draft_chain(state(SamplingConfig(temperature=1.0, seed=0)), FixedForward(), 8, confidence=0.3,
                         keep_last=True)
    assert result.stopped and result.forwards < 8 and result.draft.size == result.forwards
    assert result.confidence[-1] < 0.3 and all(math.isclose(c, 0.5, rel_tol=1e-6) for c in result.confidence[:-1])


def test_greedy_confidence_is_the_top1_probability():
    result = draft_chain(state(SamplingConfig()), FixedForward(), 5, confidence=0.3)
    assert not result.stopped and result.forwards == 5
    assert all(math.isclose(c, 0.5, rel_tol=1e-6) for c in result.confidence)
