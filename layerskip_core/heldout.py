"""The one held-out loss: next-token cross-entropy, token-weighted, in nats per token, and its perplexity.

Training's evaluation (``train.exit_eval``, ``layerskip eval-exits``) and the bench's verifier quality
(``infer.measure.quality``) both score a model with these functions, so a loss quoted from either is the same
quantity: position t of a block predicts token t + 1, labels equal to ``IGNORE`` (prompt tokens, padding, a
block's last position) are not scored, and the loss is the sum of the scored positions' cross-entropies divided
by their count (not a mean of per-block means). torch is imported where it is used: the command line imports
this module without it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

IGNORE = -100
"""Label value that cross-entropy ignores (prompt tokens, padding): PyTorch's ``ignore_index``."""
PERPLEXITY_CAP = 50.0
"""Losses above this many nats report the perplexity e^50 (a diverged model's perplexity overflows nothing)."""


def next_token_targets(labels: Tensor) -> Tensor:
    """Labels shifted left by one (position t predicts label t+1); the last position gets ``IGNORE``. (B, T)"""
    import torch.nn.functional as F

    return F.pad(labels[:, 1:], (0, 1), value=IGNORE)


def loss_sums(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """(sum of the cross-entropies in nats, number of scored positions), both 0-dim float64 on the logits' device,
    of ``logits`` (..., V) against ``targets`` (...) (``next_token_targets``); no host sync."""
    import torch.nn.functional as F

    ce = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE, reduction="sum")
    return ce.double(), (targets != IGNORE).sum().double()


def perplexity(loss: float) -> float:
    """e^loss of a loss in nats per token (capped at ``PERPLEXITY_CAP`` nats)."""
    return math.exp(min(loss, PERPLEXITY_CAP))
