"""When ``hf_generate`` samples with ``SamplingConfig`` itself (``fast_sampling``) instead of the processors
``generate`` built: only where both give the same distribution, bit for bit (issue 67 item 3's neighbour)."""

import pytest
import torch
from transformers.generation import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from infer.hf.decoding import fast_sampling, sampling_config
from infer.model.sampling import SamplingConfig, probs_from_logits

T, K, P = TemperatureLogitsWarper(0.542235004901886), TopKLogitsWarper(1), TopPLogitsWarper(0.9)


@pytest.mark.parametrize("processors, fast", [
    ([], True), ([T], True), ([K], True), ([P], True), ([T, K], True), ([T, P], True), ([K, P], True),
    ([T, K, P], True),
    ([K, T], False),  # a caller's top-k before the config's temperature
    ([P, T], False), ([P, K], False), ([T, P, K], False), ([T, T], False),
])
def test_the_fast_path_takes_only_the_engine_order(processors, fast):
    assert fast_sampling(processors) is fast


def processed(processors, logits):
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    scores = logits.clone()
    for p in processors:
        scores = p(ids, scores)
    return torch.softmax(scores, -1)


def test_top_k_before_a_temperature_is_another_distribution():
    """Two scores one float step apart round to one value once divided by the temperature: top-k after the division
    keeps both, top-k before it keeps one. So the order [top-k, temperature] must not take the fast path."""
    logits = torch.tensor([[1.3871687650680542, 1.3871688842773438, -5.0]])  # adjacent fp32 values
    config = sampling_config(type("C", (), {"do_sample": True})(), [K, T])
    assert torch.equal(processed([K, T], logits), torch.tensor([[0.0, 1.0, 0.0]]))
    assert not torch.equal(probs_from_logits(logits, config), processed([K, T], logits))
    assert torch.equal(probs_from_logits(logits, config), processed([T, K], logits))


def test_top_p_zero_keeps_the_most_likely_token_as_transformers():
    """transformers' TopPLogitsWarper takes top_p = 0 (it keeps one token); so does SamplingConfig."""
    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0]])
    ours = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_p=0.0))
    assert torch.equal(ours, processed([TopPLogitsWarper(0.0)], logits))
    assert ours[0].tolist() == [0.0, 1.0, 0.0, 0.0]
