"""How the next token is chosen from a forward's logits: ``SamplingConfig`` (temperature, top-k, top-p, seed), the
distribution it makes of the logits, and a draw from it.

The drafters draw their draft tokens with it, and the decode cycle the target's; a greedy config is the argmax.
Temperature/top-k/top-p are applied identically to the target's p and the draft's q, so speculative sampling's
acceptance (over p and q) stays lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from layerskip_core.errors import UserError
from layerskip_core.options import check_fields


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen from the (target or draft) logits."""

    temperature: float = 0.0
    """0 selects greedy (argmax) decoding; > 0 samples from softmax(logits / temperature)."""
    top_k: int = 0
    """Keep only the k most likely tokens before sampling (0 = off)."""
    top_p: float = 1.0
    """Keep the most likely tokens whose probability together reaches top_p (1.0 = off; 0.0 keeps the most likely
    token alone, as transformers' warper does), by transformers' rule (see ``nucleus``)."""
    seed: int | None = None
    """Seed of the sampling RNG; None draws a fresh one."""

    def __post_init__(self) -> None:
        check_fields(self, "SamplingConfig")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise UserError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:  # transformers' TopPLogitsWarper takes [0, 1] too
            raise UserError(f"top-p must be in [0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


OVERFLOW_TEMPERATURE = 1e-8
"""At or above this temperature logits / temperature overflows fp32 only for logits beyond 3.4e30, which no working
model makes (``sample`` reports the non-finite result); below it ``scale`` checks each row for overflow."""


def probs_from_logits(logits: Tensor, cfg: SamplingConfig) -> Tensor:
    """(..., V) logits -> (..., V) fp32 probabilities after temperature, then top-k, then top-p: the order, the rules
    and the arithmetic of transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper``
    (``min_tokens_to_keep=1``) as ``generate`` builds them, then its softmax of the processed scores, so the kept set
    is theirs also where tokens tie (frequent in bf16): top-k keeps every token tied with the k-th largest, top-p
    drops tied tokens in the order transformers' sort puts them (``nucleus``). No host sync (CUDA graphs and the
    static executor run it)."""
    scores = scale(logits, cfg.temperature)  # (..., V) fp32
    if cfg.top_k and cfg.top_k < scores.shape[-1]:
        kth = torch.topk(scores, cfg.top_k, dim=-1).values[..., -1:]  # (..., 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))  # ties with the k-th stay
    if cfg.top_p < 1.0:
        scores = nucleus(scores, cfg.top_p)
    return torch.softmax(scores, dim=-1)


def scale(logits: Tensor, temperature: float) -> Tensor:
    """(..., V) logits -> (..., V) fp32 ``logits / temperature`` (transformers' temperature warper on the fp32 scores
    ``generate`` makes). Below ``OVERFLOW_TEMPERATURE`` a row this overflows (a temperature of 1e-39; 1e-50 is 0 in
    fp32) gets the argmax's limit instead of inf / inf or 0 / 0: the largest logit stays 0, the others fall to -inf
    (ties share it)."""
    x = logits.float()  # (..., V)
    scores = x / temperature  # (..., V)
    if temperature >= OVERFLOW_TEMPERATURE:
        return scores
    shifted = x - x.amax(-1, keepdim=True)  # (..., V), <= 0
    limit = torch.where(shifted == 0, shifted, shifted / temperature)  # (..., V)
    overflowed = (x.isfinite() & ~scores.isfinite()).any(-1, keepdim=True)  # (..., 1)
    return torch.where(overflowed, limit, scores)


def nucleus(scores: Tensor, top_p: float) -> Tensor:
    """(..., V) scores -> (..., V) with the tokens outside the nucleus at -inf, by transformers' rule: sort ascending,
    drop every token whose cumulative probability so far is <= 1 - top_p, keep the last (the largest) always.

    Of tied tokens the one sorted first is dropped first. The sort is transformers' very call (``torch.sort``, not
    stable: on the CPU it puts ties in id order up to 16 tokens, in its own order beyond), so the same scores give
    transformers' order and its kept set; a stable sort would not."""
    ascending, order = torch.sort(scores, dim=-1)  # (..., V) each
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)  # (..., V)
    drop_sorted = cumulative <= (1 - top_p)  # (..., V)
    drop_sorted[..., -1:] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # (..., V) back in token order
    return scores.masked_fill(drop, float("-inf"))


def sample(probs: Tensor, generator: torch.Generator) -> Tensor:
    """(..., V) probabilities -> (...,) sampled ids; logits that were not finite (weights that overflow, e.g. a damaged
    exit adapter) are one line, not torch's message about the probability tensor."""
    flat = probs.reshape(-1, probs.shape[-1])
    try:
        return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
    except RuntimeError as e:
        if "inf" not in str(e) and "nan" not in str(e):
            raise
        raise UserError("sampling met logits that are not finite numbers (the model's or a draft's weights overflow "
                        "in this dtype, e.g. a damaged or diverged exit adapter); check the weights, or decode "
                        "greedily") from None


def select(logits: Tensor, cfg: SamplingConfig, generator: torch.Generator) -> Tensor:
    """(..., V) logits -> (...,) next-token ids under ``cfg``."""
    if cfg.greedy:
        return logits.argmax(-1)
    return sample(probs_from_logits(logits, cfg), generator)
