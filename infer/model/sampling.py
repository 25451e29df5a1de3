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
    """Keep the smallest set of tokens whose probability reaches top_p (1.0 = off)."""
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
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top-p must be in (0, 1], got {self.top_p}")

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


def probs_from_logits(logits: Tensor, cfg: SamplingConfig) -> Tensor:
    """(..., V) logits -> (..., V) fp32 probabilities after temperature, top-k and top-p.

    The largest logit is subtracted before dividing by the temperature, and the largest stays 0, so a tiny temperature
    (1e-39, or 1e-50, which is 0 in fp32) gives the argmax's limit (every other logit falls to -inf; ties share it)
    instead of inf / inf or 0 / 0."""
    shifted = logits.float() - logits.float().amax(-1, keepdim=True)  # (..., V), <= 0
    logits = torch.where(shifted == 0, shifted, shifted / cfg.temperature)  # (..., V)
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # keep a token if the mass strictly before it is below top_p (the first always stays)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


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
