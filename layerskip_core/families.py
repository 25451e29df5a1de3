"""The model families the runner and the trainer support, read from a Hugging Face config alone: ``ModelSpec`` (the
architecture numbers), each family's layer math (``Family``), and per-layer sliding windows and RoPE tables as
transformers applies them. docs/MODELS.md says what each family needed."""

from __future__ import annotations

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

    @classmethod
    def from_config(cls, config) -> ModelSpec:
        model_type = config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(f"model type {model_type!r} is not supported; the runner and the trainer handle "
                            f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints")
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
