"""Token trees from a drafted chain: SWIFT's dynamic top-k verification tree (Xia et al. 2025).

Beside the chain drafting of ``infer.drafters.chain``: a chain of m drafted tokens becomes a tree by hanging the
next candidates of each depth off the chain node before it, as many per depth as the draft's confidence there
allows (``GREEDY_WIDTHS`` / ``SAMPLING_WIDTHS``), up to a cap on the tree's nodes: the chain's included, so a
verification of a capped tree checks at most cap + 1 tokens (the chain is drafted at most cap deep).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from infer.drafters.base import DecodeState, Draft, VerifyOutcome
from infer.drafters.chain import ChainResult, check_size
from infer.model.kv_cache import ints_to_device

GREEDY_WIDTHS = (3, 5, 8, 10)  # candidates per depth for top-1 prob > 0.95, > 0.8, > 0.5, else (paper)
SAMPLING_WIDTHS = (1, 3, 5, 10)
WIDTH_THRESHOLDS = (0.95, 0.8, 0.5)
WIDEST = max(GREEDY_WIDTHS + SAMPLING_WIDTHS)
"""Most candidates at one depth: a tree of k depths has at most k * WIDEST nodes."""


@dataclass
class TreeOption:
    """The option of a drafter that can verify a token tree (its Config subclasses this)."""

    tree: bool = False
    """Verify a dynamic top-k tree: the draft's next candidates at each depth hang off the chain node before it, as
    many as the draft's confidence there allows; off = the chain only."""
    max_tree_nodes: int = 12
    """With tree: most tokens drafted per verification, the chain's included (the chain stops at this many even where
    num-draft allows more; siblings fill what the chain leaves), so a verification checks at most max-tree-nodes + 1
    tokens (verifying more in one forward costs more: docs/RESULTS.md measures it)."""

    def __post_init__(self) -> None:
        check_size(self.max_tree_nodes, "max-tree-nodes")

    def chain_depth(self, num_draft: int) -> int:
        """Most chain tokens (draft forwards) per verification (``chain_depth``)."""
        return chain_depth(num_draft, self.tree, self.max_tree_nodes)

    def most_nodes(self, num_draft: int) -> int:
        """Most drafted tokens per verification: the node cap with a tree, else the chain's k."""
        return self.max_tree_nodes if self.tree else num_draft


def chain_depth(num_draft: int, tree: bool, max_nodes: int) -> int:
    """Most chain tokens (draft forwards) per verification: k, and with a tree no more than its node cap (the chain's
    nodes are the tree's)."""
    return min(num_draft, max_nodes) if tree else num_draft


def chain_rows_kept(outcome: VerifyOutcome) -> int:
    """How many of a verified draft's tree positions, from the pending token on, hold the tokens the sequence now has
    at those positions: the pending token and the chain nodes the accepted path followed (a sibling it took, and
    everything after it, was never run by the chain's draft forwards)."""
    kept = 1
    for i, node in enumerate(outcome.path[1:], start=1):
        if node != i:
            break
        kept += 1
    return kept


def chain_tree(chain: ChainResult, state: DecodeState, max_nodes: int) -> Draft:
    """Chain nodes first (positions 1..m, m <= ``max_nodes``), then siblings of each chain node, shallow depths first,
    at most ``max_nodes`` drafted nodes in all.

    Candidates for every depth are chosen on the device at once and read in one transfer (with the
    chain's confidences when the chain did not read them): one host sync per tree, not several per depth.
    """
    draft = chain.draft
    m = draft.size
    max_nodes = max_nodes if state.draft_cap is None else min(max_nodes, state.draft_cap)  # the chain kept it
    if m > max_nodes:  # a drafter's bug: its chain must stop at the cap (``TreeOption.chain_depth``)
        raise ValueError(f"a chain of {m} drafted tokens under a tree cap of {max_nodes} nodes")
    room = max_nodes - m
    if m == 0 or room == 0:
        return draft
    greedy = state.sampling.greedy
    widths = GREEDY_WIDTHS if greedy else SAMPLING_WIDTHS
    dists = torch.cat(chain.dists[:m])  # (m, V)
    n_max = min(max(widths) - 1, room, dists.shape[1] - 1)
    candidates = _candidates(dists, draft.tokens, n_max, greedy, state.generator)  # (m, n_max), -1 = none
    if len(chain.confidence) >= m:
        rows, conf = candidates.tolist(), chain.confidence[:m]  # the tree's one sync
    else:  # the chain read nothing: its confidences come along in the same transfer
        p1 = dists.gather(-1, draft.tokens[:, None])  # (m, 1)
        host = torch.cat([candidates.double(), p1.double()], 1).tolist()  # the tree's one sync
        rows, conf = [[int(c) for c in r[:-1]] for r in host], [r[-1] for r in host]
    extra_tok, extra_parent = [], []
    for depth in range(m):
        width = next((w for t, w in zip(WIDTH_THRESHOLDS, widths, strict=False) if conf[depth] > t), widths[-1])
        siblings = [c for c in rows[depth] if c >= 0][:min(width - 1, room)]
        room -= len(siblings)
        extra_tok += siblings
        extra_parent += [depth] * len(siblings)  # depth d's siblings hang off chain position d
        if room <= 0:
            break
    if not extra_tok:
        return draft
    tokens = torch.cat([draft.tokens, ints_to_device(extra_tok, draft.tokens.device)])  # pinned copy: no sync
    # a sibling was drawn from the same distribution as the chain node at its depth
    q = None if draft.q is None else draft.q.index_select(0, ints_to_device(list(range(m)) + extra_parent,
                                                                             draft.q.device))
    return Draft(tokens, list(range(m)) + extra_parent, q, draft.exact_layers, draft.hidden)


def _candidates(dists: Tensor, chosen: Tensor, n: int, greedy: bool, generator) -> Tensor:
    """(m, n) more candidates per depth besides ``chosen`` (m,), in order, -1 where a depth has fewer.

    Greedy: the next most likely tokens of each row of ``dists`` (m, V). Sampling: an ordered draw without
    replacement from each row with the chosen token removed, by the Gumbel-top-k trick (top-n of
    log p + Gumbel noise is distributed as n sequential draws without replacement), so all depths are
    drawn at once.
    """
    rest = dists.scatter(1, chosen[:, None], 0.0)  # (m, V)
    if greedy:
        values, index = torch.topk(rest, n, dim=-1)  # (m, n)
        return torch.where(values > 0, index, -1)
    u = torch.rand(rest.shape, generator=generator, device=rest.device).clamp_min(1e-20)  # (m, V)
    keys = rest.log() - (-u.log()).log()  # (m, V): -inf where rest is 0
    values, index = torch.topk(keys, n, dim=-1)  # (m, n)
    return torch.where(values > float("-inf"), index, -1)
