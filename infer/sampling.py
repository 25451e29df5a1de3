"""Token selection and lossless acceptance of drafted token trees.

Greedy: accept the longest path whose tokens equal the full model's argmax, plus one bonus.
Sampling: speculative sampling (accept x ~ q with min(1, p(x)/q(x)), else resample from
norm(max(p - q, 0))), generalised to several candidates per node by recursive rejection:
siblings are tried in draft order, each rejection replaces p by the residual and removes the
rejected token from q (candidates drawn without replacement). Deterministic candidates have
a one-hot q. Temperature/top-k/top-p are applied identically to p and q by the caller.
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
