"""Packed rows: one decoding forward over the new tokens of several sequences, each attending over its own cache.

The batched engine (``infer.batch``) keeps one ``KVCache`` per sequence (its own per-layer lengths, O(1) rollback,
sequences leaving and joining freely) and runs a forward over the sequences' new tokens *packed* as one hidden
(N, d), N = the sum of their T_r: the norms, fused q/k/v, output and MLP projections run once over all N rows (where
a batch saves the weight reads), and only the attention runs per sequence, writing its K/V at that sequence's length
and attending with that sequence's mask (``Runner.cached_attention``, the runner's own per-row code). With the
small-matmul CPU kernel every row of a projection is bitwise independent of the others, so a packed forward computes
exactly what each sequence's own forward computes: the batched output equals decoding each prompt alone.

A packed call of one sequence is ``Runner.span`` itself (so the static executor and CUDA graphs still serve one
row); several run eagerly (static capture of packed calls is not implemented: their shapes vary with the batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from infer import layer_math
from infer.kv_cache import KVCache
from infer.plan import LayerPlan
from infer.runner import DraftHead, Runner, SpanOutput


@dataclass
class Segment:
    """One sequence's T rows in a packed forward."""

    cache: KVCache
    """The sequence's own cache: its per-layer lengths say where its keys and values go."""
    positions: list[int]
    """RoPE positions of its T new tokens (host ints)."""
    mask: Tensor | None = None
    """(T, W) bool over the last W attended slots, as ``Runner.forward_layers`` takes it (None: causal)."""

    @property
    def size(self) -> int:
        return len(self.positions)


def packed_span(runner: Runner, segments: Sequence[Segment], hidden: Tensor, start: int, end: int, *,
                exact_until: int | None = None, plan: LayerPlan | None = None, logits: bool = False,
                vocab: DraftHead | None = None) -> SpanOutput:
    """``Runner.span`` over several sequences: ``hidden`` (N, d) holds the segments' rows in order, entering layer
    ``start``; layers ``[start, exact_until)`` exactly, then ``[exact_until, end)`` under ``plan``. Returns the packed
    (N, d) streams and (N, V) logits when asked for, rows in the segments' order."""
    if len(segments) == 1:
        s = segments[0]
        return runner.span(s.cache, hidden, s.positions, start, end, exact_until=exact_until, plan=plan, mask=s.mask,
                           logits=logits, vocab=vocab)
    split = end if exact_until is None else exact_until
    pos = runner.to_device([p for s in segments for p in s.positions])  # (N,)
    cos, sin = runner.rope(pos)  # K x (N, 1, D) each
    masks = [None if s.mask is None else s.mask.to(runner.device) for s in segments]
    memo: list[dict] = [{} for _ in segments]  # per segment: attention masks by start slot
    rope = (cos, sin, pos)
    exact = packed_layers(runner, segments, hidden, rope, start, split, None, masks, memo)  # (N, d)
    out = exact if split >= end else packed_layers(runner, segments, exact, rope, split, end, plan, masks, memo)
    return SpanOutput(exact, out, runner.logits(out, vocab) if logits else None)


def packed_layers(runner: Runner, segments: Sequence[Segment], hidden: Tensor, rope: tuple[Tensor, Tensor, Tensor],
                  start: int, end: int, plan: LayerPlan | None, masks: list[Tensor | None], memo: list[dict]) -> Tensor:
    """Layers ``[start, end)`` over the packed rows ``hidden`` (N, d) under ``plan`` (a skipped attention sublayer
    writes no K/V); ``rope``: (cos, sin) K x (N, 1, D) at the rows' positions, and the positions (N,)."""
    attn_skip, mlp_skip = (plan.skip_attn, plan.skip_mlp) if plan is not None else ((), ())
    N = hidden.shape[0]
    for i in range(start, end):
        run_attn, run_mlp = i not in attn_skip, i not in mlp_skip
        if run_attn:
            hidden = packed_attention(runner, i, segments, hidden, rope, masks, memo)
        if run_mlp:
            hidden = runner.mlp(runner.layers[i], hidden)  # (N, d)
        if run_attn or run_mlp:
            runner.counters.layer_tokens[i] += N
    return hidden


def packed_attention(runner: Runner, i: int, segments: Sequence[Segment], hidden: Tensor,
                     rope: tuple[Tensor, Tensor, Tensor], masks: list[Tensor | None], memo: list[dict]) -> Tensor:
    """Layer ``i``'s attention sublayer with its residual over packed rows (N, d): projections once, attention per
    sequence over its own cache (with the layer's sliding window, if any)."""
    s, w = runner.spec, runner.layers[i]
    cos, sin, pos = rope
    r = runner.rope_rows[i]
    q, k, v = runner.qkv_rope(w, hidden, cos[r], sin[r])  # (Hq, N, D), (Hkv, N, D), (Hkv, N, D)
    outs, a = [], 0
    for seg, mask, known in zip(segments, masks, memo, strict=True):
        b = a + seg.size
        slot = seg.cache.lengths[i]
        if slot not in known:
            known[slot] = runner.attn_mask(slot, seg.size, mask)  # (T, slot + T) or None
        layer_mask = runner.window_mask(seg.cache, i, known[slot], pos[a:b])  # the layer's sliding window, if any
        outs.append(runner.cached_attention(i, seg.cache, q[:, a:b], k[:, a:b], v[:, a:b], layer_mask, s.attn_scale))
        a = b
    out = torch.cat(outs, 1).transpose(0, 1).reshape(hidden.shape[0], s.num_heads * s.head_dim)  # (N, Hq D)
    return layer_math.attention_out(s, w, hidden, out)
