"""The fused layer span: a runner's decoder layers over one sequence's T new rows in one C++ call (issue 44).

The eager layer loop (``infer.model.packed``) runs ~34 small torch ops a layer and the interpreter between them;
``LayerStack`` (``layer_span.cpp``) runs the same layers from C++, calling the kernel's norm, matmul and row attention
directly: bitwise what the loop computes (the stream, the KV rows, the cache lengths, the layer counters), in fp32 and
bf16, with masks (token trees) and skip plans. Measured and explained: docs/KERNELS.md, "The fused layer span".

Which runners take it is decided once, at construction (``for_runner``): the kernel loaded on its AVX-512 path for the
runner's dtype, on the CPU, Llama-shaped layers (no q/k norms, no post norms, no biases, SiLU, no sliding windows, the
plain RMSNorm). A call then runs fused unless it is outside what the C++ span does (``FusedSpan.__call__`` returns
None and the Python loop runs): more than ``MAX_TOKENS`` rows, T > 1 rows from an empty layer (a causal prefill:
SDPA), a mask that is not bool, autograd, ``torch.compile`` tracing. Packed forwards of several sequences, prompt
prefill (``bulk``) and other families keep the Python loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from infer import kernels

if TYPE_CHECKING:
    from infer.model.forward_model import ForwardModel
    from infer.model.kv_cache import KVCache
    from infer.model.plan import LayerPlan
    from infer.model.weights import LayerWeights

MAX_TOKENS = 32
"""Most rows a fused call takes (the kernel's decoding range; more rows are a prefill)."""


class FusedSpan:
    """A runner's layers as one ``LayerStack`` (the runner's own weight tensors, not copies)."""

    def __init__(self, runner: ForwardModel):
        s = runner.spec
        rows = [(w.attn_norm, w.qkv.matrix(), w.o.matrix(), w.mlp_norm, _weight(w.gate_up), _weight(w.down),
                 runner.rope_rows[i]) for i, w in enumerate(runner.layers)]
        scale = s.head_dim ** -0.5 if s.attn_scale is None else s.attn_scale  # infer.model.attention.score_scale
        self.stack = runner.kernel.LayerStack(rows, s.num_heads, s.num_kv_heads, s.head_dim, s.rms_norm_eps, scale)
        self.dtype = runner.dtype

    def __call__(self, cache: KVCache, hidden: Tensor, positions: Sequence[int] | Tensor, start: int, split: int,
                 end: int, plan: LayerPlan | None, mask: Tensor | None, rope: tuple[list[Tensor], list[Tensor]],
                 counts: list[int]) -> tuple[Tensor, Tensor] | None:
        """Layers ``[start, split)`` exactly, then ``[split, end)`` under ``plan``, over ``hidden`` (T, d) at RoPE
        ``positions`` with ``mask`` (T, W) bool or None, as ``Runner.span_rows`` of one segment: (the stream after
        ``split``, after ``end``), the K/V rows written, ``cache.lengths`` and ``counts`` (the runner's layer
        counters) advanced. ``rope``: the runner's (cos, sin) tables, one (n, D) per table. None: not a call the
        fused span takes (see the module docstring); nothing was touched."""
        T = hidden.shape[0]
        if not (1 <= T <= MAX_TOKENS and hidden.dtype == self.dtype and hidden.device.type == "cpu"
                and hidden.dim() == 2 and len(positions) == T):
            return None
        if mask is not None and (mask.dtype != torch.bool or mask.dim() != 2 or mask.device.type != "cpu"):
            return None
        if T > 1 and min(cache.lengths[min(start, split):max(split, end)], default=1) == 0:
            return None  # causal rows from slot 0: SDPA in the Python loop
        if (torch.is_grad_enabled() and hidden.requires_grad) or torch.compiler.is_compiling():
            return None
        pos = positions.tolist() if isinstance(positions, Tensor) else list(positions)
        skip_attn, skip_mlp = (None, None) if plan is None else (plan.skip_attn, plan.skip_mlp)
        return self.stack.span(hidden, pos, rope[0], rope[1], cache.k, cache.v, cache.lengths, counts, start, split,
                               end, skip_attn, skip_mlp, mask)


def _weight(linear) -> Tensor | None:
    return None if linear is None else linear.matrix()  # (out, in), or packed (G, in, 48)


def for_runner(runner: ForwardModel) -> FusedSpan | None:
    """The runner's fused span when its layers and kernel qualify (see the module docstring), else None."""
    module = runner.kernel
    if (module is None or not hasattr(module, "LayerStack") or module.path() != "avx512"
            or runner.device.type != "cpu" or not kernels.supports(module, runner.dtype)):
        return None
    s = runner.spec
    family = s.family
    if (family.norm_offset or family.qk_norm or family.sandwich_norms or family.activation != "silu"
            or any(s.window(i) is not None for i in range(s.num_layers)) or s.head_dim % 2 or s.head_dim > 256
            or (runner.dtype == torch.bfloat16 and s.hidden_size % 16)):  # (the bf16 row norm's condition)
        return None
    if not all(_plain(w, runner.dtype) for w in runner.layers):
        return None
    return FusedSpan(runner)


def _plain(w: LayerWeights, dtype: torch.dtype) -> bool:
    """Whether a layer is Llama-shaped on the kernel: no biases, no extra norms, every matmul the kernel's, every
    norm weight in the model dtype."""
    linears = [w.qkv, w.o] + ([] if w.gate_up is None else [w.gate_up, w.down])
    norms = [w.attn_norm] + ([] if w.gate_up is None else [w.mlp_norm])
    extra = (w.q_norm, w.k_norm, w.post_attn_norm, w.post_mlp_norm)
    return (all(m is not None and m.kernel is not None and m.bias is None for m in linears)
            and all(n is not None and n.dtype == dtype and n.dim() == 1 for n in norms)
            and all(e is None for e in extra) and (w.gate_up is None) == (w.down is None))
