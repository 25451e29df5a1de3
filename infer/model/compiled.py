"""The per-layer steps of a static forward, run as they are or through ``torch.compile``, and a count of the kernels a
call launches.

One compiled function per sublayer kind, shared by every layer (the layer's weights are arguments, not
constants), so a model compiles a handful of graphs, not one per layer. The row count and the cache capacity are
dynamic from the first compile (``maybe_mark_dynamic``, with size-1 rows not specialised), so a model's decoding makes
two graphs: one attention step, one MLP step, whatever the buckets, window widths and cache sizes. Call them in one
grad mode: the engine's entry points (``generate``, ``start``, ``step``, ``target_logits``) and the measuring tools
run under ``torch.no_grad()``, since dynamo guards on the grad mode and a call in another compiles again. Not
``torch.inference_mode()``: its tensors (the pooled KV caches) cannot be written outside it afterwards, and its
tensors differ from ordinary ones in dispatch keys, which dynamo guards on too. ``StepCache`` shares the compiled
steps among runners of the same model geometry, dtype and device (their graphs are the same), so a second runner
of a model compiles nothing. Inductor fuses each RMSNorm, the RoPE rotation and the residual adds into single
kernels. The matmuls: on the CPU kernel's AVX-512 path the kernel's own (``infer.kernels.panels.traced_matmul``, one
opaque operator in the graph), elsewhere inductor's (the steps pass ``bulk``: torch's matmul); a compiled forward
equals the uncompiled one within rounding, not bitwise (inductor fuses the norms and RoPE its own way).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable

import torch
from torch import Tensor

from infer.model import layer_math
from infer.model.attention import grouped_attention
from infer.model.stack import Stack
from infer.model.weights import LayerWeights

BACKENDS = ("inductor", "eager")
"""``torch.compile`` backends a ``LayerSteps`` takes: inductor (fused kernels: the GPU default), eager (dynamo traces
and guards, the graph runs as traced: counts graphs in seconds on a CPU, for tests and rehearsals)."""


def attention_step(runner: Stack, w: LayerWeights, hidden: Tensor, cos: Tensor, sin: Tensor,
                   window_start: Tensor, offsets: Tensor, mask: Tensor, k: Tensor, v: Tensor, bulk: bool) -> Tensor:
    """One attention sublayer over a cache layer's whole capacity: new K/V written at slots ``window_start`` (0-dim)
    + ``offsets`` (rows,) of ``k``, ``v`` (Hkv, C, D); ``mask`` (G rows, C) additive, shared by a group's layers."""
    s = runner.spec
    rows = hidden.shape[0]
    q, kn, vn = runner.qkv_rope(w, hidden, cos, sin, bulk)  # (Hq, rows, D), (Hkv, rows, D), (Hkv, rows, D)
    write = window_start + offsets  # (rows,) cache slots of the new rows
    k.index_copy_(1, write, kn)
    v.index_copy_(1, write, vn)
    # copies in contiguous layout: a reshape of a strided tensor is a view at one row and a copy at more, which
    # would make dynamo specialise on the row count (the copies fuse into neighbouring kernels)
    out = grouped_attention(_dense(q), k, v, mask, s.attn_scale)  # (Hq, rows, D)
    out = _dense(out.transpose(0, 1)).view(rows, s.num_heads * s.head_dim)  # (rows, Hq D)
    return layer_math.attention_out(s, w, hidden, out, bulk)  # (rows, d): o, the family's post-norm, residual


def _dense(x: Tensor) -> Tensor:
    return x.clone(memory_format=torch.contiguous_format)


def mlp_step(runner: Stack, w: LayerWeights, hidden: Tensor, bulk: bool) -> Tensor:
    return runner.mlp(w, hidden, bulk)


ATTENTION_DYNAMIC = {2: (0,), 3: (0,), 4: (0,), 6: (0,), 7: (0, 1), 8: (1,), 9: (1,)}
"""Argument index -> dynamic dims of ``attention_step``: rows of hidden, cos, sin, offsets, the mask (G rows, C) and
the capacity of k, v."""
MLP_DYNAMIC = {2: (0,)}
"""Argument index -> dynamic dims of ``mlp_step``: the rows."""


def _size_oblivious():
    """Size-1 rows not specialised at compile time (``torch.fx.experimental._config.backed_size_oblivious``; where
    a torch lacks it, a size-1 row count compiles its own graph once)."""
    from torch.fx.experimental import _config

    if hasattr(_config, "backed_size_oblivious"):
        return _config.patch(backed_size_oblivious=True)
    return contextlib.nullcontext()


class DynamicStep:
    """A compiled step whose listed dims are dynamic from its first compile."""

    def __init__(self, compiled: Callable, dynamic: dict[int, tuple[int, ...]]):
        self.compiled, self.dynamic = compiled, dynamic

    def __call__(self, *args):
        for index, dims in self.dynamic.items():
            for dim in dims:
                torch._dynamo.maybe_mark_dynamic(args[index], dim)
        with _size_oblivious():
            return self.compiled(*args)


class LayerSteps:
    """The sublayer steps of a static forward, compiled with ``backend`` when ``compile``. ``compiles`` counts the
    graphs dynamo has compiled for them (each costs seconds with inductor: none should happen in a timed run)."""

    def __init__(self, compile: bool, backend: str = "inductor"):
        if backend not in BACKENDS:
            raise ValueError(f"unknown compile backend {backend!r}; use one of {', '.join(BACKENDS)}")
        self.compile, self.backend = compile, backend
        self.compiles = 0
        self._steps: dict[str, Callable] = {}
        self.attention = self.step("attention", attention_step, ATTENTION_DYNAMIC)
        self.mlp = self.step("mlp", mlp_step, MLP_DYNAMIC)

    def step(self, kind: str, fn: Callable, dynamic: dict[int, tuple[int, ...]]) -> Callable:
        """``fn`` as this object runs it (compiled once per ``kind``, ``dynamic``: argument index -> dims dynamic
        from the first compile); a layer kind beyond attention and MLP (an exit adapter's) is added the same way."""
        if not self.compile:
            return fn
        if kind not in self._steps:
            own = _own_copy(fn, f"{fn.__name__}_{id(self):x}")
            self._steps[kind] = DynamicStep(torch.compile(own, backend=self._backend, dynamic=None), dynamic)
        return self._steps[kind]

    def _backend(self, graph, example_inputs):
        self.compiles += 1
        if self.backend == "eager":
            return graph.forward
        from torch._inductor.compile_fx import compile_fx  # inductor's entry, as torch.compile's default backend

        return compile_fx(graph, example_inputs)


def step_key(runner: Stack) -> tuple:
    """What fixes a runner's compiled steps: its layer geometry and family math, whether its projections carry
    biases, dtype and device (runners equal in these trace the same graphs)."""
    s, w = runner.spec, runner.layers[0]
    biases = tuple(getattr(w, name).bias is not None for name in ("qkv", "o", "gate_up", "down"))
    return (type(runner), s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate_size,
            s.rms_norm_eps, biases, runner.dtype, runner.device, s.family, s.attn_scale)


class StepCache:
    """Compiled steps shared by every runner of the same model geometry, dtype and device: pass one object as the
    runners' ``compile`` (``Runner(..., compile=StepCache())``), so a second runner of a model reuses the first's
    graphs instead of compiling its own. Kept by whoever makes the runners (a check, a benchmark), not globally."""

    def __init__(self, backend: str = "inductor"):
        self.backend = backend
        self._steps: dict[tuple, LayerSteps] = {}

    def steps(self, runner: Stack) -> LayerSteps:
        key = step_key(runner)
        if key not in self._steps:
            self._steps[key] = LayerSteps(True, self.backend)
        return self._steps[key]

    def counts(self) -> dict[str, int]:
        """Graphs compiled per step set, named by geometry, dtype and device (e.g. '64x4/2 float32 cpu')."""
        return {f"{k[1]}x{k[2]}/{k[3]}{' biased' if any(k[7]) else ''} {str(k[8]).removeprefix('torch.')} {k[9]}":
                steps.compiles
                for k, steps in self._steps.items()}

    @property
    def compiles(self) -> int:
        """Graphs compiled for every runner that used this cache so far."""
        return sum(steps.compiles for steps in self._steps.values())


VIEWS = ("aten::select", "aten::slice", "aten::view", "aten::transpose", "aten::unsqueeze", "aten::reshape",
         "aten::expand", "aten::as_strided", "aten::detach", "aten::lift_fresh", "aten::chunk", "aten::split",
         "aten::empty", "TorchDynamo Cache Lookup")
"""Operators that launch no kernel (views, allocations, dynamo's guard check), left out of the CPU count."""


def _own_copy(fn, name: str):
    """``fn`` over a code object of its own, named ``name``: dynamo keeps its compiled graphs, and its recompile
    limit (8), per code object and backend, so step sets sharing ``fn``'s would evict each other and silently fall
    back to eager after a few; and it remembers which sizes changed (automatic dynamic, profile-guided) per file,
    line and name, so without a name of its own a step set would start from another's sizes and compile again."""
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


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
