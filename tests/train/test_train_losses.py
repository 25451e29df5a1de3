"""train.losses.FusedHeadCE's memory traffic: the head weight cast once per forward, no (V, d) fp32 temporary per chunk,
and the bf16 head gradient accumulated as before (chunk products upcast and summed in order). Its equality with plain
cross-entropy is tested in tests/train/test_train_fast_forward.py."""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from train.data import IGNORE
from train.losses import _chunk_ce_and_grad, fused_head_ce

V, D, N = 96, 32, 40


class HeadSized(TorchDispatchMode):
    """Counts the ops that make a new (V, D) tensor: casts of the fp32 head weight to a lower dtype, and fp32
    results (the first chunk's upcast product is the accumulator)."""

    def __init__(self):
        super().__init__()
        self.casts = 0
        self.fp32_new = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inplace = func._schema.name.endswith("_") or any(a.is_out for a in func._schema.arguments)
        if isinstance(out, torch.Tensor) and tuple(out.shape) == (V, D) and not inplace:
            if func is torch.ops.aten._to_copy.default and out.dtype != torch.float32:
                self.casts += 1  # the fp32 head weight to the compute dtype
            if out.dtype == torch.float32 and func not in (torch.ops.aten.t.default, torch.ops.aten.detach.default):
                self.fp32_new += 1
        return out


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    head = nn.Linear(D, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g) * 0.2)
    xs = [torch.randn(N, D, generator=g, requires_grad=True) for _ in range(2)]
    targets = [torch.randint(0, V, (N,), generator=g) for _ in range(2)]
    targets[1][::5] = IGNORE
    return head, xs, targets


@pytest.mark.parametrize("chunk", [7, 16])
def test_bf16_forward_casts_the_head_once_and_keeps_one_fp32_head_sized_tensor(chunk):
    head, xs, targets = _inputs()
    with HeadSized() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
        total, _, _ = fused_head_ce(head, xs, targets, [0.4, 0.6], chunk)
    assert seen.casts == 1  # two exits x several chunks, one cast
    assert seen.fp32_new == 1  # the gradient accumulator; every later chunk is added in place
    total.backward()
    assert head.weight.grad.dtype == torch.float32


def test_fp32_forward_makes_no_cast_and_one_accumulator():
    head, xs, targets = _inputs(1)
    with HeadSized() as seen:
        fused_head_ce(head, xs, targets, [0.4, 0.6], 7)
    assert seen.casts == 0 and seen.fp32_new == 1


def test_bf16_head_gradient_is_the_in_order_sum_of_upcast_chunk_products():
    """Numerics unchanged: each chunk's bf16 product g^T x, upcast to fp32, summed chunk by chunk, exit by exit."""
    head, xs, targets = _inputs(2)
    exit_weights, chunk = [0.4, 0.6], 16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total, _, _ = fused_head_ce(head, xs, targets, exit_weights, chunk)
    total.backward()
    w = head.weight.detach().to(torch.bfloat16)  # (V, D)
    want = torch.zeros(V, D)
    for w_e, x, t in zip(exit_weights, xs, targets, strict=True):
        scale = w_e / (t != IGNORE).sum().float()
        for s in range(0, N, chunk):
            xc = x.detach()[s:s + chunk]
            _, _, grad = _chunk_ce_and_grad(xc, w, t[s:s + chunk], scale, torch.bfloat16)  # (n, V)
            want += (grad.to(torch.bfloat16).t() @ xc.to(torch.bfloat16)).float()
    assert torch.equal(head.weight.grad, want)
