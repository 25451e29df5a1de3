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

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from train.data import IGNORE


@dataclass(frozen=True)
class Teacher:
    """``keep_final``'s teacher of the last exit: the frozen start's final layer and the weight of its KL term."""

    hidden: Tensor
    """The teacher's normed last hidden state, (B, T, d) or flattened (N, d), rows in the last exit's order."""
    head: Tensor
    """Its LM-head weight (V, d)."""
    kl_weight: float
    """k of the loss term k * mean KL(teacher || the last exit) (``keep_final.kl_weight``)."""

    def rows(self, start: int, stop: int) -> Teacher:
        """The teacher of rows [start, stop) of a flattened hidden state."""
        return replace(self, hidden=self.hidden[start:stop])  # (n, d)

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


def _chunk_ce_and_grad(x: Tensor, weight: Tensor, targets: Tensor, scale: Tensor | None, cdtype: torch.dtype,
                       teacher: Teacher | None = None, kl_scale: Tensor | None = None,
                       softcap: float | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Sums of CE and of KL(teacher || model) over one chunk and, when ``scale`` is given, their gradient
    ``scale * d CE_sum / d logits + kl_scale * d KL_sum / d logits``.

    x (n, d) normed hidden; weight (V, d) already in ``cdtype``; targets (n,) with -100 for ignored rows;
    ``teacher``: its hidden (n, d) for these rows and its head (V, d) in ``cdtype``, or None (KL sum None then).
    Ignored rows count in neither sum. ``softcap`` c: the logits are c * tanh(x W^T / c) (Gemma 3's final logit
    softcapping, the teacher's too), and the gradient is taken through it.
    """
    logits = (x.to(cdtype) @ weight.t()).float()  # (n, V)
    squash = None
    if softcap is not None:
        squash = torch.tanh(logits / softcap)  # (n, V)
        logits = squash * softcap  # (n, V)
    valid = targets != IGNORE  # (n,)
    safe = targets.clamp_min(0).unsqueeze(1)  # (n, 1)
    lse = torch.logsumexp(logits, dim=-1)  # (n,)
    picked = logits.gather(1, safe).squeeze(1)  # (n,)
    ce_sum = ((lse - picked) * valid).sum()  # ()
    kl_sum = t_prob = None
    if teacher is not None:
        t_logits = (teacher.hidden.to(cdtype) @ teacher.head.t()).float()  # (n, V)
        if softcap is not None:
            t_logits = torch.tanh(t_logits / softcap) * softcap
        t_logp = torch.log_softmax(t_logits, dim=-1)  # (n, V)
        t_prob = t_logp.exp()  # (n, V)
        kl_rows = (t_prob * (t_logp - logits + lse.unsqueeze(1))).sum(-1)  # (n,)
        kl_sum = (kl_rows * valid).sum()  # ()
    if scale is None:
        return ce_sum, kl_sum, None
    grad = logits.sub_(lse.unsqueeze(1)).exp_()  # (n, V): softmax, in the logits' own buffer
    kl_grad = None if t_prob is None else t_prob.neg_().add_(grad)  # (n, V): softmax - teacher's
    grad.scatter_add_(1, safe, torch.full_like(picked, -1.0).unsqueeze(1))  # (n, V): softmax - onehot
    grad.mul_((valid * scale).unsqueeze(1))  # (n, V): ignored rows get no gradient
    if kl_grad is not None:
        grad.add_(kl_grad.mul_((valid * kl_scale).unsqueeze(1)))  # (n, V)
    if squash is not None:
        grad.mul_(1 - squash.square_())  # (n, V): d capped / d raw = 1 - tanh^2
    return ce_sum, kl_sum, grad


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


def _exit_pass(x: Tensor, w: Tensor, targets: Tensor, w_e: float, chunk: int, cdtype: torch.dtype,
               need: tuple[bool, bool], grad_w: Tensor | None, teacher: Teacher | None,
               softcap: float | None = None) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """One exit over all its chunks: (mean CE, mean KL or None, d total / d x or None, head gradient so far).

    x (N, d); w (V, d) in ``cdtype``; targets (N,); ``need`` = (any gradient, the head's gradient);
    ``teacher``: hidden (N, d), head (V, d) in ``cdtype``, KL weight; or None.
    """
    need_grad, need_w = need
    count = (targets != IGNORE).sum()  # () on the device: no host sync
    scale = (w_e / count.float()) if need_grad else None  # ()
    kl_scale = (teacher.kl_weight / count.float()) if need_grad and teacher is not None else None  # ()
    grad_x = torch.empty_like(x) if need_grad else None  # (N, d)
    ce_sum = x.new_zeros((), dtype=torch.float32)
    kl_sum = None if teacher is None else x.new_zeros((), dtype=torch.float32)
    for s in range(0, x.shape[0], chunk):
        xc, tc = x[s:s + chunk], targets[s:s + chunk]  # (n, d), (n,)
        t = None if teacher is None else teacher.rows(s, s + chunk)  # (n, d), (V, d)
        part, kl_part, grad = _chunk_ce_and_grad(xc, w, tc, scale, cdtype, t, kl_scale, softcap)
        ce_sum = ce_sum + part
        if kl_part is not None:
            kl_sum = kl_sum + kl_part
        if grad is not None:
            g = grad.to(cdtype)  # (n, V)
            grad_x[s:s + chunk] = (g @ w).to(x.dtype)  # (n, d)
            if need_w:
                grad_w = _accumulate(grad_w, g.t(), xc.to(cdtype))  # (V, d) fp32
    return ce_sum / count, None if kl_sum is None else kl_sum / count, grad_x, grad_w


class FusedHeadCE(torch.autograd.Function):
    """total = sum_E w_E * mean CE(x_E @ W^T, targets_E) [+ k * mean KL(teacher || last exit)], chunked over
    tokens, gradients kept from the forward.

    ``apply(weight, chunk, exit_weights, targets_list, teacher, softcap, *xs)``: weight (V, d); each x (N, d) normed
    hidden of one exit with its targets (N,) in ``targets_list``; ``exit_weights`` a tuple of floats;
    ``teacher`` None or a flattened ``Teacher`` (hidden (N, d), head (V, d), k) for the last x;
    ``softcap`` the final logit softcapping (None: off).
    Returns (total (), per-exit CE (n_exits,), mean KL () (0 without a teacher)), the last two detached.
    """

    @staticmethod
    def forward(ctx, weight: Tensor, chunk: int, exit_weights: tuple[float, ...], targets_list: tuple[Tensor, ...],
                teacher: Teacher | None, softcap: float | None,
                *xs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        need_w = ctx.needs_input_grad[0]
        need = (need_w or any(ctx.needs_input_grad[6:]), need_w)
        cdtype = _compute_dtype(xs[0], weight)
        grad_w = None  # (V, d) fp32, from the first chunk's product on (no zero fill)
        grad_xs, losses = [], []
        kl = xs[0].new_zeros((), dtype=torch.float32)
        with torch.autocast(xs[0].device.type, enabled=False):  # dtypes are chosen explicitly above
            w = weight.to(cdtype)  # (V, d): cast once per forward, not per chunk
            t = None if teacher is None else replace(teacher, head=teacher.head.to(cdtype))
            for i, (w_e, x, targets) in enumerate(zip(exit_weights, xs, targets_list, strict=True)):
                last = i == len(xs) - 1
                ce, kl_e, grad_x, grad_w = _exit_pass(x, w, targets, w_e, chunk, cdtype, need, grad_w,
                                                      t if last else None, softcap)
                kl = kl if kl_e is None else kl_e
                losses.append(ce)
                grad_xs.append(grad_x)
        per_exit = torch.stack(losses)  # (n_exits,)
        total = sum(w_e * loss for w_e, loss in zip(exit_weights, losses, strict=True))  # (): no host-to-device copy
        if teacher is not None:
            total = total + teacher.kl_weight * kl
        ctx.mark_non_differentiable(per_exit, kl)
        ctx.save_for_backward(grad_w, *grad_xs)
        ctx.weight_dtype = weight.dtype
        ctx.done = False
        return total, per_exit, kl

    @staticmethod
    def backward(ctx, grad_total: Tensor, _grad_per_exit: Tensor, _grad_kl: Tensor):
        if ctx.done:  # the kept gradients are scaled in place below: a second backward would be wrong
            raise RuntimeError("FusedHeadCE supports one backward pass per forward (no retain_graph)")
        ctx.done = True
        grad_w, *grad_xs = ctx.saved_tensors
        g = grad_total.float()
        gw = grad_w.mul_(g).to(ctx.weight_dtype) if grad_w is not None else None  # (V, d)
        gxs = [gx.mul_(g.to(gx.dtype)) if gx is not None else None for gx in grad_xs]  # each (N, d)
        return (gw, None, None, None, None, None, *gxs)


def fused_head_ce(head: nn.Linear, xs: list[Tensor], targets: list[Tensor], exit_weights: list[float],
                  chunk: int, teacher: Teacher | None = None,
                  softcap: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Weighted total, per-exit CE and mean KL of ``head`` over normed hidden states xs[i] (B, T, d), targets (B, T).

    ``teacher`` (hidden (B, T, d), head (V, d), weight k) adds k * KL(teacher || the last x's
    distribution) to the total (mean over the tokens that have a target); without it the KL is 0. ``softcap``: the
    model's final logit softcapping (Gemma 3), or None.
    """
    flat_x = [x.reshape(-1, x.shape[-1]) for x in xs]  # each (N, d)
    flat_t = tuple(t.reshape(-1) for t in targets)  # each (N,)
    if teacher is not None:
        teacher = Teacher(teacher.hidden.reshape(-1, teacher.hidden.shape[-1]).detach(), teacher.head.detach(),
                          float(teacher.kl_weight))  # hidden (N, d)
    return FusedHeadCE.apply(head.weight, chunk, tuple(float(w) for w in exit_weights), flat_t, teacher, softcap,
                             *flat_x)


def _chunk_ce_sum(norm: nn.Module, head: nn.Module, h: Tensor, targets: Tensor, softcap: float | None = None) -> Tensor:
    logits = head(norm(h)).float()  # (n, V)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")


def checkpointed_head_ce(norm: nn.Module, head: nn.Module, h: Tensor, targets: Tensor, chunk: int,
                         softcap: float | None = None) -> Tensor:
    """Mean CE of ``head(norm(h))`` (h (B, T, d) un-normed, targets (B, T); ``softcap``: the logits capped as the
    model's own forward caps them), one checkpointed chunk at a time."""
    flat_h = h.reshape(-1, h.shape[-1])  # (N, d)
    flat_t = targets.reshape(-1)  # (N,)
    total = flat_h.new_zeros((), dtype=torch.float32)
    for s in range(0, flat_h.shape[0], chunk):
        hc, tc = flat_h[s:s + chunk], flat_t[s:s + chunk]  # (n, d), (n,)
        if torch.is_grad_enabled() and hc.requires_grad:
            total = total + checkpoint(_chunk_ce_sum, norm, head, hc, tc, softcap, use_reentrant=False)
        else:
            total = total + _chunk_ce_sum(norm, head, hc, tc, softcap)
    return total / (flat_t != IGNORE).sum()


def is_plain_head(head: nn.Module) -> bool:
    """True when the LM head is a bias-free ``nn.Linear`` whose weight is a whole tensor (fused path usable)."""
    weight = getattr(head, "weight", None)
    return (type(head) is nn.Linear and head.bias is None and isinstance(weight, Tensor)
            and weight.dim() == 2 and weight.numel() > 0 and not hasattr(weight, "ds_id"))
