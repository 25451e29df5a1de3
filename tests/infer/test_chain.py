"""Chain drafting: the confidence that stops a chain is the draft's probability of the token it chose."""

import math

import torch

from infer.drafters.base import DecodeState
from infer.drafters.chain import draft_chain
from infer.sampling import SamplingConfig

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


def test_sampled_chain_stops_on_the_probability_of_the_sampled_token():
    """Top-1 is 0.5 >= 0.3 everywhere, but a sampled non-top token (p = 0.033) must end the chain."""
    result = draft_chain(state(SamplingConfig(temperature=1.0, seed=0)), FixedForward(), 8, confidence=0.3)
    assert result.stopped and result.forwards < 8
    assert result.confidence[-1] < 0.3 and all(math.isclose(c, 0.5, rel_tol=1e-6) for c in result.confidence[:-1])
    assert result.draft.tokens.tolist() == [3] * (result.forwards - 1)  # the uncertain token is not proposed


def test_greedy_confidence_is_the_top1_probability():
    result = draft_chain(state(SamplingConfig()), FixedForward(), 5, confidence=0.3)
    assert not result.stopped and result.forwards == 5
    assert all(math.isclose(c, 0.5, rel_tol=1e-6) for c in result.confidence)
