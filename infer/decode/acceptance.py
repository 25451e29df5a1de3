"""Lossless acceptance of drafted token trees: which drafted tokens the target keeps, and the bonus token.

Greedy: accept the longest path whose tokens equal the full model's argmax, plus one bonus.
Sampling: speculative sampling (accept x ~ q with min(1, p(x)/q(x)), else resample from
norm(max(p - q, 0))), generalised to several candidates per node by recursive rejection:
siblings are tried in draft order, each rejection replaces p by the residual and removes the
rejected token from q (candidates drawn without replacement). Deterministic candidates have
a one-hot q. Temperature/top-k/top-p are applied identically to p and q by the caller
(``infer.model.sampling.probs_from_logits``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class TreeShape:
    """Parent pointers of a token tree whose position 0 is the pending (root) token."""

    parents: list[int]
    """parents[i] for positions 1..T-1 (index i-1 here), each < its own position; root excluded."""

    @property
    def size(self) -> int:
        return len(self.parents) + 1

    @property
    def is_chain(self) -> bool:
        return all(p == i for i, p in enumerate(self.parents))

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(self.size)]
        for i, p in enumerate(self.parents, start=1):
            kids[p].append(i)
        return kids

    def depths(self) -> list[int]:
        d = [0] * self.size
        for i, p in enumerate(self.parents, start=1):
            d[i] = d[p] + 1
        return d

    def ancestor_mask(self, device: torch.device | str = "cpu") -> Tensor:
        """(T, T) bool: [i, j] is True iff j is i or an ancestor of i."""
        T = self.size
        if self.is_chain:
            return torch.ones(T, T, dtype=torch.bool, device=device).tril()
        anc = torch.eye(T, dtype=torch.bool, device=device)
        for i, p in enumerate(self.parents, start=1):
            anc[i] |= anc[p]
        return anc


def greedy_accept(tree: TreeShape, tokens: list[int], target: list[int]) -> tuple[list[int], int]:
    """Longest path whose tokens equal the target argmax of their parent; returns (path, bonus).

    ``tokens``/``target`` are per tree position; ``path`` starts with the root (0).
    """
    kids = tree.children()
    path = [0]
    while True:
        want = target[path[-1]]
        nxt = next((c for c in kids[path[-1]] if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)


def sampling_accept(tree: TreeShape, tokens: list[int], p: Tensor, q: Tensor | None,
                    generator: torch.Generator) -> tuple[list[int], int]:
    """Recursive rejection sampling over the tree; returns (path, bonus).

    ``p`` (T, V) are target probabilities at each tree position; ``q`` (T-1, V) the draft
    distribution each node (positions 1..T-1) was drawn from, or None for deterministic
    candidates (one-hot q). Siblings share their parent's q and were drawn without replacement.
    """
    kids = tree.children()
    path = [0]
    while True:
        node = path[-1]
        residual = p[node]  # (V,)
        q_left = None
        accepted = None
        for child in kids[node]:
            tok = tokens[child]
            if q is None:
                ratio = residual[tok]  # q is one-hot at tok
            else:
                if q_left is None:
                    q_left = q[child - 1].clone()  # (V,) siblings share it
                ratio = residual[tok] / q_left[tok].clamp_min(1e-20)
            u = torch.rand((), generator=generator, device=p.device)
            if bool(u < ratio):
                accepted = child
                break
            if q is None:
                residual = residual.clone()
                residual[tok] = 0.0
            else:
                residual = (residual - q_left).clamp_min(0.0)
                q_left[tok] = 0.0
                q_mass = q_left.sum()
                if q_mass > 0:
                    q_left = q_left / q_mass
            mass = residual.sum()
            if mass <= 0:  # p was entirely covered by q: cannot happen for a valid q, guard anyway
                residual = p[node]
                break
            residual = residual / mass
        if accepted is None:
            bonus = int(torch.multinomial(residual, 1, generator=generator))
            return path, bonus
        path.append(accepted)


def chain_accept_draws(ids: Tensor, p: Tensor, q: Tensor | None, generator: torch.Generator) -> Tensor:
    """Every random draw of speculative sampling over a chain, made on the device at once: (3T - 1,) long.

    ``ids`` (T,): the pending token then the m = T - 1 drafted tokens x_1..x_m; ``p`` (T, V) the target's
    probabilities at each position; ``q`` (m, V) the draft distribution x_i was drawn from (None: a
    deterministic draft, one-hot q). Returns ``[ids (T), accept_i (m), residual_i (m), bonus (1)]`` where
    accept_i is 1 iff u_i < p_{i-1}(x_i) / q_{i-1}(x_i) with u_i uniform, residual_i is drawn from
    norm(max(p_{i-1} - q_{i-1}, 0)) (what replaces x_i if it is the first rejection) and bonus from p_m (the
    extra token when all m are accepted). The draws are independent, so using the first rejection's residual
    is exactly the sequential algorithm's distribution; reading the result is the step's one host sync.
    """
    m = ids.shape[0] - 1
    draws = []
    if m:
        x = ids[1:]  # (m,)
        px = p[:m].gather(1, x[:, None])[:, 0]  # (m,)
        if q is None:
            ratio = px  # q(x) = 1
            residual = p[:m].scatter(1, x[:, None], 0.0)  # (m, V): p without x
        else:
            ratio = px / q.gather(1, x[:, None])[:, 0].clamp_min(1e-20)  # (m,)
            residual = (p[:m] - q).clamp_min(0.0)  # (m, V)
        empty = residual.sum(-1, keepdim=True) <= 0  # (m, 1): p covered by q (not for a valid q); guard anyway
        residual = torch.where(empty, p[:m], residual)  # (m, V)
        u = torch.rand(m, generator=generator, device=p.device)  # (m,)
        draws += [(u < ratio).long(), torch.multinomial(residual, 1, generator=generator)[:, 0]]
    bonus = torch.multinomial(p[m:], 1, generator=generator)[:, 0]  # (1,)
    return torch.cat([ids, *draws, bonus])  # (3T - 2 + 1,)


def chain_accept(T: int, host: list[int]) -> tuple[list[int], int]:
    """(path, bonus) from the host copy of ``chain_accept_draws``: accept up to the first rejection."""
    m = T - 1
    accept, residual, bonus = host[T:T + m], host[T + m:T + 2 * m], host[-1]
    first = next((i for i, a in enumerate(accept) if not a), None)
    if first is None:
        return list(range(T)), bonus
    return list(range(first + 1)), residual[first]
