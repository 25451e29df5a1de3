"""Verification of one or several sequences' drafts: one target forward over all of them, acceptance per sequence.

``Engine`` verifies one sequence per step and ``BatchEngine`` (``infer.decode.batch``) a batch; both go through
``verify_rows``: ``VerifyRow.of`` lays a sequence's pending token and draft tree out (positions, tree mask, which
layers the draft already computed exactly, the rollback of the rest), ``target_forward`` runs the target over every
row's tokens as packed rows (``Runner.run`` of a program over the rows' segments, ``infer.model.program``), and
``accept`` decides
each row's accepted path and bonus token with one host read for all greedy rows and chain-sampling rows together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from infer.decode.acceptance import TreeShape, chain_accept, chain_accept_draws, greedy_accept, sampling_accept
from infer.decode.processing import PROCESSED, PositionProcessor, process_tree
from infer.drafters.base import DecodeState, Draft, VerifyOutcome, cut_layers
from infer.model.program import Program, Rows, Segment
from infer.model.sampling import probs_from_logits


@dataclass
class VerifyRow:
    """One sequence's verification: the pending token and the draft tree after it, where they go, what is reused."""

    state: DecodeState
    draft: Draft | None
    tree: TreeShape
    ids: Tensor
    """(T,) the pending token, then the drafted tokens, on the device."""
    positions: list[int]
    """T host RoPE positions (the pending token's sequence index plus each node's depth)."""
    mask: Tensor | None
    """(T, T) tree ancestor mask, None for a chain."""
    exact: int = 0
    """E: cache layers [0, E) already hold exact KV for the first ``reused`` positions."""
    reused: int = 0
    """h: rows of ``draft.hidden`` (the stream entering layer E) verification takes as they are."""
    processor: PositionProcessor | None = None
    """Logits processing at every verified position (``infer.decode.processing``), or None."""
    observe: tuple[int, ...] = ()
    """Layers (0 < l < depth) at whose input the stream of every verified position is kept
    (``Draft.observe``; ``VerifyOutcome.observed``): the forward is cut there, same layers on same rows."""

    @classmethod
    def of(cls, state: DecodeState, draft: Draft | None, processor: PositionProcessor | None = None) -> VerifyRow:
        """Lay ``draft`` out after ``state``'s pending token and roll back what the draft wrote in layers >= E; the
        layers its ``observe`` names are kept (an empty draft is a plain step that may still ask for them)."""
        runner, cache, n = state.runner, state.cache, state.n
        observe = draft.observe if draft is not None else ()
        if draft is not None and draft.size == 0 and draft.hidden is None:
            draft = None
        m = draft.size if draft is not None else 0
        tree = TreeShape(draft.parents if draft is not None and draft.parents is not None else list(range(m)))
        pending = runner.to_device([state.pending])  # (1,)
        ids = pending if m == 0 else torch.cat([pending, draft.tokens.to(runner.device)])  # (T,)
        mask = None if tree.is_chain else tree.ancestor_mask()  # (T, T)
        row = cls(state, draft, tree, ids, [n + d for d in tree.depths()], mask, processor=processor,
                  observe=cut_layers(observe, state.depth))
        if draft is not None and draft.hidden is not None and draft.exact_layers > 0:
            row.exact, row.reused = draft.exact_layers, draft.hidden.shape[0]
            if any(cache.lengths[i] != n + row.reused for i in range(row.exact)):
                raise RuntimeError(f"drafter left layers < {row.exact} at lengths {cache.lengths[:row.exact]}, "
                                   f"expected {n + row.reused}")
        cache.rollback(n, start=row.exact)  # drop whatever the draft wrote in layers >= E
        return row

    def segment(self, first: int = 0) -> Segment:
        """This row's positions from tree position ``first`` on, as a packed segment (the mask's rows cut to match)."""
        mask = None if self.mask is None else self.mask[first:, :self.ids.shape[0]]  # (T - first, T)
        return Segment(self.state.cache, self.positions[first:], mask)


@dataclass
class _Streams:
    """Where each row's residual stream stands while ``target_forward`` climbs the layers."""

    fresh: list[Tensor | None]
    """Per row: (T_r - h, d) the positions below its E the draft did not compute (None: none, or E = 0)."""
    current: list[Tensor | None]
    """Per row: (T_r, d) the stream of every position, once the row has reached its E."""
    at_exit: list[Tensor | None]
    """Per row: (T_r, d) the stream entering its layer E (None for E = 0)."""
    observed: list[dict[int, Tensor]]
    """Per row: (T_r, d) the stream entering each of its ``observe`` layers."""


def target_forward(rows: Sequence[VerifyRow]) -> tuple[Tensor, _Streams]:
    """One forward of the target over every row's T_r positions: (N, V) logits, rows in order, and the streams kept
    on the way (each row's at its E and at its ``observe`` layers).

    A row whose draft reused layers [0, E) computes only its other positions there; rows reach their E at different
    layers, so the layers run in stages between the distinct E values (and observed layers), each stage one packed
    forward over the rows (and row parts) it concerns.
    """
    runner, depth = rows[0].state.runner, rows[0].state.depth
    if any(r.state.depth != depth for r in rows):
        raise ValueError("the rows of one verification must have one target depth")
    fresh = [runner.embed(r.ids[r.reused:]) if r.exact > 0 and r.reused < r.ids.shape[0] else None for r in rows]
    s = _Streams(fresh, [None] * len(rows), [None] * len(rows), [{} for _ in rows])
    cuts = sorted({0, *(r.exact for r in rows), *(x for r in rows for x in r.observe)})
    for lo, hi in zip(cuts, [*cuts[1:], None], strict=True):
        _arrive(rows, s, lo)
        if hi is None:
            break
        parts = [(j, s.fresh[j] if r.exact >= hi else s.current[j]) for j, r in enumerate(rows)
                 if (r.exact >= hi and s.fresh[j] is not None) or r.exact <= lo]
        if parts:
            segs = [rows[j].segment(rows[j].reused if rows[j].exact >= hi else 0) for j, _ in parts]
            out = runner.run(Program(lo, hi), Rows(torch.cat([h for _, h in parts]), segs)).hidden  # (sum, d)
            for (j, _), piece in zip(parts, out.split([g.size for g in segs]), strict=True):
                if rows[j].exact >= hi:
                    s.fresh[j] = piece
                else:
                    s.current[j] = piece
    segs = [r.segment() for r in rows]
    logits = runner.run(Program(cuts[-1], depth, logits=True), Rows(torch.cat(s.current), segs)).logits  # (N, V)
    return logits, s


def _arrive(rows: Sequence[VerifyRow], s: _Streams, layer: int) -> None:
    """The stage boundary at ``layer``: rows whose E it is gather their whole stream; observed streams are kept."""
    for j, r in enumerate(rows):
        if layer == 0 and r.exact == 0:
            s.current[j] = r.state.runner.embed(r.ids)  # (T, d)
        elif layer == r.exact and layer > 0:
            s.current[j] = r.draft.hidden if s.fresh[j] is None else torch.cat([r.draft.hidden, s.fresh[j]])
            s.at_exit[j] = s.current[j]  # (T, d)
        if layer not in r.observe:
            continue
        if r.exact <= layer:
            s.observed[j][layer] = s.current[j]  # (T, d)
            continue
        given = r.draft.observed or {}  # below E: the draft's rows, then those verification computes
        if layer in given:
            s.observed[j][layer] = given[layer] if s.fresh[j] is None else torch.cat([given[layer], s.fresh[j]])


def accept(rows: Sequence[VerifyRow], logits: Tensor, streams: _Streams) -> list[VerifyOutcome]:
    """Each row's accepted path and bonus token from the packed (N, V) target logits; the cache is compacted to the
    path. One host read serves every greedy and chain-sampling row (trees under sampling read per node)."""
    pieces = logits.split([r.ids.shape[0] for r in rows])  # (T_r, V) each
    reads: list[Tensor | None] = []  # per row: what it reads from the device, or None (a tree under sampling)
    probs: list[Tensor | None] = []  # per row: (T, V) target probabilities of a tree under sampling
    for r, row_logits in zip(rows, pieces, strict=True):
        sampling = r.state.sampling
        if r.processor is not None:  # each position scored after the prefix it sees
            row_logits = process_tree(r.processor, r.state.tokens, r.tree, r.ids, row_logits)  # (T, V)
            sampling = sampling if sampling.greedy else PROCESSED
        p = None if r.state.sampling.greedy else probs_from_logits(row_logits, sampling)  # (T, V)
        if p is None:
            reads.append(torch.cat([r.ids, row_logits.argmax(-1)]))  # (2T,): tokens, then the target's argmax
        elif r.tree.is_chain:
            reads.append(chain_accept_draws(r.ids, p, r.draft.q if r.draft is not None else None, r.state.generator))
        else:
            reads.append(None)
        probs.append(p)
    read = [x for x in reads if x is not None]
    host = torch.cat(read).tolist() if read else []  # the one host sync of the step
    outcomes, a = [], 0
    for r, x, p, hidden, seen in zip(rows, reads, probs, streams.at_exit, streams.observed, strict=True):
        T, argmax = r.ids.shape[0], []
        if x is None:  # a tree under sampling: recursive rejection over siblings, node by node
            tokens = r.ids.tolist()
            path, bonus = sampling_accept(r.tree, tokens, p, r.draft.q, r.state.generator)
        else:
            values, a = host[a:a + x.shape[0]], a + x.shape[0]
            tokens = values[:T]
            if p is None:
                argmax = values[T:]
                path, bonus = greedy_accept(r.tree, tokens, argmax)
            else:
                path, bonus = chain_accept(T, values)
        outcomes.append(commit(r, path, [tokens[i] for i in path[1:]] + [bonus], argmax, hidden, seen))
    return outcomes


def commit(row: VerifyRow, path: list[int], tokens: list[int], argmax: list[int], hidden: Tensor | None,
           observed: dict[int, Tensor] | None = None) -> VerifyOutcome:
    """Move the accepted path's KV rows to consecutive slots, drop the rest, and advance the row's state."""
    state, n = row.state, row.state.n
    state.cache.compact([n + p for p in path], list(range(n, n + len(path))))
    state.cache.rollback(n + len(path))
    state.n = n + len(path)
    return VerifyOutcome(row.draft, path, tokens, n, argmax, exit_hidden=hidden if row.exact > 0 else None,
                         observed=observed or {})


def verify_rows(rows: Sequence[VerifyRow]) -> list[VerifyOutcome]:
    """Verify every row's draft in one target forward; each row's outcome (its cache and ``state.n`` advanced)."""
    logits, streams = target_forward(rows)
    return accept(rows, logits, streams)
