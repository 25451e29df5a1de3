"""The checkpoint's weights as the runner uses them: q/k/v and gate/up fused into single matmuls, the small-matmul
CPU kernel where it applies, and the RMSNorm both the runner and its static forwards call."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor

from infer import kernels
from layerskip_core.adapter_spec import FINGERPRINT_VALUES, weight_fingerprint
from layerskip_core.errors import UserError
from layerskip_core.models import ModelSpec


class Linear:
    """y = x @ W^T (+ b), W (out, in) as in HF checkpoints.

    On x86 CPUs in fp32 it runs the small-batch kernel of ``infer.kernels``: verifying T tokens
    then costs little more than one, and every row's result is bitwise independent of T, so a
    batched verification reproduces token-by-token decoding exactly. Elsewhere: ``F.linear``.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, kernel):
        self.weight = weight.contiguous()  # (out, in)
        self.bias = bias
        self.kernel = kernel if kernel is not None and weight.shape[1] % 8 == 0 else None

    def __call__(self, x: Tensor, bulk: bool = False) -> Tensor:
        if self.kernel is None or bulk:
            return F.linear(x, self.weight, self.bias)  # (T, out)
        y = self.kernel.small_matmul(x, self.weight)  # (T, out)
        return y if self.bias is None else y + self.bias


@dataclass
class LayerWeights:
    """One decoder layer, with q/k/v and gate/up fused into single matmuls."""

    attn_norm: Tensor  # (d,)
    qkv: Linear  # d -> (Hq + 2 Hkv) D, with bias for Qwen2
    o: Linear  # Hq D -> d
    mlp_norm: Tensor  # (d,)
    gate_up: Linear  # d -> 2 I
    down: Linear  # I -> d


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op
    # Same arithmetic as HF LlamaRMSNorm: normalise in fp32, scale in the model dtype.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def load_kernel(dtype: torch.dtype, device: torch.device, kernel: str):
    """The small-matmul kernel module for fp32 on CPU when ``kernel`` is 'auto' (and it builds)."""
    if kernel not in ("auto", "torch"):
        raise UserError(f"unknown matmul kernel {kernel!r}; use 'auto' or 'torch'")
    if kernel == "torch" or dtype != torch.float32 or device.type != "cpu":
        return None
    return kernels.load()


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


def fused_weights(state: dict[str, Tensor], config, dt: torch.dtype, dev: torch.device, kernel):
    """(embedding, final norm, LM head, per-layer weights) of a Llama-family state dict, on ``dev`` in ``dt``."""
    spec = ModelSpec.from_config(config)

    def get(name: str) -> Tensor:
        if name not in state:
            raise UserError(f"checkpoint has no tensor {name!r}; is it a Llama-family model?")
        return state[name].to(device=dev, dtype=dt)

    def maybe(name: str) -> Tensor | None:
        return state[name].to(device=dev, dtype=dt) if name in state else None

    def cat_bias(names: list[str]) -> Tensor | None:
        parts = [maybe(n) for n in names]
        return None if all(p is None for p in parts) else torch.cat(
            [p if p is not None else torch.zeros(w, dtype=dt, device=dev)
             for p, w in zip(parts, qkv_widths(spec), strict=True)])

    layers = []
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        a = p + "self_attn."
        if maybe(p + "mlp.gate_proj.bias") is not None or maybe(p + "mlp.down_proj.bias") is not None:
            raise UserError("MLP biases are not supported by the runner")
        qkv = torch.cat([get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")])
        gate_up = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
        layers.append(LayerWeights(
            attn_norm=get(p + "input_layernorm.weight"),
            qkv=Linear(qkv, cat_bias([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]), kernel),
            o=Linear(get(a + "o_proj.weight"), maybe(a + "o_proj.bias"), kernel),
            mlp_norm=get(p + "post_attention_layernorm.weight"),
            gate_up=Linear(gate_up, None, kernel),
            down=Linear(get(p + "mlp.down_proj.weight"), None, kernel),
        ))
    embed = get("embed_tokens.weight")
    head = state.get("lm_head.weight")
    tied = head is None or getattr(config, "tie_word_embeddings", False)
    return embed, get("norm.weight"), Linear(embed if tied else head.to(dev, dt), None, kernel), layers


def fingerprint(state: dict[str, Tensor]) -> str:
    """A short digest of a few weights (before any dtype cast), so plans and adapters can tell checkpoints apart."""
    def first_values(name: str) -> bytes | None:
        t = state.get(name)
        return None if t is None else t.detach().float().cpu().flatten()[:FINGERPRINT_VALUES].numpy().tobytes()

    return weight_fingerprint(first_values)
