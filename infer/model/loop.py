"""The one layer loop: the eager executor, running a program's steps over packed rows in torch.

Every forward that no other executor takes runs here: one sequence is one segment; a batch keeps one ``KVCache`` per
sequence (its own per-layer lengths, O(1) rollback, sequences leaving and joining freely) and runs a forward over the
sequences' new tokens *packed* as one hidden (N, d), N = the sum of their T_r: the norms, fused q/k/v, output and MLP
projections run once over all N rows (where a batch saves the weight reads), and only the attention runs per segment,
writing its K/V at that sequence's length and attending with that sequence's mask. With the small-matmul CPU kernel
every row of a projection is bitwise independent of the others, so a packed forward computes exactly what each
sequence's own forward computes: the batched output equals decoding each prompt alone. A layer's math is
``infer.model.layer_math``'s; a segment's masks and windows ``infer.model.program``'s.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from infer.model import layer_math
from infer.model.attention import attend, rows_for, score_scale
from infer.model.kv_cache import KVCache
from infer.model.program import BULK, Output, Program, Rows, Segment, window_mask
from infer.model.stack import Stack
from infer.model.weights import Linear


def projections(stack: Stack) -> Iterator[Linear]:
    """Every matmul of a prefill: the layers' q/k/v, output, gate/up and down projections, and the LM head."""
    yield stack.lm_head
    for w in stack.layers:
        yield from (lin for lin in (w.qkv, w.o, w.gate_up, w.down) if lin is not None)


def packs(stack: Stack) -> bool:
    """Whether prompts share packed forwards on ``stack`` now, on the kernel (``infer.decode.prefill``'s rule: its
    module docstring); elsewhere a prompt is prefilled alone on ``F.linear`` (``BULK`` rows)."""
    kernel = stack.kernel
    capped = stack.spec.final_softcap is not None
    return (stack.device.type == "cpu" and stack.dtype == torch.float32 and kernel is not None
            and kernel.path() == "avx512" and torch.get_num_threads() == 1
            and all(lin.kernel is not None for lin in projections(stack))
            and not (capped and stack.spec.vocab_size % 64))


class EagerExecutor:
    """The layer loop in torch: takes every program and rows (it never declines)."""

    name = "eager"

    def __init__(self, stack: Stack):
        self.stack = stack

    def run(self, program: Program, rows: Rows) -> Output:
        """The program's steps over ``rows``: each attention sublayer writes its K/V at the layer's length of each
        segment's cache (the runner advances the lengths after the run); a skipped one writes nothing."""
        s, bulk = self.stack, rows.kind == BULK
        pos = rows.device_positions(s.device)  # (N,)
        cos, sin = s.rope(pos)  # K x (N, 1, D) each
        hidden, kept = rows.hidden, {}
        for item in program.walk:
            if type(item) is int:  # a cut: the stream entering that layer is kept
                kept[item] = hidden
                continue
            w = s.layers[item.layer]
            if item.attn:
                r = s.rope_rows[item.layer]
                hidden = self.attention(item.layer, rows, hidden, cos[r], sin[r], pos, bulk)  # (N, d)
            if item.mlp:
                hidden = layer_math.mlp(s.spec, w, hidden, bulk)  # (N, d)
        return program.output(hidden, kept, s.head(hidden, program.vocab) if program.logits else None)

    def attention(self, i: int, rows: Rows, hidden: Tensor, cos: Tensor, sin: Tensor, pos: Tensor,
                  bulk: bool) -> Tensor:
        """Layer ``i``'s attention sublayer with its residual over packed rows (N, d): projections once, attention per
        segment over its own cache (with the layer's sliding window, if any); one segment takes no slices."""
        s, w, segments = self.stack.spec, self.stack.layers[i], rows.segments
        q, k, v = layer_math.qkv_rope(s, w, hidden, cos, sin, bulk)  # (Hq, N, D), (Hkv, N, D), (Hkv, N, D)
        if len(segments) == 1:
            out = self.segment(i, segments[0], q, k, v, pos, bulk)  # (Hq, N, D)
        else:
            outs, a = [], 0
            for seg in segments:
                b = a + seg.size
                outs.append(self.segment(i, seg, q[:, a:b], k[:, a:b], v[:, a:b], pos[a:b], bulk))  # (Hq, T, D)
                a = b
            out = torch.cat(outs, 1)  # (Hq, N, D)
        out = out.transpose(0, 1).reshape(hidden.shape[0], s.num_heads * s.head_dim)  # (N, Hq D)
        return layer_math.attention_out(s, w, hidden, out, bulk)

    def segment(self, i: int, seg: Segment, q: Tensor, k: Tensor, v: Tensor, pos: Tensor, bulk: bool) -> Tensor:
        """One segment's attention at layer ``i``: q (Hq, T, D), k, v (Hkv, T, D) at positions ``pos`` (T,), with its
        mask at the layer's start slot, cut to the layer's sliding window: (Hq, T, D)."""
        base = seg.attention_mask(seg.cache.lengths[i], self.stack.device)  # (T, slot + T) or None
        mask = window_mask(self.stack.spec, seg.cache, i, base, pos)  # the layer's sliding window, if any
        return self.cached_attention(i, seg.cache, q, k, v, mask, bulk)

    def cached_attention(self, i: int, cache: KVCache, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None,
                         bulk: bool = False) -> Tensor:
        """Write k, v (Hkv, T, D) at layer ``i``'s length in ``cache`` (which the runner advances after the run), then
        attend q (Hq, T, D) over the layer's slots up to the new ones with ``attn_mask`` (``Segment.attention_mask``'s
        form; None: causal from slot 0, or all visible) and the family's score scale: (Hq, T, D). With the kernel,
        every row runs the batch-invariant row attention (``infer.model.attention.attend``; the cache writes in the
        same C++ call), except in ``bulk`` (prompt prefill) calls."""
        scale = self.stack.spec.attn_scale
        T = q.shape[1]
        start = cache.lengths[i]
        stop = start + T
        if stop > cache.capacity:
            raise RuntimeError(f"KV cache full: layer {i} needs {stop} slots, capacity {cache.capacity}")
        rows = None if bulk else rows_for(self.stack.kernel, q, attn_mask, start == 0 and T > 1)
        if rows is not None:
            return rows.attend_cache(q, k, v, cache.k, cache.v, i, start, attn_mask, score_scale(q, scale))
        cache.k[i, :, start:stop] = k
        cache.v[i, :, start:stop] = v
        keys = cache.k[i, :, :stop]  # (Hkv, S, D)
        values = cache.v[i, :, :stop]  # (Hkv, S, D)
        return attend(q, keys, values, attn_mask, causal=start == 0 and T > 1, scale=scale)  # (Hq, T, D)
