"""The model families the runner and the trainer support, read from a Hugging Face config alone: ``ModelSpec`` (the
architecture numbers), each family's layer math (``Family``), and per-layer sliding windows and RoPE tables as
transformers applies them. docs/MODELS.md says what each family needed."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from layerskip_core.errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "smollm3")
"""HF ``model_type`` values the runner and the trainer handle (docs/MODELS.md: what each family needed)."""
NO_ROPE = "none"
"""The RoPE table of a layer that applies no rotary embedding (SmolLM3's ``no_rope_layers``): cos 1, sin 0."""
DEFAULT_ROPE = "default"
"""The RoPE table of a model with one rotary embedding (the config's ``rope_parameters``)."""


@dataclass(frozen=True)
class Family:
    """A model family's layer math beyond Llama's: one home the runner's every forward (eager, packed, static,
    compiled) and its weight loading read (``infer.model.layer_math``)."""

    norm_offset: bool = False
    """RMSNorm scales by (1 + w), computed in fp32 then cast (Gemma 3); else by w in the model dtype (Llama)."""
    embed_scale: bool = False
    """Embeddings multiplied by sqrt(hidden_size) in the model dtype (Gemma 3)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3): ``self_attn.q_norm`` / ``k_norm``."""
    sandwich_norms: bool = False
    """Norms after attention and MLP too (Gemma 3): ``post_attention_layernorm`` normalises the attention output,
    ``pre_feedforward_layernorm`` the MLP input, ``post_feedforward_layernorm`` its output."""
    activation: str = "silu"
    """The gated MLP's activation: 'silu' or 'gelu_tanh'."""


FAMILIES = {
    "llama": Family(), "mistral": Family(), "qwen2": Family(), "smollm3": Family(),
    "qwen3": Family(qk_norm=True),
    "gemma3_text": Family(norm_offset=True, embed_scale=True, qk_norm=True, sandwich_norms=True,
                          activation="gelu_tanh"),
}
"""Each supported ``model_type``'s family math."""
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
"""HF activation names -> the runner's."""


@dataclass
class ModelSpec:
    """The architecture numbers the runner needs, read from a HF config."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    """Longest sequence (prompt + new tokens) the runner decodes: the config's ``max_position_embeddings`` (sliding
    windows are honoured per layer, so they cap nothing)."""
    name: str = ""
    family: Family = Family()
    """The family's layer math (``FAMILIES``)."""
    layer_windows: tuple[int | None, ...] = ()
    """Per layer: W where the layer attends over only the last W positions (a query at p sees keys (p - W, p], as
    transformers' sliding-window masks), None for full attention; () means none anywhere."""
    layer_ropes: tuple[str, ...] = ()
    """Per layer: the name of its RoPE table (``rope_tables``); () means ``DEFAULT_ROPE`` everywhere."""
    attn_scale: float | None = None
    """Attention score scale (Gemma 3: ``query_pre_attn_scalar ** -0.5``); None: head_dim ** -0.5."""
    final_softcap: float | None = None
    """Logits become c * tanh(logits / c) (Gemma 3's ``final_logit_softcapping``); None: off."""

    @property
    def sliding_window(self) -> None:
        """Always None: windows are honoured per layer (``layer_windows``) and no longer cap the context."""
        return None

    @property
    def rope_tables(self) -> tuple[str, ...]:
        """The distinct RoPE tables the layers use, in first-use order (index = the table's row in the runner)."""
        return tuple(dict.fromkeys(self.layer_ropes or (DEFAULT_ROPE,)))

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def rope_index(self, layer: int) -> int:
        return self.rope_tables.index(self.layer_ropes[layer]) if self.layer_ropes else 0

    def for_layers(self, windows: tuple[int | None, ...], ropes: tuple[str, ...]) -> ModelSpec:
        """This spec over other layers (an exit adapter's, a sub-range), with their windows and RoPE tables."""
        return replace(self, num_layers=len(windows), layer_windows=windows, layer_ropes=ropes)

    def adapter_layer(self) -> ModelSpec:
        """The spec of an exit adapter's one layer (``train.adapter``'s forward): the model's norm flavour, no q/k or
        sandwich norms (it has no such weights), SiLU, the default scale, full attention with the global RoPE."""
        family = replace(self.family, activation="silu", qk_norm=False, sandwich_norms=False)
        rope = "full_attention" if self.model_type == "gemma3_text" else DEFAULT_ROPE
        return replace(self.for_layers((None,), (rope,)), family=family, attn_scale=None)

    def sublayer_weights(self) -> tuple[int, int]:
        """(attention, MLP) weights one decoder layer reads, its norms included (what a memory-bound step costs):
        q/k/v/o, and Qwen3's and Gemma 3's per-head q/k norms and Gemma 3's post-attention norm; gate/up/down and
        its norms."""
        d, D, f = self.hidden_size, self.head_dim, self.family
        attn = d * D * (2 * self.num_heads + 2 * self.num_kv_heads) + d + 2 * D * f.qk_norm + d * f.sandwich_norms
        mlp = 3 * d * self.intermediate_size + d + d * f.sandwich_norms
        return attn, mlp

    def weight_shapes(self) -> dict[str, tuple[tuple[int, ...], str, bool]]:
        """Every tensor the runner reads (names without ``model.``): (its shape, the config fields that set it,
        whether it must be there). The LM head (tied to the embedding when absent) and biases are optional."""
        d, V, D, I = self.hidden_size, self.vocab_size, self.head_dim, self.intermediate_size  # noqa: E741
        q, kv = self.num_heads * D, self.num_kv_heads * D
        qf, kvf = "num_attention_heads x head_dim", "num_key_value_heads x head_dim"
        layer = {"input_layernorm.weight": ((d,), "hidden_size", True),
                 "self_attn.q_proj.weight": ((q, d), f"{qf}, hidden_size", True),
                 "self_attn.k_proj.weight": ((kv, d), f"{kvf}, hidden_size", True),
                 "self_attn.v_proj.weight": ((kv, d), f"{kvf}, hidden_size", True),
                 "self_attn.o_proj.weight": ((d, q), f"hidden_size, {qf}", True),
                 "self_attn.q_proj.bias": ((q,), qf, False), "self_attn.k_proj.bias": ((kv,), kvf, False),
                 "self_attn.v_proj.bias": ((kv,), kvf, False), "self_attn.o_proj.bias": ((d,), "hidden_size", False),
                 "post_attention_layernorm.weight": ((d,), "hidden_size", True),
                 "mlp.gate_proj.weight": ((I, d), "intermediate_size, hidden_size", True),
                 "mlp.up_proj.weight": ((I, d), "intermediate_size, hidden_size", True),
                 "mlp.down_proj.weight": ((d, I), "hidden_size, intermediate_size", True)}
        if self.family.qk_norm:
            layer |= {"self_attn.q_norm.weight": ((D,), "head_dim", True),
                      "self_attn.k_norm.weight": ((D,), "head_dim", True)}
        if self.family.sandwich_norms:
            layer |= {f"{n}_feedforward_layernorm.weight": ((d,), "hidden_size", True) for n in ("pre", "post")}
        head = ((V, d), "vocab_size, hidden_size")
        shapes = {"embed_tokens.weight": (*head, True), "norm.weight": ((d,), "hidden_size", True),
                  "lm_head.weight": (*head, False)}
        for i in range(self.num_layers):
            shapes |= {f"layers.{i}.{name}": want for name, want in layer.items()}
        return shapes

    @classmethod
    def from_config(cls, config, where: str = "the model's config") -> ModelSpec:
        """The spec of a HF config (a transformers config object, or a config.json's dict), checked first
        (``check_config``: every refusal one line naming ``where`` and the field)."""
        check_config(config, where)
        config = _Fields(config)
        model_type = config.model_type
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise UserError(f"activation {act!r} is not supported (the runner has {', '.join(ACTIVATIONS)})")
        if getattr(config, "use_bidirectional_attention", False):
            raise UserError("bidirectional attention (use_bidirectional_attention) is not supported: the runner "
                            "decodes causal language models")
        heads = config.num_attention_heads
        scalar = getattr(config, "query_pre_attn_scalar", None) if model_type == "gemma3_text" else None
        return cls(
            model_type=model_type,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            name=getattr(config, "_name_or_path", "") or "",
            family=replace(FAMILIES[model_type], activation=ACTIVATIONS[act]),
            layer_windows=layer_windows(config),
            layer_ropes=layer_ropes(config),
            attn_scale=None if scalar is None else float(scalar) ** -0.5,
            final_softcap=getattr(config, "final_logit_softcapping", None) if model_type == "gemma3_text" else None,
        )


class _Fields:
    """A config's fields as attributes, from a config object or a config.json's dict (absent: ``getattr``'s
    default)."""

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name: str):
        if isinstance(self._config, Mapping):
            if name not in self._config:
                raise AttributeError(name)
            return self._config[name]
        return getattr(self._config, name)


def field(config, name: str, default=None):
    """A config's field ``name`` (a config object's attribute or a config.json dict's key), or ``default``."""
    return config.get(name, default) if isinstance(config, Mapping) else getattr(config, name, default)


SIZES = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
         "intermediate_size", "vocab_size", "max_position_embeddings")
"""Config fields that must be positive integers where given (absent: the config class's default)."""
POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta", "query_pre_attn_scalar", "final_logit_softcapping")
"""Config fields that must be finite numbers above 0 where given (None: not used)."""
LAYER_TYPES = ("sliding_attention", "full_attention")
FIX = "fix it, or use the config.json the checkpoint was saved with"


def check_config(config, where: str = "the model's config") -> None:
    """Refuse a config the runner would misread or decode garbage with, in one line naming ``where`` and the field:
    no or an unsupported ``model_type``, a size that is no positive integer (a string layer count, zero heads), query
    heads not a multiple of the KV heads, an epsilon or RoPE base that is no positive number, a sliding window that is
    applied and not a positive integer (Mistral's ``-4``), per-layer lists of another length than the layers.
    ``config``: a transformers config object or a config.json's dict (fields absent there keep their defaults)."""
    model_type = field(config, "model_type")
    if not model_type:
        raise UserError(f"{where} has no model_type; it is not a Hugging Face causal language model config (the "
                        f"runner and the trainer handle {', '.join(SUPPORTED_MODEL_TYPES)}); {FIX}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"{where}: model type {model_type!r} is not supported; the runner and the trainer handle "
                        f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints")
    for name in SIZES:
        value = field(config, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UserError(f"{where}: {name} must be a positive integer, got {value!r}; {FIX}")
    rope = field(config, "rope_parameters") or field(config, "rope_scaling") or {}
    numbers = {name: field(config, name) for name in POSITIVE_NUMBERS}
    numbers["rope_theta"] = numbers["rope_theta"] or (rope.get("rope_theta") if isinstance(rope, Mapping) else None)
    for name, value in numbers.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not math.isfinite(value) or value <= 0):
            raise UserError(f"{where}: {name} must be a number above 0, got {value!r}; {FIX}")
    heads, kv = field(config, "num_attention_heads"), field(config, "num_key_value_heads")
    if heads is not None and kv is not None and heads % kv:
        raise UserError(f"{where}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv}); "
                        f"{FIX}")
    _check_layer_fields(config, where)


def _check_layer_fields(config, where: str) -> None:
    """The sliding window where it is applied, and the per-layer lists (``layer_types``, SmolLM3's
    ``no_rope_layers``): as long as the layers, with known values."""
    window = field(config, "sliding_window")
    applied = window is not None and field(config, "use_sliding_window", True) is not False
    if applied and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise UserError(f"{where}: sliding_window must be a positive integer (the tokens a layer attends over) or "
                        f"null, got {window!r}; {FIX}")
    layers = field(config, "num_hidden_layers")
    for name, allowed in (("layer_types", LAYER_TYPES), ("no_rope_layers", (0, 1))):
        values = field(config, name) if name == "layer_types" or field(config, "model_type") == "smollm3" else None
        if values is None:
            continue
        if not isinstance(values, list | tuple) or len(values) != layers or any(v not in allowed for v in values):
            raise UserError(f"{where}: {name} must list one of {', '.join(map(repr, allowed))} for each of the "
                            f"{layers} layers (num_hidden_layers), got {values!r}; {FIX}")


LAYER_TENSOR = re.compile(r"layers\.(\d+)\.")


def check_weights(spec: ModelSpec, shapes: Mapping[str, tuple[int, ...]], config_where: str,
                  file_of: Callable[[str], str]) -> None:
    """Refuse weights that do not fit their config, in one line naming the file and the fields: layers beyond
    ``num_hidden_layers`` (a config cut to fewer layers would run a truncated model), a tensor the config's layers
    need that is missing, a shape the config's sizes do not give. ``shapes``: tensor name (``model.`` stripped) ->
    shape; ``file_of(name)``: the file that holds it (or the weights' folder)."""
    indices = {int(m.group(1)): name for name in shapes if (m := LAYER_TENSOR.match(name))}
    if indices and max(indices) >= spec.num_layers:
        last = max(indices)
        raise UserError(f"{file_of(indices[last])} holds layers up to {last} ({indices[last]!r}), but {config_where} "
                        f"says num_hidden_layers: {spec.num_layers}: the config does not fit the weights (it would "
                        f"run a truncated model); {FIX}")
    for name, (want, fields, required) in spec.weight_shapes().items():
        got = shapes.get(name)
        if got is None and required:
            raise UserError(f"{config_where} says num_hidden_layers: {spec.num_layers} ({spec.model_type}), but the "
                            f"weights ({file_of('')}) have no tensor {name!r}; the config does not fit the weights")
        if got is not None and tuple(got) != want:
            raise UserError(f"{file_of(name)}: tensor {name!r} is {tuple(got)}, but {config_where} gives {want} "
                            f"({fields}); the config does not fit the weights; {FIX}")


def loading_problem(info: Mapping) -> str | None:
    """What transformers' loading report (``from_pretrained(..., output_loading_info=True)``) says did not fit the
    config, or None: tensors in the checkpoint it dropped (layers beyond ``num_hidden_layers``), tensors it did not
    find and initialised at random (an LM head tied to the embedding aside), tensors of another shape."""
    for kind in ("unexpected_keys", "missing_keys", "mismatched_keys"):
        keys = sorted(str(k) for k in info.get(kind) or () if not str(k).endswith("lm_head.weight"))
        if keys:
            return f"{kind.replace('_', ' ')}: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
    return None


def layer_windows(config) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers applies it: Mistral's ``sliding_window`` on every layer; else the
    layers ``layer_types`` names 'sliding_attention' (Qwen2/Qwen3 from ``max_window_layers`` on with
    ``use_sliding_window``, Gemma 3's local layers, SmolLM3's with ``use_sliding_window``); None elsewhere."""
    L = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return (None,) * L
    types = getattr(config, "layer_types", None)
    if config.model_type == "mistral" or types is None:
        return (int(window),) * L
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def layer_ropes(config) -> tuple[str, ...]:
    """Each layer's RoPE table: Gemma 3's by layer type (local and global bases), SmolLM3's ``no_rope_layers`` (0:
    none), else the one default table."""
    L = config.num_hidden_layers
    if config.model_type == "gemma3_text":
        return tuple(config.layer_types)
    if config.model_type == "smollm3":
        flags = getattr(config, "no_rope_layers", None) or [1] * L
        return tuple(DEFAULT_ROPE if flag else NO_ROPE for flag in flags)
    return (DEFAULT_ROPE,) * L
