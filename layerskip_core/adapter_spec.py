"""The exit adapter's shape and file format, shared by training (writes it) and decoding (reads it); torch-free.

An exit adapter (after Kangaroo, Liu et al. 2024) sits on a frozen model's first E layers: the residual stream
entering layer E goes through one attention layer with the model's head layout (its own input RMSNorm, q/k/v/o
projections, the model's RoPE), optionally one SwiGLU MLP, then its own output RMSNorm (initialised from the
model's final norm), then the model's shared LM head. Training starts from the plain early exit at E: the
attention and MLP output projections start at zero, the norms and the other projections are copies of layer E's.

The file is safetensors with string metadata: ``format``, ``shape`` (this module's ``AdapterShape`` as JSON),
``model`` (the base model's identity: architecture numbers and weight fingerprint, as ``Runner.identity()``)
and ``provenance`` (how it was trained). Both sides name tensors with ``tensor_shapes``. This module cannot
check tensor values; the readers in ``infer.adapter`` and ``train.adapter`` check shapes against it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from layerskip_core import jsonfile
from layerskip_core.errors import UserError
from layerskip_core.layers import check_exit_layer
from layerskip_core.options import check_fields

FORMAT = "layerskip-exit-adapter/1"
"""The ``format`` metadata value of an adapter file."""
FINGERPRINT_TENSORS = ("layers.0.self_attn.q_proj.weight", "norm.weight")
"""Tensors (prefix ``model.`` stripped) whose first ``FINGERPRINT_VALUES`` values, as fp32 bytes, identify weights."""
FINGERPRINT_VALUES = 4096
LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight", "q_proj.weight": "self_attn.q_proj.weight",
               "k_proj.weight": "self_attn.k_proj.weight", "v_proj.weight": "self_attn.v_proj.weight",
               "o_proj.weight": "self_attn.o_proj.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
               "gate_proj.weight": "mlp.gate_proj.weight", "up_proj.weight": "mlp.up_proj.weight",
               "down_proj.weight": "mlp.down_proj.weight"}
"""The adapter's tensors that form one decoder layer, by their names within an HF Llama layer (the other one,
``out_norm.weight``, is the norm before the LM head)."""
IDENTITY_KEYS = ("model_type", "num_layers", "hidden_size", "vocab_size", "weight_fingerprint")
"""What an adapter file must share with the model it drafts for."""


def weight_fingerprint(first_values: Callable[[str], bytes | None]) -> str:
    """A short digest of a model's weights: ``first_values(name)`` gives the first ``FINGERPRINT_VALUES`` values of
    each ``FINGERPRINT_TENSORS`` tensor as fp32 bytes (None when the model has no such tensor)."""
    digest = hashlib.sha256()
    for name in FINGERPRINT_TENSORS:
        data = first_values(name)
        if data is not None:
            digest.update(data)
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class AdapterShape:
    """Architecture of one exit adapter (the model's head layout; E and the optional MLP chosen by its trainer)."""

    exit_layer: int
    """E: the adapter reads the residual stream entering decoder layer E (1 <= E < the model's layer count)."""
    hidden_size: int
    """d: the model's hidden size."""
    num_heads: int
    """Query heads (the model's)."""
    num_kv_heads: int
    """Key/value heads (the model's)."""
    head_dim: int
    """Per-head width (the model's)."""
    mlp_size: int = 0
    """Intermediate width of the adapter's SwiGLU MLP; 0 = no MLP (Kangaroo's adapter: attention and two norms)."""
    rms_norm_eps: float = 1e-5
    """Epsilon of the adapter's RMSNorms (the model's)."""

    def __post_init__(self) -> None:
        check_fields(self, "adapter shape")
        if self.exit_layer < 1:
            raise UserError(f"adapter exit layer must be >= 1, got {self.exit_layer}")
        if self.mlp_size < 0:
            raise UserError(f"adapter mlp size must be >= 0, got {self.mlp_size}")

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the adapter by file name, with its shape (projections are (out, in) as in HF)."""
        d, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes = {"attn_norm.weight": (d,), "q_proj.weight": (q, d), "k_proj.weight": (kv, d),
                  "v_proj.weight": (kv, d), "o_proj.weight": (d, q), "out_norm.weight": (d,)}
        if self.mlp_size:
            m = self.mlp_size
            shapes |= {"mlp_norm.weight": (d,), "gate_proj.weight": (m, d), "up_proj.weight": (m, d),
                       "down_proj.weight": (d, m)}
        return shapes

    def check_model(self, num_layers: int) -> None:
        check_exit_layer(self.exit_layer, num_layers, "adapter exit layer", below_last=True)


def metadata(shape: AdapterShape, identity: dict, provenance: dict) -> dict[str, str]:
    """The safetensors metadata of an adapter file (all values strings, as the format requires)."""
    return {"format": FORMAT, "shape": json.dumps(asdict(shape)),
            "model": json.dumps({k: identity[k] for k in IDENTITY_KEYS}), "provenance": json.dumps(provenance)}


def read_file(path: str | Path, hint: str = "") -> tuple[dict[str, str] | None, dict]:
    """(metadata, tensors by name) of an adapter file; a missing or unreadable one is a one-line user error
    (``hint`` says what to give instead). Reads torch tensors: safetensors is imported only here."""
    from safetensors import safe_open

    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"adapter file {path} does not exist; give the adapter.safetensors a training run wrote{hint}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (no iterator)
    except Exception as e:  # safetensors raises its own error types for a file that is not safetensors
        raise UserError(f"{path} is not a readable safetensors file ({e})") from None


def read_metadata(meta: dict[str, str] | None, identity: dict, path: str) -> tuple[AdapterShape, dict]:
    """(shape, provenance) of an adapter file's metadata; refuses another format or a file for another model."""
    if not meta or meta.get("format") != FORMAT:
        raise UserError(f"{path} is not an exit adapter file (no {FORMAT!r} header); make one with "
                        "train/layerskip.py and a recipe that has an adapter: section")
    try:
        shape = AdapterShape(**jsonfile.obj(jsonfile.parse(meta["shape"]), "shape"))
        recorded = jsonfile.obj(jsonfile.parse(meta["model"]), "model")
        provenance = jsonfile.obj(jsonfile.parse(meta.get("provenance", "{}")), "provenance")
    except (KeyError, TypeError, ValueError, UserError) as e:
        raise UserError(f"{path}: damaged exit adapter header ({e}); train the adapter again") from None
    diff = [f"{k}: file has {recorded.get(k)}, model has {identity.get(k)}" for k in IDENTITY_KEYS
            if recorded.get(k) != identity.get(k)]
    if diff:
        raise UserError(f"{path} is an exit adapter for another model ({'; '.join(diff)}); use it with the model "
                        "it was trained on, or train one for this model")
    shape.check_model(identity["num_layers"])
    return shape, provenance
