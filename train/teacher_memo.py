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
import torch.nn.functional as F
from torch import Tensor


@dataclass
class TeacherTargets:
    """The frozen model's next-token distribution as its K most likely tokens."""

    logp: Tensor
    """(B, T, K) fp32 log-probabilities, descending (``[..., 0]`` is the full model's greedy token)."""
    ids: Tensor
    """(B, T, K) int64 token ids."""
    vocab_logp: Tensor | None = None
    """(B, T) fp32 log of the teacher's mass on the student's draft vocabulary (None: the student scores every
    token)."""

    @classmethod
    def of(cls, logits: Tensor, k: int, vocab_ids: Tensor | None = None) -> TeacherTargets:
        """(B, T, V) logits -> the top ``k`` of their softmax; with ``vocab_ids`` (N,), the student's draft vocabulary,
        also the teacher's mass on it."""
        full = torch.log_softmax(logits.float(), -1)  # (B, T, V)
        logp, ids = torch.topk(full, k, dim=-1)  # (B, T, K) each
        return cls(logp, ids, None if vocab_ids is None else torch.logsumexp(full[..., vocab_ids], -1))

    def greedy(self) -> Tensor:
        """(B, T) the full model's argmax."""
        return self.ids[..., 0]

    def rows(self, valid: Tensor) -> TeacherTargets:
        """The (N, K) rows where ``valid`` (B, T) holds."""
        return TeacherTargets(self.logp[valid], self.ids[valid],
                              None if self.vocab_logp is None else self.vocab_logp[valid])


def top_k_distill_loss(logits: Tensor, target: TeacherTargets, columns: Tensor | None = None) -> Tensor:
    """Mean cross-entropy of (N, V) student logits to the (K + 1)-bucket teacher (N, K): its K tokens, and the rest
    of the vocabulary as one bucket (mass 1 - sum of the K probabilities, student mass the same complement).

    ``columns`` (V_full,) long: the student scores a reduced draft vocabulary, logit column ``columns[id]`` for token
    ``id`` (-1: not scored), and learns the teacher's distribution conditioned on it (needs ``target.vocab_logp``):
    the teacher's tokens inside it over its mass there, the rest bucket what is left of that mass. A token it can
    never draft thus takes no probability from the ones it can (it would if its mass joined the rest bucket)."""
    logits = logits.float()
    ids, logp = target.ids, target.logp  # (N, K) each
    if columns is not None:
        ids = columns[ids]  # (N, K) student columns, -1 outside the draft vocabulary
        logp = torch.where(ids >= 0, logp - target.vocab_logp[:, None], float("-inf"))  # conditioned on it
        logits = F.pad(logits, (0, 1), value=float("-inf"))  # (N, V + 1): a column for the tokens it cannot score
        ids = torch.where(ids >= 0, ids, logits.shape[-1] - 1)
    p = logp.exp()  # (N, K)
    lse = torch.logsumexp(logits, -1)  # (N,)
    top = logits.gather(-1, ids) - lse[:, None]  # (N, K) student log-probs of the teacher's K tokens
    loss = -(p * top.masked_fill(p == 0, 0.0)).sum(-1)  # (N,); a token the student cannot score weighs 0
    if ids.shape[-1] < logits.shape[-1]:  # the rest bucket (empty when K is the vocabulary)
        rest = torch.logsumexp(logits.scatter(-1, ids, float("-inf")), -1) - lse  # (N,) its student log-mass
        loss = loss - (1.0 - p.sum(-1)).clamp_min(0.0) * rest
    return loss.mean()


class TeacherMemo:
    """Per training row (keyed by its token ids as batched), the stream entering layer E and the teacher's top K."""

    def __init__(self, k: int):
        self.k = k
        self.rows: dict[bytes, tuple[Tensor, ...]] = {}
        """Row key -> ((T, d) stream, (T, K) log-probs, (T, K) ids[, (T,) mass on the draft vocabulary]), on the
        CPU."""
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
        h, logp, ids, *vocab = (torch.stack([f[i] for f in found]).to(device) for i in range(len(found[0])))
        return h, TeacherTargets(logp, ids, *vocab)

    def store(self, input_ids: Tensor, exit_h: Tensor, target: TeacherTargets) -> None:
        """Keep each row of a computed batch: (B, T) ids, (B, T, d) stream, (B, T, K) targets."""
        for b, row in enumerate(input_ids):
            vocab = () if target.vocab_logp is None else (target.vocab_logp[b].cpu(),)
            self.rows[self._key(row)] = (exit_h[b].detach().cpu(), target.logp[b].cpu(), target.ids[b].cpu(), *vocab)

