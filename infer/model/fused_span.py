"""The fused executor: a program's decoder layers over one sequence's T new rows in C++ calls (issue 44).

The eager layer loop (``infer.model.loop``) runs ~34 small torch ops a layer and the interpreter between them;
``LayerStack`` (``layer_span.cpp``) runs the same layers from C++, calling the kernel's norm, matmul and row attention
directly: bitwise what the loop computes (the stream, the KV rows; the runner advances the cache lengths and the layer
counters after either), in fp32 and bf16, with masks (token trees) and skip plans. A program's observed layers cut
the span into one call per piece. Measured and explained: docs/KERNELS.md, "The fused layer span".

Which runners take it is decided once, at construction (``for_runner``; ``unfit`` says why not): the kernel loaded on
its AVX-512 path for the runner's dtype, on the CPU, Llama-shaped layers (no q/k norms, no post norms, no biases, SiLU,
no sliding windows, the plain RMSNorm). A program then runs fused unless its rows are outside what the C++ span does
(``FusedSpan.run`` returns ``Declined`` with the reason and the next executor runs it): several sequences, a prompt
prefill on BLAS (``BULK`` rows), more than ``MAX_TOKENS`` rows, T > 1 rows from an empty layer (a causal prefill:
SDPA), a mask that is not bool, autograd, ``torch.compile`` tracing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from infer import kernels
from infer.model.program import BULK, Declined, Output, Program, Rows
from infer.model.stack import Stack
from infer.model.weights import LayerWeights

MAX_TOKENS = 32
"""Most rows a fused call takes (the kernel's decoding range; more rows are a prefill)."""


SEVERAL = Declined("fused: several sequences (the C++ span runs one)")
BULK_ROWS = Declined("fused: a prompt prefill on BLAS")
ROWS = Declined(f"fused: not 1 to {MAX_TOKENS} rows of the runner's dtype on the CPU")
MASK = Declined("fused: a mask that is not a CPU bool matrix")
CAUSAL = Declined("fused: causal rows from an empty layer (a prefill: SDPA)")
TRACED = Declined("fused: autograd or torch.compile tracing")


class FusedSpan:
    """A runner's layers as one ``LayerStack`` (the runner's own weight tensors, not copies): the fused executor."""

    name = "fused"

    def __init__(self, runner: Stack):
        s = runner.spec
        rows = [(w.attn_norm, w.qkv.matrix(), w.o.matrix(), w.mlp_norm, _weight(w.gate_up), _weight(w.down),
                 runner.rope_rows[i]) for i, w in enumerate(runner.layers)]
        scale = s.head_dim ** -0.5 if s.attn_scale is None else s.attn_scale  # infer.model.attention.score_scale
        self.stack = runner.kernel.LayerStack(rows, s.num_heads, s.num_kv_heads, s.head_dim, s.rms_norm_eps, scale)
        self.owner = runner
        """The runner whose layers these are: its RoPE tables and head."""
        self.dtype = runner.dtype

    def declines(self, program: Program, rows: Rows) -> Declined | None:
        """Why the C++ span does not run ``program`` over ``rows`` (see the module docstring), or None."""
        if len(rows.segments) != 1:
            return SEVERAL
        if rows.kind == BULK:
            return BULK_ROWS
        hidden, seg = rows.hidden, rows.segments[0]
        T, mask = hidden.shape[0], seg.mask
        if not (1 <= T <= MAX_TOKENS and hidden.dtype == self.dtype and hidden.device.type == "cpu"
                and hidden.dim() == 2 and seg.size == T):
            return ROWS
        if mask is not None and (mask.dtype != torch.bool or mask.dim() != 2 or mask.device.type != "cpu"):
            return MASK
        if T > 1 and min(seg.cache.lengths[program.start:program.end], default=1) == 0:
            return CAUSAL  # causal rows from slot 0: SDPA in the Python loop
        if (torch.is_grad_enabled() and hidden.requires_grad) or torch.compiler.is_compiling():
            return TRACED
        return None

    def run(self, program: Program, rows: Rows) -> Output | Declined:
        """The program over one sequence's rows, as ``infer.model.loop`` runs it: layers ``[start, exact_until)``
        exactly, then ``[exact_until, end)`` under the plan, one C++ call per piece between observed layers; the K/V
        rows written (the runner advances the lengths and counters). ``Declined``: nothing was touched."""
        why = self.declines(program, rows)
        if why is not None:
            return why
        seg, plan, split = rows.segments[0], program.plan, program.exact_until
        cache, mask = seg.cache, seg.mask
        skip_attn, skip_mlp = (None, None) if plan is None else (plan.skip_attn, plan.skip_mlp)
        lengths, counts = list(cache.lengths), [0] * len(cache.lengths)  # the C++ call's: the runner's advance after
        pos, (cos, sin) = rows.host_positions(), self.owner.rope_tables
        bounds = sorted({program.start, *program.observe, program.end})
        hidden, kept = rows.hidden, {}
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):  # one call per piece between observed layers
            kept[a] = hidden
            at, hidden = self.stack.span(hidden, pos, cos, sin, cache.k, cache.v, lengths, counts, a,
                                         min(max(split, a), b), b, skip_attn, skip_mlp, mask)  # (T, d) x 2
            if a < split < b:
                kept[split] = at
        kept[program.end] = hidden
        head = self.owner.head(hidden, program.vocab) if program.logits else None
        return program.output(hidden, kept, head)


def _weight(linear) -> Tensor | None:
    return None if linear is None else linear.matrix()  # (out, in), or packed (G, in, 48)


def for_runner(runner: Stack) -> FusedSpan | None:
    """The runner's fused span when its layers and kernel qualify (see the module docstring), else None."""
    return FusedSpan(runner) if unfit(runner) is None else None


def unfit(runner: Stack) -> str | None:
    """Why ``runner`` has no fused span (``fused: ...``), or None when its layers and kernel qualify."""
    module = runner.kernel
    if (module is None or not hasattr(module, "LayerStack") or module.path() != "avx512"
            or runner.device.type != "cpu" or not kernels.supports(module, runner.dtype)):
        return "fused: no AVX-512 kernel for the runner's dtype on a CPU"
    s = runner.spec
    family = s.family
    if (family.norm_offset or family.qk_norm or family.sandwich_norms or family.activation != "silu"
            or any(s.window(i) is not None for i in range(s.num_layers)) or s.head_dim % 2 or s.head_dim > 256
            or (runner.dtype == torch.bfloat16 and s.hidden_size % 16)):  # (the bf16 row norm's condition)
        return "fused: layers that are not Llama-shaped (norm flavour, q/k or post norms, activation, windows, shapes)"
    if not all(_plain(w, runner.dtype) for w in runner.layers):
        return "fused: a layer with biases, extra norms or a matmul off the kernel"
    return None


def _plain(w: LayerWeights, dtype: torch.dtype) -> bool:
    """Whether a layer is Llama-shaped on the kernel: no biases, no extra norms, every matmul the kernel's, every
    norm weight in the model dtype."""
    linears = [w.qkv, w.o] + ([] if w.gate_up is None else [w.gate_up, w.down])
    norms = [w.attn_norm] + ([] if w.gate_up is None else [w.mlp_norm])
    extra = (w.q_norm, w.k_norm, w.post_attn_norm, w.post_mlp_norm)
    return (all(m is not None and m.kernel is not None and m.bias is None for m in linears)
            and all(n is not None and n.dtype == dtype and n.dim() == 1 for n in norms)
            and all(e is None for e in extra) and (w.gate_up is None) == (w.down is None))
