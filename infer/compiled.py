"""The per-layer steps of a static forward, run as they are or through ``torch.compile`` (inductor), and a count
of the kernels a decoding forward launches per layer.

One compiled function per sublayer kind, shared by every layer (the layer's weights are arguments, not
constants), so a model compiles a handful of graphs, not one per layer: the first call compiles for its shapes,
a call with other row or cache sizes compiles once more with those sizes dynamic, and later sizes reuse it.
Inductor fuses each RMSNorm, the RoPE rotation and the residual adds into single kernels. What it cannot see
through (the CPU small-matmul kernel) is not used here: compiled matmuls are inductor's, so a compiled forward
equals the uncompiled one within rounding, not bitwise.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from infer.attention import grouped_attention

if TYPE_CHECKING:
    from infer.forward_model import ForwardModel
    from infer.weights import LayerWeights


def attention_step(runner: ForwardModel, w: LayerWeights, hidden: Tensor, cos: Tensor, sin: Tensor, write: Tensor,
                   mask: Tensor, k: Tensor, v: Tensor, bulk: bool) -> Tensor:
    """One attention sublayer over a cache layer's whole capacity: new K/V written at slots ``write`` (rows,) of
    ``k``, ``v`` (Hkv, C, D); ``mask`` (G rows, C) additive, shared by the layers of a group."""
    s = runner.spec
    rows = hidden.shape[0]
    q, kn, vn = runner.qkv_rope(w, hidden, cos, sin, bulk)  # (Hq, rows, D), (Hkv, rows, D), (Hkv, rows, D)
    k.index_copy_(1, write, kn)
    v.index_copy_(1, write, vn)
    out = grouped_attention(q, k, v, mask)  # (Hq, rows, D)
    return hidden + w.o(out.transpose(0, 1).reshape(rows, s.num_heads * s.head_dim), bulk)  # (rows, d)


def mlp_step(runner: ForwardModel, w: LayerWeights, hidden: Tensor, bulk: bool) -> Tensor:
    return runner.mlp(w, hidden, bulk)


class LayerSteps:
    """The two sublayer steps of a static forward; compiled when ``compile``. ``compiles`` counts the graphs
    inductor has compiled for them (each costs seconds: none should happen in a timed run)."""

    def __init__(self, compile: bool):
        self.compile = compile
        self.compiles = 0
        if compile:
            self.attention = torch.compile(_own_copy(attention_step), backend=self._inductor, dynamic=None)
            self.mlp = torch.compile(_own_copy(mlp_step), backend=self._inductor, dynamic=None)
        else:
            self.attention, self.mlp = attention_step, mlp_step

    def _inductor(self, graph, example_inputs):
        from torch._inductor.compile_fx import compile_fx  # inductor's entry, as torch.compile's default backend

        self.compiles += 1
        return compile_fx(graph, example_inputs)


VIEWS = ("aten::select", "aten::slice", "aten::view", "aten::transpose", "aten::unsqueeze", "aten::reshape",
         "aten::expand", "aten::as_strided", "aten::detach", "aten::lift_fresh", "aten::chunk", "aten::split",
         "aten::empty", "TorchDynamo Cache Lookup")
"""Operators that launch no kernel (views, allocations, dynamo's guard check), left out of the CPU count."""


def _own_copy(fn):
    """``fn`` over a code object of its own: dynamo keeps its compiled graphs, and its recompile limit (8), per
    code object and backend, so executors sharing ``fn``'s would evict each other and silently fall back to
    eager after a few runners."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def count_kernels(fn, device: torch.device) -> int:
    """Kernels ``fn()`` launches on ``device``: on CUDA the kernels the profiler records; elsewhere a stand-in, the
    top-level operators that do work, with each compiled region counted once (its fused kernels are invisible
    to the CPU profiler, so a compiled count is a lower bound there)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    if cuda:
        return sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for e in events if e.cpu_parent is None and not e.name.startswith(VIEWS))


def kernels_per_layer(runner: ForwardModel, prompt: int = 16) -> float:
    """Kernels per layer of one decode step (one row through every layer, with the LM head) on the runner's
    executor, after two warm-up steps (compiling and capturing happen there, not in the count)."""
    cache = runner.new_cache(max(256, prompt + 64))
    ids = torch.arange(prompt, device=runner.device) % runner.spec.vocab_size
    runner.forward_layers(cache, runner.embed(ids), ids)
    one = runner.embed(ids[:1])  # (1, d)

    def step():
        runner.span(cache, one, [prompt], 0, runner.num_layers, logits=True)
        cache.rollback(prompt)

    step()
    step()
    return count_kernels(step, runner.device) / runner.num_layers
