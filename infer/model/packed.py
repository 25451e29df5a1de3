"""The one layer loop: a decoding forward over packed rows, each segment attending over its own cache.

Every eager forward runs here (``Runner.forward_layers`` and ``Runner.span``'s eager path are one segment; the batched
engine's verifications, drafts and prompt prefill are several). A batch keeps one ``KVCache`` per sequence (its own
per-layer lengths, O(1) rollback, sequences leaving and joining freely) and runs a forward over the sequences' new
tokens *packed* as one hidden (N, d), N = the sum of their T_r: the norms, fused q/k/v, output and MLP projections
run once over all N rows (where a batch saves the weight reads), and only the attention runs per segment, writing
its K/V at that sequence's length and attending with that sequence's mask (``Runner.cached_attention``). With the
small-matmul CPU kernel every row of a projection is bitwise independent of the others, so a packed forward computes
exactly what each sequence's own forward computes: the batched output equals decoding each prompt alone.

A ``packed_span`` of one segment is ``Runner.span`` itself (so the static executor, its compiled steps and CUDA graphs
still serve one row); several run this loop eagerly (their shapes vary with the batch). A layer's math is
``infer.model.layer_math``'s. The runner is a ``ForwardModel`` here (``infer.model.forward_model``: the runner imports
this module, never the other way round).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from infer.model import layer_math
from infer.model.forward_model import ForwardModel, Segment, SpanOutput, VocabHead
from infer.model.plan import LayerPlan
from infer.model.weights import Linear


def projections(runner: ForwardModel) -> Iterator[Linear]:
    """Every matmul of a prefill: the layers' q/k/v, output, gate/up and down projections, and the LM head."""
    yield runner.lm_head
    for w in runner.layers:
        yield from (lin for lin in (w.qkv, w.o, w.gate_up, w.down) if lin is not None)


def packs(runner: ForwardModel) -> bool:
    """Whether prompts share packed forwards on ``runner`` now, on the kernel (``infer.decode.prefill``'s rule: its
    module docstring); elsewhere a prompt is prefilled alone on ``F.linear`` (``bulk``)."""
    kernel = runner.kernel
    capped = runner.spec.final_softcap is not None
    return (runner.device.type == "cpu" and runner.dtype == torch.float32 and kernel is not None
            and kernel.path() == "avx512" and torch.get_num_threads() == 1
            and all(lin.kernel is not None for lin in projections(runner))
            and not (capped and runner.spec.vocab_size % 64))


def packed_span(runner: ForwardModel, segments: Sequence[Segment], hidden: Tensor, start: int, end: int, *,
                exact_until: int | None = None, plan: LayerPlan | None = None, logits: bool = False,
                vocab: VocabHead | None = None) -> SpanOutput:
    """``Runner.span`` over several sequences: ``hidden`` (N, d) holds the segments' rows in order, entering layer
    ``start``; layers ``[start, exact_until)`` exactly, then ``[exact_until, end)`` under ``plan``. Returns the packed
    (N, d) streams and (N, V) logits when asked for, rows in the segments' order."""
    if len(segments) == 1:
        s = segments[0]
        return runner.span(s.cache, hidden, s.positions, start, end, exact_until=exact_until, plan=plan,
                           mask=s.mask, logits=logits, vocab=vocab)
    split = end if exact_until is None else exact_until
    return runner.span_rows(segments, hidden, start, split, end, plan, logits, vocab)


def packed_layers(runner: ForwardModel, segments: Sequence[Segment], hidden: Tensor, rope: tuple[list, list, Tensor],
                  start: int, end: int, plan: LayerPlan | None, masks: Sequence[Tensor | None],
                  memo: list[dict], bulk: bool = False) -> Tensor:
    """Layers ``[start, end)`` over the packed rows ``hidden`` (N, d) under ``plan`` (a skipped attention sublayer
    writes no K/V and leaves its layer's length unchanged); ``rope``: (cos, sin) K x (N, 1, D) at the rows' positions,
    and the positions (N,); ``masks``: per segment (T, W) or None; ``memo``: per segment, attention masks by start
    slot (shared by the calls of one forward). ``bulk`` (prompt prefill of one prompt) uses BLAS (see
    ``Runner.forward_layers``)."""
    attn_skip, mlp_skip = (plan.skip_attn, plan.skip_mlp) if plan is not None else ((), ())
    N = hidden.shape[0]
    counts, layers, spec = runner.counters.layer_tokens, runner.layers, runner.spec
    for i in range(start, end):
        run_attn, run_mlp = i not in attn_skip, i not in mlp_skip
        if run_attn:
            hidden = packed_attention(runner, i, segments, hidden, rope, masks, memo, bulk)  # (N, d)
        if run_mlp:
            hidden = layer_math.mlp(spec, layers[i], hidden, bulk)  # (N, d)
        if run_attn or run_mlp:
            counts[i] += N
    return hidden


def packed_attention(runner: ForwardModel, i: int, segments: Sequence[Segment], hidden: Tensor,
                     rope: tuple[list, list, Tensor], masks: Sequence[Tensor | None], memo: list[dict],
                     bulk: bool = False) -> Tensor:
    """Layer ``i``'s attention sublayer with its residual over packed rows (N, d): projections once, attention per
    segment over its own cache (with the layer's sliding window, if any); one segment takes no slices."""
    s, w = runner.spec, runner.layers[i]
    cos, sin, pos = rope
    r = runner.rope_rows[i]
    q, k, v = layer_math.qkv_rope(s, w, hidden, cos[r], sin[r], bulk)  # (Hq, N, D), (Hkv, N, D), (Hkv, N, D)
    if len(segments) == 1:
        out = segment_attention(runner, i, segments[0], q, k, v, pos, masks[0], memo[0], bulk)  # (Hq, N, D)
    else:
        outs, a = [], 0
        for seg, mask, known in zip(segments, masks, memo, strict=True):
            b = a + seg.size
            outs.append(segment_attention(runner, i, seg, q[:, a:b], k[:, a:b], v[:, a:b], pos[a:b], mask, known,
                                          bulk))  # (Hq, T, D)
            a = b
        out = torch.cat(outs, 1)  # (Hq, N, D)
    out = out.transpose(0, 1).reshape(hidden.shape[0], s.num_heads * s.head_dim)  # (N, Hq D)
    return layer_math.attention_out(s, w, hidden, out, bulk)


def segment_attention(runner: ForwardModel, i: int, seg: Segment, q: Tensor, k: Tensor, v: Tensor, pos: Tensor,
                      mask: Tensor | None, known: dict, bulk: bool) -> Tensor:
    """One segment's attention at layer ``i``: q (Hq, T, D), k, v (Hkv, T, D) at positions ``pos`` (T,), its mask
    built once per start slot (``known``) and cut to the layer's sliding window: (Hq, T, D)."""
    slot = seg.cache.lengths[i]
    if slot not in known:
        known[slot] = runner.attn_mask(slot, q.shape[1], mask)  # (T, slot + T) or None
    layer_mask = runner.window_mask(seg.cache, i, known[slot], pos)  # the layer's sliding window, if any
    return runner.cached_attention(i, seg.cache, q, k, v, layer_mask, runner.spec.attn_scale, bulk)
