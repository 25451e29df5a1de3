"""The early-exit loss without a (B, T, V) logits tensor per exit.

Every exit's loss is ``CE(lm_head(norm(h_E)))``. Done naively, each exit materialises its own
(B, T, V) logits (plus an fp32 copy for the softmax and the same again for its gradient): with a
128K vocabulary and 4 x 1024 tokens that is about 3 GB per exit. Here the tokens are processed in
chunks of ``chunk`` rows, and the gradient of each chunk is computed right away (the forward of the
cross-entropy already knows it: ``softmax - onehot``), so only one chunk's logits live at a time and
nothing is recomputed in the backward:

- :class:`FusedHeadCE` (a ``torch.autograd.Function``) takes the normed hidden states of every exit,
  the LM-head weight and the per-exit weights; its forward returns the weighted total loss and keeps
  ``d total / d x_E`` (the size of the hidden states) and one fp32 ``d total / d W`` (the size of the
  head) shared by all exits; its backward only scales them by the incoming gradient. The head weight
  is cast to the compute dtype once per forward, and each chunk's head gradient (in the compute
  dtype) is added in place into the fp32 accumulator, so no (V, d) temporary is made per chunk
  beyond the product itself.
- :func:`checkpointed_head_ce` is the fallback for heads that are not a plain ``nn.Linear`` (a LoRA- or
  DeepSpeed-ZeRO-3-wrapped head, whose weight is not a usable tensor outside its own forward): each
  chunk runs through the modules under activation checkpointing, so its logits are recomputed in
  the backward instead of being kept.

Both equal ``F.cross_entropy(..., ignore_index=-100)`` (the mean over non-ignored targets, NaN when
there are none) and its gradients: ``tests/train/test_train_fast_forward.py`` checks that in fp32 and under
bf16 autocast, and ``tests/train/test_train_losses.py`` the one cast per forward, the allocations per
chunk and the bf16 head gradient's accumulation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from train.data import IGNORE

CHUNK_ELEMENTS = 1 << 25
"""Target size of one chunk's logits on a CPU, in elements (32M: 128 MB in fp32)."""
GPU_CHUNK_ELEMENTS = 1 << 27
"""Target on a GPU (128M: 512 MB in fp32), at most 1/64 of its memory: fewer, larger head matmuls keep it busy."""


def default_chunk(vocab_size: int, device: torch.device | str = "cpu") -> int:
    """Token rows per chunk so that one chunk's logits hold about the device's target number of values."""
    elements = CHUNK_ELEMENTS
    if torch.device(device).type == "cuda":
        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
        elements = max(CHUNK_ELEMENTS, min(GPU_CHUNK_ELEMENTS, total // 64 // 4))
    return max(64, elements // max(1, vocab_size))


def _compute_dtype(x: Tensor, weight: Tensor) -> torch.dtype:
    """The matmul dtype autocast would use on this device (the head's dtype when autocast is off)."""
    kind = x.device.type
    if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4
        if torch.is_autocast_enabled(kind):
            return torch.get_autocast_dtype(kind)
    elif kind == "cuda" and torch.is_autocast_enabled():
        return torch.get_autocast_gpu_dtype()
    elif kind == "cpu" and torch.is_autocast_cpu_enabled():
        return torch.get_autocast_cpu_dtype()
    return torch.promote_types(x.dtype, weight.dtype)


def _chunk_ce_and_grad(x: Tensor, weight: Tensor, targets: Tensor, scale: Tensor | None,
                       cdtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """Sum of CE over one chunk and, when ``scale`` is given, ``scale * d CE_sum / d logits``.

    x (n, d) normed hidden; weight (V, d) already in ``cdtype``; targets (n,) with -100 for ignored rows.
    """
    logits = (x.to(cdtype) @ weight.t()).float()  # (n, V)
    valid = targets != IGNORE  # (n,)
    safe = targets.clamp_min(0).unsqueeze(1)  # (n, 1)
    lse = torch.logsumexp(logits, dim=-1)  # (n,)
    picked = logits.gather(1, safe).squeeze(1)  # (n,)
    ce_sum = ((lse - picked) * valid).sum()  # ()
    if scale is None:
        return ce_sum, None
    grad = logits.sub_(lse.unsqueeze(1)).exp_()  # (n, V): softmax, in the logits' own buffer
    grad.scatter_add_(1, safe, torch.full_like(picked, -1.0).unsqueeze(1))  # (n, V): softmax - onehot
    grad.mul_((valid * scale).unsqueeze(1))  # (n, V): ignored rows get no gradient
    return ce_sum, grad


def _accumulate(acc: Tensor | None, gt: Tensor, xc: Tensor) -> Tensor:
    """acc + gt @ xc in fp32 without a (V, d) fp32 temporary: gt (V, n) and xc (n, d) in the compute dtype.

    The first chunk's product becomes the accumulator; later ones are added in place, in fp32 with ``addmm_``
    and otherwise as the compute-dtype product upcast element by element inside ``add_`` (the same sum as
    adding ``product.float()``).
    """
    if acc is None:
        return (gt @ xc).float()  # (V, d)
    if gt.dtype == torch.float32:
        return acc.addmm_(gt, xc)  # (V, d)
    return acc.add_(gt @ xc)  # (V, d) fp32 += (V, d) compute dtype


class FusedHeadCE(torch.autograd.Function):
    """total = sum_E w_E * mean CE(x_E @ W^T, targets_E), chunked over tokens, gradients kept from the forward.

    ``apply(weight, chunk, exit_weights, targets_list, *xs)``: weight (V, d); each x (N, d) normed
    hidden of one exit with its targets (N,) in ``targets_list``; ``exit_weights`` a tuple of floats.
    Returns (total (), per-exit CE (n_exits,), detached).
    """

    @staticmethod
    def forward(ctx, weight: Tensor, chunk: int, exit_weights: tuple[float, ...], targets_list: tuple[Tensor, ...],
                *xs: Tensor) -> tuple[Tensor, Tensor]:
        need_w = ctx.needs_input_grad[0]
        need_grad = need_w or any(ctx.needs_input_grad[4:])
        cdtype = _compute_dtype(xs[0], weight)
        kind = xs[0].device.type
        grad_w = None  # (V, d) fp32, from the first chunk's product on (no zero fill)
        grad_xs, losses = [], []
        with torch.autocast(kind, enabled=False):  # dtypes are chosen explicitly above
            w = weight.to(cdtype)  # (V, d): cast once per forward, not per chunk
            for w_e, x, targets in zip(exit_weights, xs, targets_list, strict=True):
                count = (targets != IGNORE).sum()  # () on the device: no host sync
                scale = (w_e / count.float()) if need_grad else None  # ()
                grad_x = torch.empty_like(x) if need_grad else None  # (N, d)
                ce_sum = x.new_zeros((), dtype=torch.float32)
                for s in range(0, x.shape[0], chunk):
                    xc, tc = x[s:s + chunk], targets[s:s + chunk]  # (n, d), (n,)
                    part, grad = _chunk_ce_and_grad(xc, w, tc, scale, cdtype)
                    ce_sum = ce_sum + part
                    if grad is not None:
                        g = grad.to(cdtype)  # (n, V)
                        grad_x[s:s + chunk] = (g @ w).to(x.dtype)  # (n, d)
                        if need_w:
                            grad_w = _accumulate(grad_w, g.t(), xc.to(cdtype))  # (V, d) fp32
                losses.append(ce_sum / count)
                grad_xs.append(grad_x)
        per_exit = torch.stack(losses)  # (n_exits,)
        total = sum(w_e * loss for w_e, loss in zip(exit_weights, losses, strict=True))  # (): no host-to-device copy
        ctx.mark_non_differentiable(per_exit)
        ctx.save_for_backward(grad_w, *grad_xs)
        ctx.weight_dtype = weight.dtype
        ctx.done = False
        return total, per_exit

    @staticmethod
    def backward(ctx, grad_total: Tensor, _grad_per_exit: Tensor):
        if ctx.done:  # the kept gradients are scaled in place below: a second backward would be wrong
            raise RuntimeError("FusedHeadCE supports one backward pass per forward (no retain_graph)")
        ctx.done = True
        grad_w, *grad_xs = ctx.saved_tensors
        g = grad_total.float()
        gw = grad_w.mul_(g).to(ctx.weight_dtype) if grad_w is not None else None  # (V, d)
        gxs = [gx.mul_(g.to(gx.dtype)) if gx is not None else None for gx in grad_xs]  # each (N, d)
        return (gw, None, None, None, *gxs)


def fused_head_ce(head: nn.Linear, xs: list[Tensor], targets: list[Tensor], exit_weights: list[float],
                  chunk: int) -> tuple[Tensor, Tensor]:
    """Weighted total and per-exit CE of ``head`` over normed hidden states xs[i] (B, T, d) and targets (B, T)."""
    flat_x = [x.reshape(-1, x.shape[-1]) for x in xs]  # each (N, d)
    flat_t = tuple(t.reshape(-1) for t in targets)  # each (N,)
    return FusedHeadCE.apply(head.weight, chunk, tuple(float(w) for w in exit_weights), flat_t, *flat_x)


def _chunk_ce_sum(norm: nn.Module, head: nn.Module, h: Tensor, targets: Tensor) -> Tensor:
    logits = head(norm(h)).float()  # (n, V)
    return F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")


def checkpointed_head_ce(norm: nn.Module, head: nn.Module, h: Tensor, targets: Tensor, chunk: int) -> Tensor:
    """Mean CE of ``head(norm(h))`` (h (B, T, d) un-normed, targets (B, T)), one checkpointed chunk at a time."""
    flat_h = h.reshape(-1, h.shape[-1])  # (N, d)
    flat_t = targets.reshape(-1)  # (N,)
    total = flat_h.new_zeros((), dtype=torch.float32)
    for s in range(0, flat_h.shape[0], chunk):
        hc, tc = flat_h[s:s + chunk], flat_t[s:s + chunk]  # (n, d), (n,)
        if torch.is_grad_enabled() and hc.requires_grad:
            total = total + checkpoint(_chunk_ce_sum, norm, head, hc, tc, use_reentrant=False)
        else:
            total = total + _chunk_ce_sum(norm, head, hc, tc)
    return total / (flat_t != IGNORE).sum()


def is_plain_head(head: nn.Module) -> bool:
    """True when the LM head is a bias-free ``nn.Linear`` whose weight is a whole tensor (fused path usable)."""
    weight = getattr(head, "weight", None)
    return (type(head) is nn.Linear and head.bias is None and isinstance(weight, Tensor)
            and weight.dim() == 2 and weight.numel() > 0 and not hasattr(weight, "ds_id"))
