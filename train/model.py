"""The LayerSkip training forward over an unmodified Hugging Face causal LM.

:class:`LayerSkipLM` drives the decoder-layer loop itself over the HF modules (embedding,
rotary embedding, ``layers[i]``, final norm, LM head); no modeling file is forked and the
checkpoint's state-dict keys stay those of the HF model. That gives us the two things
LayerSkip needs in one pass:

- **layer dropout that really skips compute**: for a layer, only the rows of the batch that keep
  it are run (``h[keep]``), and the result is scattered back; skipped rows pass through unchanged.
- **early-exit losses**: the hidden state after the first E layers goes through the final norm
  and the shared LM head, and its CE is weighted into the loss.

Causal attention needs no mask here: packed pretraining blocks have no padding, and finetuning
batches are right-padded, so real tokens never attend to the padding after them (padding has
label -100). Position ids are therefore ``arange(T)`` for every row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.device import parse_dtype
from core.errors import UserError
from core.models import SUPPORTED_MODEL_TYPES, is_model_dir, resolve_model
from train.config import EarlyExitConfig, LayerDropoutConfig
from train.data import IGNORE
from train.schedules import check_exits, dropout_rates, exit_weights, sample_skips, skip_generator


@dataclass
class Parts:
    """The HF modules the loop drives (they live inside, and are shared with, the HF model)."""

    embed: nn.Module
    rotary: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Module
    config: object


def decoder_parts(model: nn.Module) -> Parts:
    """Find the decoder parts of a HF ``*ForCausalLM`` (optionally wrapped by peft)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"model type {config.model_type!r} is not supported for LayerSkip training; "
                        f"use a Llama-family checkpoint ({', '.join(SUPPORTED_MODEL_TYPES)})")
    inner = base.model
    return Parts(inner.embed_tokens, inner.rotary_emb, inner.layers, inner.norm, base.lm_head, config)


def next_token_targets(labels: Tensor) -> Tensor:
    """Labels shifted left by one (position t predicts label t+1); the last position gets -100. (B, T)"""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE)


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean next-token CE over positions whose label is not -100 (the HF convention).

    The targets are shifted instead of the logits, so the (B, T, V) logits are never copied.
    """
    targets = next_token_targets(labels)  # (B, T)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE)


class LayerSkipLM(nn.Module):
    """A HF causal LM trained with layer dropout and an early-exit loss.

    ``forward(input_ids, labels, step, micro)`` returns a dict with ``loss`` (the weighted sum of
    exit losses), ``exit_losses`` ((n_exits,) detached CE per exit in ``exits_run`` order, final
    last), and ``skipped`` ((L,) number of rows that skipped each layer).
    """

    def __init__(self, model: nn.Module, dropout: LayerDropoutConfig, early_exit: EarlyExitConfig,
                 max_steps: int, seed: int = 0, gradient_checkpointing: bool = False):
        super().__init__()
        self.model = model  # the HF model (or peft wrapper): its state dict is the checkpoint's
        self.dropout_cfg = dropout
        self.exit_cfg = early_exit
        self.max_steps = max_steps
        self.seed = seed
        self.gradient_checkpointing = gradient_checkpointing
        parts = decoder_parts(model)
        self.num_layers = len(parts.layers)
        self.exits = check_exits(early_exit, self.num_layers)
        dropout_rates(dropout, self.num_layers, 0, max_steps)  # validates layer_dropout.layers

    # -- schedules -------------------------------------------------------------------------

    def rates(self, step: int) -> list[float]:
        return dropout_rates(self.dropout_cfg, self.num_layers, step, self.max_steps)

    def weights(self, step: int) -> dict[int, float]:
        return exit_weights(self.exit_cfg, self.exits, self.num_layers, step, self.max_steps)

    # -- forward ---------------------------------------------------------------------------

    def _masks(self, parts: Parts, h: Tensor, positions: Tensor) -> dict[str, object]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        kwargs = dict(config=parts.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=positions)
        masks = {"full_attention": create_causal_mask(**kwargs)}
        if "sliding_attention" in (getattr(parts.config, "layer_types", None) or []):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        return masks

    def _run_layer(self, layer: nn.Module, h: Tensor, mask, pos_emb, positions: Tensor) -> Tensor:
        def run(x: Tensor) -> Tensor:
            return layer(x, attention_mask=mask, position_ids=positions, position_embeddings=pos_emb)

        if self.gradient_checkpointing and self.training:
            return torch.utils.checkpoint.checkpoint(run, h, use_reentrant=False)
        return run(h)

    def hidden_states(self, input_ids: Tensor, skip: Tensor | None = None,
                      collect: set[int] = frozenset()) -> tuple[dict[int, Tensor], Tensor]:
        """Run the decoder; return ({E: hidden after E layers} for E in ``collect``, un-normed last hidden).

        ``skip`` is a (B, L) bool CPU tensor: row b skips layer l when ``skip[b, l]``.
        """
        parts = decoder_parts(self.model)
        B, T = input_ids.shape
        h = parts.embed(input_ids)  # (B, T, d)
        positions = torch.arange(T, device=h.device).unsqueeze(0)  # (1, T)
        pos_emb = parts.rotary(h, positions)  # (cos, sin), each (1, T, head_dim)
        masks = self._masks(parts, h, positions)
        layer_types = getattr(parts.config, "layer_types", None)
        out: dict[int, Tensor] = {}
        for i, layer in enumerate(parts.layers):
            mask = masks["full_attention" if not layer_types else layer_types[i]]
            keep = None if skip is None else ~skip[:, i]  # (B,) CPU
            if keep is None or bool(keep.all()):
                h = self._run_layer(layer, h, mask, pos_emb, positions)
            elif bool(keep.any()):
                rows = keep.nonzero().squeeze(1).to(h.device)  # (b,)
                row_mask = mask[rows] if isinstance(mask, Tensor) and mask.shape[0] == B else mask
                h_kept = self._run_layer(layer, h.index_select(0, rows), row_mask, pos_emb, positions)  # (b, T, d)
                h = h.index_copy(0, rows, h_kept)  # (B, T, d): skipped rows pass through
            # else: every row skips this layer
            if i + 1 in collect:
                out[i + 1] = h
        return out, h

    def exit_logits(self, h: Tensor) -> Tensor:
        """Un-normed hidden (B, T, d) -> final norm -> shared LM head -> (B, T, V)."""
        parts = decoder_parts(self.model)
        return parts.lm_head(parts.norm(h))

    def forward(self, input_ids: Tensor, labels: Tensor, step: int = 0, micro: int = 0) -> dict[str, Tensor]:
        B = input_ids.shape[0]
        L = self.num_layers
        dropout_on = self.training and self.dropout_cfg.p_max > 0
        skip = None
        if dropout_on:
            skip = sample_skips(self.rates(step), B, skip_generator(self.seed, step, micro))  # (B, L) CPU
        weights = self.weights(step) if self.training else {e: 1.0 for e in [*self.exits, L]}
        hiddens, last = self.hidden_states(input_ids, skip, collect=set(weights) - {L})
        hiddens[L] = last
        loss = input_ids.new_zeros((), dtype=torch.float32)
        exit_losses = []
        for e in sorted(weights):
            ce = causal_lm_loss(self.exit_logits(hiddens[e]), labels)
            exit_losses.append(ce.detach())
            if self.training:
                loss = loss + weights[e] * ce
        if not self.training:
            loss = exit_losses[-1]  # eval: the final layer's loss
        skipped = skip.sum(0) if skip is not None else torch.zeros(L, dtype=torch.long)  # (L,)
        return {"loss": loss, "exit_losses": torch.stack(exit_losses), "exits": torch.tensor(sorted(weights)),
                "skipped": skipped}


def load_model(name_or_path: str, dtype: str = "fp32", attn_implementation: str = "sdpa"):
    """Load a HF causal LM and its tokenizer from a folder (``default`` fetches the default model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(name_or_path)
    if not is_model_dir(path):
        raise UserError(f"{path} has no weights (*.safetensors or *.bin)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(dtype),
                                                 attn_implementation=attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.use_cache = False
    return model, tokenizer, path


def add_lora(model: nn.Module, r: int, alpha: float, dropout: float, target_modules: list[str]):
    """Wrap ``model`` with peft LoRA adapters on the named linear layers (base weights frozen)."""
    from peft import LoraConfig, get_peft_model

    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in target_modules if t not in names]
    if missing:
        raise UserError(f"lora.target_modules {missing} are not module names of this model")
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                        bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def plain_model(model: nn.Module) -> nn.Module:
    """The HF model to save: LoRA adapters merged into the base weights, peft wrapper removed."""
    if hasattr(model, "merge_and_unload"):
        return model.merge_and_unload()
    return model
