"""The frozen model's outputs for an exit adapter's training blocks, kept after their first pass (``teacher_top_k``).

An adapter step on a frozen model spends most of its time in the frozen model: the whole forward for the teacher's
distribution, of which only the stream entering layer E and the next-token distribution are used. Both depend on
the block alone, so they are kept per block: the first epoch computes them, every later one runs only the adapter
and the LM head (about a quarter of the work on the default model). The distribution is kept as its K most likely
tokens (log-probabilities and ids) plus the rest as one bucket, and the loss is the cross-entropy to that
(K + 1)-bucket distribution, the same on the first pass and on a kept one, so a run's losses do not depend on
which blocks were seen before.

Memory: per token, the stream (d values in the model's dtype) and K (log-prob, id) pairs; on the default model
(d = 576, K = 32, fp32) 2.6 KB, 0.5 GB for 200,000 training tokens. Kept in CPU memory whatever the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class TeacherTargets:
    """The frozen model's next-token distribution as its K most likely tokens."""

    logp: Tensor
    """(B, T, K) fp32 log-probabilities, descending (``[..., 0]`` is the full model's greedy token)."""
    ids: Tensor
    """(B, T, K) int64 token ids."""

    @classmethod
    def of(cls, logits: Tensor, k: int) -> TeacherTargets:
        """(B, T, V) logits -> the top ``k`` of their softmax."""
        logp, ids = torch.topk(torch.log_softmax(logits.float(), -1), k, dim=-1)  # (B, T, K) each
        return cls(logp, ids)

    def greedy(self) -> Tensor:
        """(B, T) the full model's argmax."""
        return self.ids[..., 0]

    def rows(self, valid: Tensor) -> TeacherTargets:
        """The (N, K) rows where ``valid`` (B, T) holds."""
        return TeacherTargets(self.logp[valid], self.ids[valid])


def top_k_distill_loss(logits: Tensor, target: TeacherTargets) -> Tensor:
    """Mean cross-entropy of (N, V) student logits to the (K + 1)-bucket teacher (N, K): its K tokens, and the rest
    of the vocabulary as one bucket (mass 1 - sum of the K probabilities, student mass the same complement)."""
    logits = logits.float()
    lse = torch.logsumexp(logits, -1)  # (N,)
    top = logits.gather(-1, target.ids) - lse[:, None]  # (N, K) student log-probs of the teacher's K tokens
    p = target.logp.exp()  # (N, K)
    loss = -(p * top).sum(-1)  # (N,)
    if target.ids.shape[-1] < logits.shape[-1]:  # the rest bucket (empty when K is the vocabulary)
        rest = torch.logsumexp(logits.scatter(-1, target.ids, float("-inf")), -1) - lse  # (N,) its student log-mass
        loss = loss - (1.0 - p.sum(-1)).clamp_min(0.0) * rest
    return loss.mean()


class TeacherMemo:
    """Per training row (keyed by its token ids as batched), the stream entering layer E and the teacher's top K."""

    def __init__(self, k: int):
        self.k = k
        self.rows: dict[bytes, tuple[Tensor, Tensor, Tensor]] = {}
        """Row key -> ((T, d) stream, (T, K) log-probs, (T, K) ids), on the CPU."""
        self.hits = self.misses = 0

    @staticmethod
    def _key(row: Tensor) -> bytes:
        return row.to(torch.int64).cpu().numpy().tobytes()

    def lookup(self, input_ids: Tensor) -> tuple[Tensor, TeacherTargets] | None:
        """(B, T) ids -> ((B, T, d) stream, targets) on the ids' device when every row is kept, else None."""
        found = [self.rows.get(self._key(row)) for row in input_ids]
        if any(f is None for f in found):
            self.misses += 1
            return None
        self.hits += 1
        device = input_ids.device
        h, logp, ids = (torch.stack([f[i] for f in found]).to(device) for i in range(3))
        return h, TeacherTargets(logp, ids)

    def store(self, input_ids: Tensor, exit_h: Tensor, target: TeacherTargets) -> None:
        """Keep each row of a computed batch: (B, T) ids, (B, T, d) stream, (B, T, K) targets."""
        for b, row in enumerate(input_ids):
            self.rows[self._key(row)] = (exit_h[b].detach().cpu(), target.logp[b].cpu(), target.ids[b].cpu())

