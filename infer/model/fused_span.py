"""The fused executor: a program's decoder layers over packed rows of one or several sequences in one C++ call.

The eager layer loop (``infer.model.loop``) runs ~34 small torch ops a layer and the interpreter between them;
``LayerStack`` (``layer_span.cpp``) runs the same program from C++: the norms, projections and MLP once over all N
rows (one weight stream for the whole batch), the attention per segment over its own cache, with its positions, mask
and each layer's sliding window. It is bitwise what the loop computes (the streams, the K/V rows, the windowed layers'
slot positions; the runner advances the cache lengths and the layer counters after either), in fp32 and bf16, for
every family (Llama, Mistral, Qwen2 with biases, Qwen3's q/k norms, Gemma 3's (1 + w) and post norms, GELU-tanh and
windows, SmolLM3's layers without RoPE), with masks (token trees), skip plans and observed layers. Measured and
explained: docs/KERNELS.md, "The fused layer span".

Which runners take it is decided once, at construction (``for_runner``; ``unfit`` says why not): the kernel loaded on
its AVX-512 path for the runner's dtype, on the CPU, every matmul on the kernel (a float one, or a quantized draft
copy's int8 / int4 codes on ``quant.cpp``'s matmul: ``QuantLinear``), a head dim the row attention takes.
A program then runs fused unless its rows are outside what the C++ does (``FusedSpan.run`` returns ``Declined`` with
the reason and the next executor runs it): a prompt prefill on BLAS (``BULK`` rows), a segment of more than
``MAX_TOKENS`` rows, T > 1 rows of a segment from an empty layer (a causal prefill: SDPA), two segments over one
cache, a mask that is not a CPU bool matrix, autograd, ``torch.compile`` tracing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from infer import kernels
from infer.model.program import BULK, Declined, Output, Program, Rows, Segment, Step
from infer.model.quant_weights import QuantLinear
from infer.model.stack import Stack
from infer.model.weights import LayerWeights, Linear

MAX_TOKENS = 32
"""Most rows a segment of a fused call takes (the kernel's decoding range; more rows are a prefill)."""

BULK_ROWS = Declined("fused: a prompt prefill on BLAS")
ROWS = Declined(f"fused: not 1 to {MAX_TOKENS} rows a sequence in the runner's dtype on the CPU")
SHARED = Declined("fused: two segments over one cache")
MASK = Declined("fused: a mask that is not a CPU bool matrix")
CAUSAL = Declined("fused: causal rows from an empty layer (a prefill: SDPA)")
TRACED = Declined("fused: autograd or torch.compile tracing")


class FusedSpan:
    """A runner's layers as one ``LayerStack`` (the runner's own weight tensors, not copies): the fused executor."""

    name = "fused"

    def __init__(self, runner: Stack):
        s = runner.spec
        layers = [_layer(w, runner.rope_rows[i], s.window(i)) for i, w in enumerate(runner.layers)]
        scale = s.head_dim ** -0.5 if s.attn_scale is None else s.attn_scale  # infer.model.attention.score_scale
        self.stack = runner.kernel.LayerStack(layers, s.num_heads, s.num_kv_heads, s.head_dim, s.rms_norm_eps, scale,
                                              s.family.norm_offset, s.family.activation != "silu")
        self.owner = runner
        """The runner whose layers these are: its RoPE tables and head."""
        self.dtype = runner.dtype
        self.runs = 0
        """Programs run fused (tests and benches read it to see the fused executor did the work)."""
        self.rows = 0
        """Rows of those programs."""
        self.packed = 0
        """Programs run fused over several sequences."""

    def declines(self, program: Program, rows: Rows) -> Declined | None:
        """Why the C++ does not run ``program`` over ``rows`` (see the module docstring), or None."""
        if rows.kind == BULK:
            return BULK_ROWS
        hidden, segments = rows.hidden, rows.segments
        if not (hidden.dtype == self.dtype and hidden.device.type == "cpu" and hidden.dim() == 2
                and all(1 <= s.size <= MAX_TOKENS for s in segments)
                and sum(s.size for s in segments) == hidden.shape[0]):
            return ROWS
        if len(segments) > 1 and len({id(s.cache) for s in segments}) < len(segments):
            return SHARED
        if any(s.mask is not None and (s.mask.dtype != torch.bool or s.mask.dim() != 2 or s.mask.device.type != "cpu")
               for s in segments):
            return MASK
        attention = program.attention_layers
        if attention and any(s.size > 1 and min(s.cache.lengths[i] for i in attention) == 0 for s in segments):
            return CAUSAL  # causal rows from slot 0: SDPA in the Python loop
        if (torch.is_grad_enabled() and hidden.requires_grad) or torch.compiler.is_compiling():
            return TRACED
        return None

    def run(self, program: Program, rows: Rows) -> Output | Declined:
        """The program over ``rows`` as ``infer.model.loop`` runs it, in one C++ call: the K/V rows (and a windowed
        layer's slot positions) written past each segment's lengths, which the runner then advances, as it advances
        the counters. ``Declined``: nothing was touched."""
        why = self.declines(program, rows)
        if why is not None:
            return why
        walk = [4 * x.layer + 2 * x.attn + x.mlp if type(x) is Step else -1 - x for x in program.walk]
        cos, sin = self.owner.rope_tables
        kept, hidden = self.stack.run(rows.hidden, walk, [_segment(s) for s in rows.segments], cos, sin)
        self.runs += 1
        self.rows += rows.size
        self.packed += len(rows.segments) > 1
        head = self.owner.head(hidden, program.vocab) if program.logits else None
        return program.output(hidden, dict(zip(program.cuts, kept, strict=True)), head)


def _segment(s: Segment) -> tuple:
    """A segment as ``LayerStack.run`` reads it: (T, positions, k, v, slot positions, lengths, mask)."""
    pos = s.positions.tolist() if isinstance(s.positions, Tensor) else list(s.positions)
    c = s.cache
    return len(pos), pos, c.k, c.v, c.pos, c.lengths, s.mask


def _layer(w: LayerWeights, rope: int, window: int | None) -> dict:
    """A layer as ``LayerStack`` holds it: its tensors (the matrices as the kernel reads them), RoPE table, window."""
    def matrix(m: Linear | QuantLinear | None) -> Tensor | tuple | None:
        return None if m is None else m.matrix()  # (out, in), packed (G, in, 48), or quantized (codes, scales, ...)

    return {"attn_norm": w.attn_norm, "qkv": matrix(w.qkv), "qkv_bias": w.qkv.bias, "o": matrix(w.o),
            "o_bias": w.o.bias, "q_norm": w.q_norm, "k_norm": w.k_norm, "post_attn_norm": w.post_attn_norm,
            "mlp_norm": w.mlp_norm, "gate_up": matrix(w.gate_up), "down": matrix(w.down),
            "post_mlp_norm": w.post_mlp_norm, "rope": rope, "window": window or 0}


def for_runner(runner: Stack) -> FusedSpan | None:
    """The runner's fused executor when its layers and kernel qualify (see the module docstring), else None."""
    return FusedSpan(runner) if unfit(runner) is None else None


def unfit(runner: Stack) -> str | None:
    """Why ``runner`` has no fused executor (``fused: ...``, for a bench to print), or None when it qualifies."""
    module = runner.kernel
    if (module is None or not hasattr(module, "LayerStack") or module.path() != "avx512"
            or runner.device.type != "cpu" or not kernels.supports(module, runner.dtype)):
        return "fused: no AVX-512 kernel for the runner's dtype on a CPU"
    s = runner.spec
    if s.head_dim % 2 or s.head_dim > 256:
        return f"fused: head dim {s.head_dim} (the row attention takes even head dims up to 256)"
    if s.family.activation not in ("silu", "gelu_tanh"):
        return f"fused: activation {s.family.activation}"
    for i, w in enumerate(runner.layers):
        why = _layer_unfit(w, runner.dtype, torch.float32 if s.family.norm_offset else runner.dtype)
        if why is not None:
            return f"fused: layer {i}: {why}"
    return None


def _layer_unfit(w: LayerWeights, dtype: torch.dtype, norm_dtype: torch.dtype) -> str | None:
    """Why one layer does not run fused (a matmul off the kernel, a tensor in another dtype), or None."""
    linears = {"q/k/v": w.qkv, "o": w.o, "gate/up": w.gate_up, "down": w.down}
    for name, m in linears.items():
        if m is None and name in ("q/k/v", "o"):
            return f"no {name} projection"
        if isinstance(m, QuantLinear) and (m.matrix() is None or m.dtype != dtype):
            return f"the {name} projection is quantized off the kernel (the rows layout, or another dtype)"
        if not isinstance(m, QuantLinear) and m is not None and (m.kernel is None or m.dtype != dtype):
            return f"the {name} projection runs on F.linear (bf16 with an odd input width, or another dtype)"
        if m is not None and m.bias is not None and (m.bias.dtype != dtype or m.bias.dim() != 1
                                                     or not m.bias.is_contiguous() or name in ("gate/up", "down")):
            return f"the {name} projection's bias"
    if (w.gate_up is None) != (w.down is None) or (w.gate_up is None) != (w.mlp_norm is None):
        return "an MLP without its three tensors"
    norms = (w.attn_norm, w.mlp_norm, w.q_norm, w.k_norm, w.post_attn_norm, w.post_mlp_norm)
    if any(n is not None and (n.dtype != norm_dtype or n.dim() != 1 or not n.is_contiguous()) for n in norms):
        return f"a norm weight not a contiguous {norm_dtype} vector"
    if (w.q_norm is None) != (w.k_norm is None):
        return "a q norm without a k norm"
    return None
