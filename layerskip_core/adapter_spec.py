"""The exit adapter's shape and file format, shared by training (writes it) and decoding (reads it); torch-free.

An exit adapter (after Kangaroo, Liu et al. 2024) sits on a frozen model's first E layers: the residual stream
entering layer E goes through one attention layer with the model's head layout (its own input RMSNorm, q/k/v/o
projections, the model's RoPE), optionally one SwiGLU MLP, then its own output RMSNorm (initialised from the
model's final norm), then the model's shared LM head. Training starts from the plain early exit at E: the
attention and MLP output projections start at zero, the norms and the other projections are copies of layer E's.

The file is safetensors with string metadata: ``format``, ``shape`` (this module's ``AdapterShape`` as JSON),
``model`` (the base model's identity: architecture numbers and weight fingerprint, as ``Runner.identity()``),
``provenance`` (how it was trained) and, once it was tuned, ``decoding`` (``TunedDecoding``: the early-exit setting
it was tuned with and its measured speed-up, which decoding with the adapter uses for every option left unset).
Both sides name tensors with ``tensor_shapes``. This module does not import torch: ``read_file`` checks the tensors
it reads with their own methods (finite, the ones the header names), and ``AdapterShape.check_layout`` the header
against the model the readers in ``infer.assets.adapter`` and ``train.adapter`` load it on.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from layerskip_core import inputs, jsonfile
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
LAYOUT_KEYS = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "rms_norm_eps")
"""The head layout an adapter's header must share with its model (``AdapterShape.check_layout``)."""
DECODING_KEYS = {"num_draft": int, "confidence": float, "keep_last": bool, "tree": bool, "max_tree_nodes": int}
"""The early-exit options (``infer.drafters.early_exit``'s field names and types) a tuned setting may hold."""


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

    def check_layout(self, model, path: str | Path) -> None:
        """Refuse a header whose head layout (``LAYOUT_KEYS``) is not ``model``'s (any object with those
        attributes: the runner's ``ModelSpec``, the ``AdapterShape`` a trainer builds from the model's config).
        Tensors that agree with a lying header would otherwise pass every shape check and fail mid-decoding."""
        diff = [f"{k}: file has {getattr(self, k)}, model has {getattr(model, k)}" for k in LAYOUT_KEYS
                if getattr(self, k) != getattr(model, k)]
        if diff:
            raise UserError(f"{path}: the adapter header's head layout is not the model's ({'; '.join(diff)}); the "
                            "file is damaged or made for another model: train the adapter again")


@dataclass(frozen=True)
class TunedDecoding:
    """The early-exit setting an adapter was tuned with and what it measured there (the header's ``decoding``): the
    one place a shipped adapter's best setting lives, read by ``--drafter best`` and used by early exit with the
    adapter for every option its caller leaves unset."""

    settings: dict = field(default_factory=dict)
    """Early-exit options by field name (``DECODING_KEYS``), e.g. {"num_draft": 6, "confidence": 0.5}."""
    speedup: float | None = None
    """Measured speed-up over plain decoding at this setting (None: not measured)."""
    measured: str = ""
    """What the speed-up was measured on (prompts, dtype, threads, machine)."""
    source: str = ""
    """Where the measurement is recorded (a section of a results page, a bench's results.json and command)."""

    def __post_init__(self) -> None:
        for key, value in self.settings.items():
            want = DECODING_KEYS.get(key)
            if want is None:
                raise ValueError(f"unknown option {key!r} (a tuned setting holds {', '.join(DECODING_KEYS)})")
            ok = isinstance(value, bool) if want is bool else \
                isinstance(value, (int, float) if want is float else int) and not isinstance(value, bool)
            if not ok or (isinstance(value, float) and not math.isfinite(value)):
                raise ValueError(f"{key} must be {want.__name__}, got {value!r}")
        if self.speedup is not None and (isinstance(self.speedup, bool) or not isinstance(self.speedup, (int, float))
                                         or not math.isfinite(self.speedup) or self.speedup <= 0):
            raise ValueError(f"speedup must be a positive number, got {self.speedup!r}")
        if not isinstance(self.measured, str) or not isinstance(self.source, str):
            raise ValueError("measured and source must be text")

    def spec_text(self) -> str:
        """The settings as a spec's options: ``num_draft=6:confidence=0.5:keep_last=true``."""
        return ":".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.settings.items())

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def read_decoding(meta: dict[str, str] | None, path: str | Path) -> TunedDecoding | None:
    """The tuned setting of an adapter file's metadata (None: never tuned); a damaged one is refused in one line
    naming the file."""
    if not meta or "decoding" not in meta:
        return None
    try:
        return TunedDecoding(**jsonfile.obj(jsonfile.parse(meta["decoding"]), "decoding"))
    except (TypeError, ValueError, UserError) as e:
        raise UserError(f"{path}: damaged tuned decoding setting in the adapter header ({e}); tune it again "
                        "(scripts/best_fixed.py --write-adapter) or remove it") from None


def write_decoding(path: str | Path, decoding: TunedDecoding) -> None:
    """Record ``decoding`` in the header of the adapter file at ``path`` (tensors and the rest of the header kept),
    written whole or not at all (a temporary file beside it, renamed over it)."""
    from safetensors.torch import save_file

    path = Path(path)
    meta, tensors = read_file(path)
    if not meta or meta.get("format") != FORMAT:
        raise UserError(f"{path} is not an exit adapter file (no {FORMAT!r} header)")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=dict(meta) | {"decoding": decoding.to_json()})
        os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def metadata(shape: AdapterShape, identity: dict, provenance: dict,
             decoding: TunedDecoding | None = None) -> dict[str, str]:
    """The safetensors metadata of an adapter file (all values strings, as the format requires)."""
    meta = {"format": FORMAT, "shape": json.dumps(asdict(shape)),
            "model": json.dumps({k: identity[k] for k in IDENTITY_KEYS}), "provenance": json.dumps(provenance)}
    return meta | ({"decoding": decoding.to_json()} if decoding is not None else {})


def read_file(path: str | Path, hint: str = "") -> tuple[dict[str, str] | None, dict]:
    """(metadata, tensors by name) of an adapter file; a missing, unreadable or damaged one is a one-line user
    error (``hint`` says what to give instead). Tensors must be finite and, when the header's shape can be
    read, exactly the ones it names (``read_metadata`` refuses a damaged header). Reads torch tensors:
    safetensors is imported only here."""
    from safetensors import safe_open

    path = inputs.check(path, "adapter file", f"give the adapter.safetensors a training run wrote{hint}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (no iterator)
    except Exception as e:  # safetensors raises its own error types for a file that is not safetensors
        raise UserError(f"{path} is not a readable safetensors file ({' '.join(str(e).split())}); the file is "
                        "damaged or cut off: train the adapter again") from None
    _check_tensors(meta, tensors, path)
    return meta, tensors


def _header_shape(meta: dict[str, str] | None) -> AdapterShape | None:
    try:
        return AdapterShape(**jsonfile.obj(jsonfile.parse(meta["shape"]), "shape"))
    except (KeyError, TypeError, ValueError, UserError):
        return None


def _check_tensors(meta: dict[str, str] | None, tensors: dict, path: Path) -> None:
    """Refuse non-finite or non-float tensors, and tensors other than the ones the header's shape names."""
    for name, t in tensors.items():
        if not t.is_floating_point() or not bool(t.isfinite().all()):
            what = f"{t.dtype} values" if not t.is_floating_point() else "NaN or infinite values"
            raise UserError(f"{path}: adapter tensor {name!r} holds {what}; the file is damaged: train the adapter "
                            "again")
    shape = _header_shape(meta) if meta and meta.get("format") == FORMAT else None
    if shape is None:
        return
    want = shape.tensor_shapes()
    got = {k: tuple(t.shape) for k, t in tensors.items()}
    wrong = [f"{k}: header says {want.get(k, 'no such tensor')}, file has {got.get(k, 'none')}"
             for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]
    if wrong:
        raise UserError(f"{path}: the adapter header disagrees with its tensors ({'; '.join(wrong[:3])}); the file "
                        "is damaged: train the adapter again")


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
    try:
        shape.check_model(identity["num_layers"])
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    return shape, provenance
