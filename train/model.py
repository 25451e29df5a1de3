"""The LayerSkip training forward over an unmodified Hugging Face causal LM.

:class:`LayerSkipLM` drives the decoder-layer loop itself over the HF modules (embedding,
rotary embedding, ``layers[i]``, final norm, LM head); no modeling file is forked and the
checkpoint's state-dict keys stay those of the HF model. That gives us the two things
LayerSkip needs in one pass:

- **layer dropout that really skips compute**: for a layer, only the rows of the batch that keep
  it are run, as a contiguous slice (:class:`DropoutPlan` regroups rows when needed, planned on the
  CPU once per step, so the layer loop never waits for the device); skipped rows pass through unchanged.
- **early-exit losses**: the hidden state after the first E layers goes through the final norm
  and the shared LM head, and its CE is weighted into the loss, chunked over tokens
  (:mod:`train.losses`), so no (B, T, V) logits tensor is built per exit.

Causal attention needs no padding mask here: packed pretraining blocks have no padding, and
finetuning batches are right-padded, so real tokens never attend to the padding after them (padding
has label -100). Position ids are therefore ``arange(T)`` for every row, and the masks are built here
(:func:`attention_masks`), not by ``transformers`` internals.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from layerskip_core.device import parse_dtype
from layerskip_core.errors import UserError
from layerskip_core.families import SUPPORTED_MODEL_TYPES, layer_windows, loading_problem
from layerskip_core.heldout import next_token_targets
from layerskip_core.models import is_model_dir, resolve_model
from train.config import EarlyExitConfig, KeepFinalConfig, LayerDropoutConfig
from train.keep_final import StartModel
from train.losses import Teacher, checkpointed_head_ce, default_chunk, fused_head_ce, is_plain_head
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

    @property
    def softcap(self) -> float | None:
        """The final logit softcapping the model's own forward applies (Gemma 3), or None."""
        return getattr(self.config, "final_logit_softcapping", None)

    def head(self, normed: Tensor, rows: Tensor | None = None) -> Tensor:
        """Final-normed hidden (..., d) -> logits (..., V) as the model's forward computes them (softcapped where it
        caps); with ``rows`` (N, d), rows of the head's weight (a reduced draft vocabulary), the logits (..., N) of
        those rows only."""
        logits = self.lm_head(normed) if rows is None else F.linear(normed, rows)
        cap = self.softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def rope(self, h: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Each layer's (cos, sin) for ``positions`` (1, T): Gemma 3's by layer type (local and global bases), else
        the one rotary embedding (SmolLM3's layers without RoPE ignore it themselves)."""
        types = getattr(self.config, "layer_types", None)
        if self.config.model_type == "gemma3_text":
            tables = {t: self.rotary(h, positions, t) for t in set(types)}
            return [tables[t] for t in types]
        return [self.rotary(h, positions)] * len(self.layers)

    def global_rope(self, h: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """(cos, sin) of full attention (an exit adapter's layer: Gemma 3's global base)."""
        if self.config.model_type == "gemma3_text":
            return self.rotary(h, positions, "full_attention")
        return self.rotary(h, positions)


def decoder_parts(model: nn.Module) -> Parts:
    """Find the decoder parts of a HF ``*ForCausalLM`` (optionally wrapped by peft)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"model type {config.model_type!r} is not supported for LayerSkip training; "
                        f"use a checkpoint of one of {', '.join(SUPPORTED_MODEL_TYPES)}")
    inner = base.model
    return Parts(inner.embed_tokens, inner.rotary_emb, inner.layers, inner.norm, base.lm_head, config)


class LayerSkipLM(nn.Module):
    """A HF causal LM trained with layer dropout and an early-exit loss.

    ``forward(input_ids, labels, step, micro)`` returns a dict with ``loss`` (the weighted sum of
    exit losses, plus ``keep_final.kl_weight`` times the KL of the final layer from the starting model),
    ``exit_losses`` ((n_exits,) detached CE per exit in ``exits_run`` order, final last), ``keep_final_kl``
    (() detached mean KL, 0 when off or in eval mode) and ``skipped`` ((L,) number of rows that skipped each layer).
    """

    def __init__(self, model: nn.Module, dropout: LayerDropoutConfig, early_exit: EarlyExitConfig,
                 max_steps: int, seed: int = 0, gradient_checkpointing: bool = False,
                 keep_final: KeepFinalConfig | None = None):
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
        self.kl_weight = keep_final.kl_weight if keep_final is not None else 0.0
        self.start = None  # the frozen teacher: a plain attribute, never a submodule (not in any state dict)
        if self.kl_weight > 0:
            self.start = StartModel(model, parts.lm_head, decoder_parts)

    # -- schedules -------------------------------------------------------------------------

    def rates(self, step: int) -> list[float]:
        return dropout_rates(self.dropout_cfg, self.num_layers, step, self.max_steps)

    def weights(self, step: int) -> dict[int, float]:
        return exit_weights(self.exit_cfg, self.exits, self.num_layers, step, self.max_steps)

    # -- forward ---------------------------------------------------------------------------

    def _run_layer(self, layer: nn.Module, h: Tensor, mask: Tensor | None, pos_emb, positions: Tensor) -> Tensor:
        # Only arguments that every transformers 5.x decoder layer takes (no cache, no cache_position).
        def run(x: Tensor) -> Tensor:
            out = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=pos_emb)
            return out[0] if isinstance(out, tuple) else out

        if self.gradient_checkpointing and self.training:
            return torch.utils.checkpoint.checkpoint(run, h, use_reentrant=False)
        return run(h)

    def hidden_states(self, input_ids: Tensor, skip: Tensor | None = None, collect: set[int] = frozenset(),
                      plan: DropoutPlan | None = None,
                      model: nn.Module | None = None) -> tuple[dict[int, Tensor], Tensor]:
        """Run the decoder; return ({E: hidden after E layers} for E in ``collect``, un-normed last hidden).

        ``skip`` is a (B, L) bool CPU tensor: row b skips layer l when ``skip[b, l]``. The rows of the
        returned states are in the batch's order; :meth:`forward` passes its own ``plan`` to keep them
        in the plan's row order instead (and permutes the labels to match). ``model``: another HF model of the
        same shape to run instead of our own (the frozen start of ``keep_final``).
        """
        parts = decoder_parts(self.model if model is None else model)
        T = input_ids.shape[1]
        h = parts.embed(input_ids)  # (B, T, d)
        positions = torch.arange(T, device=h.device).unsqueeze(0)  # (1, T)
        pos_emb = parts.rope(h, positions)  # per layer (cos, sin), each (1, T, head_dim)
        layer_masks = attention_masks(parts.config, T, h.device, h.dtype)
        own_plan = plan is None and skip is not None
        if own_plan:
            plan = DropoutPlan.build(skip, h.device)
        out: dict[int, Tensor] = {}
        for i, layer in enumerate(parts.layers):
            h = self._layer_step(layer, h, i, plan, layer_masks[i], pos_emb[i], positions)
            if i + 1 in collect:
                out[i + 1] = h
        if own_plan:  # back to the batch's row order for the caller
            out = {e: plan.unpermute(v, plan.order_after(e)) for e, v in out.items()}
            h = plan.unpermute(h, plan.order_after(len(parts.layers)))
        return out, h

    def _layer_step(self, layer: nn.Module, h: Tensor, i: int, plan: DropoutPlan | None, mask: Tensor | None,
                    pos_emb, positions: Tensor) -> Tensor:
        """One decoder layer with layer dropout: the rows that keep it are a contiguous prefix of h."""
        if plan is None:
            return self._run_layer(layer, h, mask, pos_emb, positions)
        kept, gather = plan.kept[i], plan.gather_index(i)
        if gather is not None:  # reorder once so the kept rows come first
            h = h.index_select(0, gather)  # (B, T, d)
        if kept == h.shape[0]:
            return self._run_layer(layer, h, mask, pos_emb, positions)
        if kept == 0:
            return h
        h_kept = self._run_layer(layer, h[:kept], mask, pos_emb, positions)  # (b, T, d)
        return torch.cat([h_kept, h[kept:]], dim=0)  # (B, T, d): skipped rows pass through

    def exit_logits(self, h: Tensor) -> Tensor:
        """Un-normed hidden (B, T, d) -> final norm -> shared LM head (-> the model's softcapping) -> (B, T, V)."""
        parts = decoder_parts(self.model)
        return parts.head(parts.norm(h))

    def exit_losses(self, hiddens: dict[int, Tensor], targets: dict[int, Tensor], weights: dict[int, float],
                    teacher: Teacher | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """(weighted total, per-exit CE in sorted exit order, mean KL) without a full (B, T, V) logits tensor.

        ``hiddens[E]`` (B, T, d) un-normed, ``targets[E]`` (B, T) next-token targets in the same row order;
        ``teacher`` (normed hidden (B, T, d) in the final layer's row order, head (V, d), KL weight) adds the weighted
        KL of the final layer from it (plain heads only: ``StartModel`` refuses others).
        """
        parts = decoder_parts(self.model)
        exits = sorted(weights)
        device = hiddens[exits[0]].device  # vocab from the config, not the weight's shape: ZeRO-3 empties it
        chunk = self.exit_cfg.loss_chunk or default_chunk(parts.config.vocab_size, device)
        if is_plain_head(parts.lm_head):
            xs = [parts.norm(hiddens[e]) for e in exits]  # each (B, T, d)
            return fused_head_ce(parts.lm_head, xs, [targets[e] for e in exits], [weights[e] for e in exits], chunk,
                                 teacher, parts.softcap)
        ces = [checkpointed_head_ce(parts.norm, parts.lm_head, hiddens[e], targets[e], chunk, parts.softcap)
               for e in exits]
        total = sum(weights[e] * ce for e, ce in zip(exits, ces, strict=True))
        return total, torch.stack([ce.detach() for ce in ces]), total.new_zeros(())

    def forward(self, input_ids: Tensor, labels: Tensor, step: int = 0, micro: int = 0) -> dict[str, Tensor]:
        B = input_ids.shape[0]
        L = self.num_layers
        dropout_on = self.training and self.dropout_cfg.p_max > 0
        skip = None
        if dropout_on:
            skip = sample_skips(self.rates(step), B, skip_generator(self.seed, step, micro),
                                self.dropout_cfg.granularity)  # (B, L) CPU
        weights = self.weights(step) if self.training else {e: 1.0 for e in [*self.exits, L]}
        collect = set(weights) - {L}
        plan = DropoutPlan.build(skip, input_ids.device) if skip is not None else None
        hiddens, last = self.hidden_states(input_ids, skip, collect=collect, plan=plan)
        hiddens[L] = last
        base_targets = next_token_targets(labels)  # (B, T)
        targets = {e: base_targets if plan is None else base_targets.index_select(0, plan.order_after(e))
                   for e in weights}  # the rows of each exit's hidden state are in the plan's order there
        teacher = None
        if self.start is not None and self.training:
            x_t, w_t = self.start.final_normed(self, input_ids)  # (B, T, d) in the batch's row order, (V, d)
            teacher = Teacher(x_t if plan is None else x_t.index_select(0, plan.order_after(L)), w_t, self.kl_weight)
        total, exit_losses, kl = self.exit_losses(hiddens, targets, weights, teacher)
        loss = total if self.training else exit_losses[-1]  # eval: the final layer's loss
        skipped = skip.sum(0) if skip is not None else torch.zeros(L, dtype=torch.long)  # (L,)
        return {"loss": loss, "exit_losses": exit_losses.detach(), "exits": torch.tensor(sorted(weights)),
                "skipped": skipped, "keep_final_kl": kl.detach()}


def attention_masks(config, T: int, device: torch.device, dtype: torch.dtype) -> list[Tensor | None]:
    """Per-layer attention mask for T tokens without padding, built here (no transformers internals).

    ``None`` where SDPA's / flash attention's own causal path applies (full attention, or a sliding
    window no shorter than T); otherwise a (1, 1, T, T) mask: boolean (True = attend) for SDPA,
    additive (0 / dtype min) for eager attention. It broadcasts over any subset of rows.
    """
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    cache: dict[int | None, Tensor | None] = {}

    def mask_for(w: int | None) -> Tensor | None:
        if w not in cache:
            if impl.startswith("flash") or (impl == "sdpa" and (w is None or w >= T)):
                cache[w] = None
            else:
                i = torch.arange(T, device=device)
                allowed = i.unsqueeze(1) >= i.unsqueeze(0)  # (T, T): key <= query
                if w is not None:
                    allowed &= i.unsqueeze(1) - i.unsqueeze(0) < w  # (T, T): within the window
                if impl != "sdpa":
                    allowed = torch.zeros((T, T), device=device, dtype=dtype).masked_fill(
                        ~allowed, torch.finfo(dtype).min)  # (T, T) additive
                cache[w] = allowed[None, None]  # (1, 1, T, T)
        return cache[w]

    return [mask_for(w) for w in layer_windows(config)]  # each layer's window as transformers applies it


class DropoutPlan:
    """Row order of one step's layer dropout, computed on the CPU from the (B, L) skip matrix.

    Before layer l the rows of h are reordered (only when needed) so that the rows keeping layer l
    form a prefix ``h[:kept[l]]``: the layer runs on a contiguous slice, no row count is read back
    from the device, and every reorder index goes to the device in a single copy per step.
    """

    def __init__(self, kept: list[int], gathers: list[Tensor | None], orders: list[Tensor], device: torch.device):
        self.kept = kept  # rows that run layer l
        lengths = [0 if g is None else len(g) for g in gathers] + [len(o) for o in orders]
        cpu = torch.cat([g for g in gathers if g is not None] + orders)  # all indices, one tensor
        if device.type == "cuda":
            cpu = cpu.pin_memory()
        flat = cpu.to(device, non_blocking=True)  # the step's only host-to-device copy
        pieces = list(torch.split(flat, lengths))
        self._gathers = [None if g is None else pieces[i] for i, g in enumerate(gathers)]
        self._orders = pieces[len(gathers):]  # order after layer count E, for E in [0, L]

    @classmethod
    def build(cls, skip: Tensor, device: torch.device) -> DropoutPlan:
        """Plan for ``skip`` (B, L) bool CPU; the row order after every depth is kept (B ints each)."""
        B, L = skip.shape
        keep = (~skip).tolist()  # B lists of L bools
        order = list(range(B))  # order[j] = batch row now at position j
        kept, gathers, orders = [], [], [torch.tensor(order)]
        for i in range(L):
            first = [r for r in order if keep[r][i]]
            rest = [r for r in order if not keep[r][i]]
            new = first + rest
            if new != order and first and rest:
                pos = {r: j for j, r in enumerate(order)}
                gathers.append(torch.tensor([pos[r] for r in new]))  # positions in the current h
                order = new
            else:
                gathers.append(None)
            kept.append(len(first))
            orders.append(torch.tensor(order))
        return cls(kept, gathers, orders, device)

    def gather_index(self, layer: int) -> Tensor | None:
        return self._gathers[layer]

    def order_after(self, depth: int) -> Tensor:
        """(B,) device tensor: the batch row at each position of h after ``depth`` layers."""
        return self._orders[depth]

    @staticmethod
    def unpermute(h: Tensor, order: Tensor) -> Tensor:
        """Rows of h (in ``order``) back to the batch's order. (B, ...)"""
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return h.index_select(0, inverse)


def load_model(name_or_path: str, dtype: str = "fp32", attn_implementation: str = "sdpa"):
    """Load a HF causal LM and its tokenizer from a folder (``default`` fetches the default model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(name_or_path)
    if not is_model_dir(path):
        raise UserError(f"{path} has no weights (*.safetensors or *.bin)")
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(dtype), output_loading_info=True,
                                                           attn_implementation=attn_implementation)
    except RuntimeError as e:  # a tensor of another shape than the config's (transformers' report is above)
        raise UserError(f"{path}: its weights do not fit its config.json ({' '.join(str(e).split())[:200]})") \
            from None
    if (problem := loading_problem(info)) is not None:  # else a model cut to the config's layers would train
        raise UserError(f"{path}: its weights do not fit its config.json ({problem}); fix the config, or use the "
                        "one the checkpoint was saved with")
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
    with warnings.catch_warnings():  # peft asks transformers 5 a deprecated question; nothing for the user to do
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, config)


def plain_model(model: nn.Module) -> nn.Module:
    """The HF model to save: LoRA adapters merged into the base weights, peft wrapper removed."""
    if hasattr(model, "merge_and_unload"):
        return model.merge_and_unload()
    return model
