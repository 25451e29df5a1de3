"""The checkpoint's weights as the runner uses them: q/k/v and gate/up fused into single matmuls, the small-matmul
CPU kernel where it applies, and the RMSNorm both the runner and its static forwards call."""

from __future__ import annotations

import glob
import hashlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor

from infer import kernels
from infer.kernels import arena, panels
from layerskip_core.adapter_spec import FINGERPRINT_VALUES, weight_fingerprint
from layerskip_core.errors import UserError
from layerskip_core.models import ModelSpec

CONTRACT_DOC = "docs/KERNELS.md, 'Where the exactness contract holds'"
"""Where the exactness contract and the shapes and paths outside it are written down."""


TORCH_BULK_ROWS = 32
"""Rows from which a bf16 prefill's matmul runs on torch's (AMX) rather than the panels (``Linear.bulk_on_torch``)."""


class ExactnessWarning(UserWarning):
    """A model loaded where a T-token verification may round differently from one-token decoding, so a drafter's
    greedy output may differ from plain decoding where two tokens nearly tie (``CONTRACT_DOC``)."""


def kernel_takes(weight: Tensor) -> bool:
    """Whether the kernel's matmuls take a matrix (out, in) of this width: any width in fp32 (the panels read one k
    at a time, the AVX2 path loads a row's last in % 8 values masked), an even input width in bf16 (the panels pair
    k)."""
    return weight.dim() == 2 and (weight.dtype != torch.bfloat16 or weight.shape[1] % 2 == 0)


class Linear:
    """y = x @ W^T (+ b), W (out, in) as in HF checkpoints.

    On x86 CPUs in fp32, and in bf16 where the CPU has AVX512_BF16, it runs the small-batch kernel of
    ``infer.kernels`` (any width in fp32, even input widths in bf16: ``kernel_takes``): verifying T tokens then costs
    little more than one, and every row's result is bitwise independent of T, so a batched verification reproduces
    token-by-token decoding exactly. On the kernel's AVX-512
    path the kernel reads W packed in panels (``panels``, ``infer.kernels.panels``; prompt prefill too in fp32: measured
    faster than torch's matmul there, docs/KERNELS.md; a bf16 prefill on an AMX CPU runs on torch's,
    ``bulk_on_torch``), placed in ``infer.kernels.arena`` right after the previously
    built one (a step reads them as one stream), and are the only copy: ``weight`` unpacks W when asked (loading, a
    draft head's rows), ``rows`` gathers rows from them (a tied embedding). On the AVX2 path W is placed in the arena
    and read as it is. Elsewhere, and for ``bulk`` (prompt prefill) on AVX2: ``F.linear``.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, kernel):
        usable = kernels.supports(kernel, weight.dtype) and weight.device.type == "cpu" and kernel_takes(weight)
        self.kernel = kernel if usable else None
        self.shape = tuple(weight.shape)  # (out, in)
        self.dtype = weight.dtype
        self.panels = panels.place(kernel, weight) if usable and panels.usable(kernel, weight) else None  # (G, in, 48)
        # (out, in), None where the panels are the only copy
        self.plain = None if self.panels is not None else arena.place(weight) if usable else weight.contiguous()
        self.bias = bias

    @property
    def weight(self) -> Tensor:
        """W (out, in): the matrix, or unpacked from the panels (a new tensor each time: for loading, a draft head's
        rows and checks, not for a step)."""
        return self.plain if self.plain is not None else panels.unpack(self.panels, self.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of W (what one step reads of this matrix)."""
        return self.shape[0] * self.shape[1] * self.dtype.itemsize

    def __call__(self, x: Tensor, bulk: bool = False) -> Tensor:
        if self.kernel is None or x.dtype != self.dtype or (bulk and self.panels is None):
            return F.linear(x, self.weight, self.bias)  # (T, out)
        if bulk and self.bulk_on_torch(x):
            T = x.shape[0]  # padded to a multiple of TORCH_BULK_ROWS: oneDNN then meets few shapes (a new one: ~1 ms)
            return F.linear(F.pad(x, (0, 0, 0, -T % TORCH_BULK_ROWS)), self.weight, self.bias)[:T]  # (T, out)
        if self.panels is not None:  # under torch.compile as one opaque operator
            matmul = panels.traced_matmul if torch.compiler.is_compiling() else self.kernel.panel_matmul
            y = matmul(x, self.panels, self.shape[0])  # (T, out)
        else:
            y = self.kernel.small_matmul(x, self.plain)  # (T, out)
        return y if self.bias is None else y + self.bias

    def bulk_on_torch(self, x: Tensor) -> bool:
        """Whether a prefill's rows ``x`` (T, in) run on torch's matmul over W unpacked from the panels: bf16 on a
        CPU with AMX from ``TORCH_BULK_ROWS`` rows (one thread, a (3072, 576) matrix: 32 / 200 / 800 rows 1.2 / 8.7 /
        31 ms on the panels against 1.0 / 1.7 / 3.1 unpacking and multiplying; the unpacking's 0.55 ms loses at 16)."""
        return self.dtype == torch.bfloat16 and x.shape[0] >= TORCH_BULK_ROWS and kernels.cpu_has_amx()

    def rows(self, ids: Tensor) -> Tensor:
        """Rows ``ids`` (T,) of W: (T, in) (a tied embedding's lookup; gathered from the panels where they are)."""
        if self.plain is not None:
            return F.embedding(ids, self.plain)
        return panels.rows(self.panels, ids)

    def matrix(self) -> Tensor:
        """What the kernel reads: the panels (G, in, 48) where there are, else W (out, in)."""
        return self.plain if self.panels is None else self.panels


@dataclass
class LayerWeights:
    """One decoder layer, with q/k/v and gate/up fused into single matmuls. An exit adapter's layer may have no
    MLP (``gate_up`` None): its stream passes the MLP sublayer unchanged. Norm weights are as
    ``infer.model.layer_math.norm`` takes them (``norm_weight``); the family's extra norms are None where it
    has none."""

    attn_norm: Tensor  # (d,)
    qkv: Linear  # d -> (Hq + 2 Hkv) D, with bias for Qwen2
    o: Linear  # Hq D -> d
    mlp_norm: Tensor | None = None  # (d,): the MLP's input norm
    gate_up: Linear | None = None  # d -> 2 I
    down: Linear | None = None  # I -> d
    q_norm: Tensor | None = None  # (D,): per-head norm of q before RoPE (Qwen3, Gemma 3)
    k_norm: Tensor | None = None  # (D,): per-head norm of k before RoPE
    post_attn_norm: Tensor | None = None  # (d,): norm of the attention output before the residual (Gemma 3)
    post_mlp_norm: Tensor | None = None  # (d,): norm of the MLP output before the residual (Gemma 3)


def cast_layer(w: LayerWeights, dtype: torch.dtype, spec: ModelSpec, kernel) -> LayerWeights:
    """A copy of layer ``w`` in ``dtype``: its matmuls on ``kernel`` where that runs ``dtype`` (else torch's), its
    norm weights as ``norm_weight`` keeps them (the (1 + w) flavour stays fp32)."""
    def linear(m: Linear | None) -> Linear | None:
        bias = None if m is None or m.bias is None else m.bias.to(dtype)
        return None if m is None else Linear(m.weight.to(dtype), bias, kernel)

    def norm(t: Tensor | None) -> Tensor | None:
        return t if t is None or spec.family.norm_offset else t.to(dtype)

    return LayerWeights(norm(w.attn_norm), linear(w.qkv), linear(w.o), norm(w.mlp_norm), linear(w.gate_up),
                        linear(w.down), norm(w.q_norm), norm(w.k_norm), norm(w.post_attn_norm), norm(w.post_mlp_norm))


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    fast = kernels.norm_kernel()  # the C++ row norm where the kernel is loaded on an AVX-512 CPU
    if (fast is not None and x.device.type == "cpu" and weight.dtype == x.dtype
            and (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and x.shape[-1] % 16 == 0
                                             and fast.supports_bf16()))  # (kernels.supports costs ~0.6 us a call)
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and not torch.compiler.is_compiling()):
        return fast.rms_norm(x, weight, eps)  # ~1-5 us a call; torch's norm took 25-45 us (fp32) and ~65 us (bf16)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op
    # Same arithmetic as HF LlamaRMSNorm: normalise in fp32, scale in the model dtype.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


NEAR_TIES = ("a T-token verification may round differently from one-token decoding, so greedy output may differ from "
             f"plain decoding at near-ties ({CONTRACT_DOC})")
"""What falling outside the exactness contract means, for the warnings below."""


def warn_outside_contract(spec: ModelSpec, dtype: torch.dtype, device: torch.device, kernel) -> None:
    """Warn (once per process and message) at load where a runner's path is outside the exactness contract
    (``CONTRACT_DOC``): fp32 off the CPU kernel (on a GPU, or on torch's matmul: the portable path), or a head dim the
    kernel's row attention does not take. bf16/fp16 off the kernel's bf16 path are the documented near-tie rule
    (README; ``layerskip generate`` says it once), not warned here."""
    why = None
    if dtype == torch.float32 and device.type != "cpu":
        why = f"fp32 on {device.type}: torch's matmuls and attention there choose their kernels by the row count"
    elif dtype == torch.float32 and kernel is None:
        why = ("fp32 on torch's matmul and SDPA (the portable path: no small-matmul kernel for this CPU, or "
               "kernel='torch' / LAYERSKIP_KERNEL=torch)")
    elif kernel is not None and spec.head_dim > 256:
        why = f"head dim {spec.head_dim}: the kernel's row attention takes up to 256, so attention runs on SDPA"
    if why is not None:
        warnings.warn(f"layerskip: {why}: {NEAR_TIES}", ExactnessWarning, stacklevel=3)


def warn_off_kernel(linears: dict[str, Linear | None], kernel) -> None:
    """Warn (once per process, matrix name and width) where a matrix runs on torch's matmul although the kernel runs
    its dtype here: a width the kernel does not take (``kernel_takes``: an odd input width in bf16)."""
    for name, m in linears.items():
        if m is not None and m.kernel is None and kernels.supports(kernel, m.dtype):
            warnings.warn(f"layerskip: {name} ({m.shape[0]} x {m.shape[1]}, {str(m.dtype).removeprefix('torch.')}) "
                          f"runs on torch's matmul (the kernel's bf16 matmul takes even input widths only): "
                          f"{NEAR_TIES}", ExactnessWarning, stacklevel=3)


def load_kernel(dtype: torch.dtype, device: torch.device, kernel: str):
    """The small-matmul kernel module when ``kernel`` is 'auto', on CPU, for fp32, or for bf16 on a CPU with
    AVX512_BF16 (and it builds); else None (torch's matmul)."""
    if kernel not in ("auto", "torch"):
        raise UserError(f"unknown matmul kernel {kernel!r}; use 'auto' or 'torch'")
    if kernel == "torch" or device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    if dtype == torch.bfloat16 and not kernels.cpu_has_bf16():
        return None
    module = kernels.load()
    return module if kernels.supports(module, dtype) else None


def strip_prefix(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Accept both ``model.layers.0...`` (ForCausalLM) and ``layers.0...`` (base model) keys."""
    if any(k.startswith("model.") for k in state):
        return {k[len("model."):] if k.startswith("model.") else k: v for k, v in state.items()}
    return state


def load_safetensors_dir(path: Path) -> dict[str, Tensor]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def qkv_widths(s: ModelSpec) -> list[int]:
    return [s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim]


def norm_weight(weight: Tensor, spec: ModelSpec) -> Tensor:
    """A checkpoint's norm weight as ``infer.model.layer_math.norm`` takes it: 1 + w in fp32 for the (1 + w) flavour
    (Gemma 3 computes (normed * (1 + w.float())).to(dtype)), else a copy of it (a view of a memory-mapped checkpoint
    would keep the whole file mapped, for a vector of a few KB)."""
    return 1.0 + weight.float() if spec.family.norm_offset else weight.clone()


def fused_layer(get: Callable[[str], Tensor | None], spec: ModelSpec, kernel, mlp: bool = True,
                prefix: str = "") -> LayerWeights:
    """One decoder layer from its tensors by HF name within the layer (``get(name)``: the tensor on the target
    device and dtype, None when absent; ``prefix``: the layer's, for messages); ``mlp`` False: a layer without
    one (an exit adapter's). The family (``spec.family``) says which extra norms it must have."""
    def need(name: str) -> Tensor:
        t = get(name)
        if t is None:
            raise UserError(f"checkpoint has no tensor {prefix + name!r}; is it a {spec.model_type} model?")
        return t

    def norm(name: str) -> Tensor:
        return norm_weight(need(name), spec)

    if get("mlp.gate_proj.bias") is not None or get("mlp.down_proj.bias") is not None:
        raise UserError("MLP biases are not supported by the runner")
    qkv = torch.cat([need(f"self_attn.{n}_proj.weight") for n in "qkv"])  # ((Hq + 2 Hkv) D, d)
    biases = [get(f"self_attn.{n}_proj.bias") for n in "qkv"]
    bias = None if all(b is None for b in biases) else torch.cat(
        [qkv.new_zeros(w) if b is None else b for b, w in zip(biases, qkv_widths(spec), strict=True)])
    layer = LayerWeights(attn_norm=norm("input_layernorm.weight"), qkv=Linear(qkv, bias, kernel),
                         o=Linear(need("self_attn.o_proj.weight"), get("self_attn.o_proj.bias"), kernel))
    family = spec.family
    if family.qk_norm:
        layer.q_norm, layer.k_norm = norm("self_attn.q_norm.weight"), norm("self_attn.k_norm.weight")
    if family.sandwich_norms:
        layer.post_attn_norm = norm("post_attention_layernorm.weight")
    if mlp:
        layer.mlp_norm = norm("pre_feedforward_layernorm.weight" if family.sandwich_norms
                              else "post_attention_layernorm.weight")
        gate_up = torch.cat([need("mlp.gate_proj.weight"), need("mlp.up_proj.weight")])  # (2 I, d)
        layer.gate_up = Linear(gate_up, None, kernel)
        layer.down = Linear(need("mlp.down_proj.weight"), None, kernel)
        if family.sandwich_norms:
            layer.post_mlp_norm = norm("post_feedforward_layernorm.weight")
    warn_off_kernel({"self_attn.q/k/v_proj": layer.qkv, "self_attn.o_proj": layer.o,
                     "mlp.gate/up_proj": layer.gate_up, "mlp.down_proj": layer.down}, kernel)
    return layer


def fused_weights(state: dict[str, Tensor], config, dt: torch.dtype, dev: torch.device, kernel):
    """(embedding, final norm, LM head, per-layer weights) of a supported model's state dict, on ``dev`` in ``dt``;
    the final norm's weight as ``norm_weight`` gives it; the embedding None where it is tied to the LM head (the
    runner then reads the head's rows: ``Linear.rows``)."""
    spec = ModelSpec.from_config(config)

    def getter(prefix: str) -> Callable[[str], Tensor | None]:
        def get(name: str) -> Tensor | None:
            t = state.get(prefix + name)
            return None if t is None else t.to(device=dev, dtype=dt)
        return get

    layers = [fused_layer(getter(f"layers.{i}."), spec, kernel, prefix=f"layers.{i}.") for i in range(spec.num_layers)]
    get = getter("")
    embed, norm, head = get("embed_tokens.weight"), get("norm.weight"), get("lm_head.weight")
    if embed is None or norm is None:
        missing = "embed_tokens.weight" if embed is None else "norm.weight"
        raise UserError(f"checkpoint has no tensor {missing!r}; is it a {spec.model_type} model?")
    tied = head is None or getattr(config, "tie_word_embeddings", False)
    lm_head = Linear(embed if tied else head, None, kernel)
    warn_off_kernel({"lm_head": lm_head}, kernel)
    warn_outside_contract(spec, dt, dev, kernel)
    return None if tied else embed, norm_weight(norm, spec), lm_head, layers


UNFUSED = {"o": "self_attn.o_proj.weight", "down": "mlp.down_proj.weight"}
"""The runner's matrices that are a checkpoint's own (not fused): ``LayerWeights`` attribute -> HF name in a layer."""


def share_unfused(model, layers: list[LayerWeights]) -> int:
    """Point an HF ``model``'s o_proj and down_proj weights at the runner's copies of them (``layers``: the runner's
    ``LayerWeights``, built from this model; the kernel placed them in ``infer.kernels.arena``), so each matrix is held
    once, as before the arena; returns the bytes freed. A parameter in another dtype, device or shape than the
    runner's matrix keeps its own storage, and so does one the kernel holds packed only (its AVX-512 path). (q/k/v and
    gate/up are fused copies: ``infer.hf.runners.share_weights``.)"""
    params = strip_prefix(dict(model.named_parameters()))
    freed = 0
    for i, layer in enumerate(layers):
        for attr, name in UNFUSED.items():
            linear, p = getattr(layer, attr), params.get(f"layers.{i}.{name}")
            if linear is None or p is None:
                continue
            w = linear.plain  # (out, in); None where the kernel holds panels only (nothing to share)
            if (w is None or (p.dtype, p.device, p.shape) != (w.dtype, w.device, w.shape)
                    or p.data_ptr() == w.data_ptr()):
                continue
            freed += p.numel() * p.element_size()
            p.data = w
    return freed


def tensor_digest(tensors: dict[str, Tensor]) -> str:
    """A digest of named tensors' exact values (any dtype or device), to key what is built from them."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()[:16]


def fingerprint(state: dict[str, Tensor]) -> str:
    """A short digest of a few weights (before any dtype cast), so plans and adapters can tell checkpoints apart."""
    def first_values(name: str) -> bytes | None:
        t = state.get(name)
        return None if t is None else t.detach().float().cpu().flatten()[:FINGERPRINT_VALUES].numpy().tobytes()

    return weight_fingerprint(first_values)
