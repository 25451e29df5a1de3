"""Training an exit adapter on a frozen model (a recipe's ``adapter:`` section; ``layerskip_core.adapter_spec``).

The base model is loaded once and never changes: layer E's hidden states (and, for ``target: distill``, the
full model's next-token distribution) are computed under ``no_grad``; only the adapter learns. The adapter's
output goes through the model's LM head (its weights frozen, the gradient flowing through it to the adapter).

The adapter's forward is written here over ``torch.nn`` modules (batched, autograd); ``infer.assets.adapter`` runs the
same weights as one more decoder layer on the runner (one sequence, a KV cache): the two regimes share the spec,
not the code, as the training forward and the runner do for the base model; tests hold the two forwards equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

from layerskip_core.adapter_spec import (
    FINGERPRINT_VALUES,
    AdapterShape,
    metadata,
    read_file,
    read_metadata,
    weight_fingerprint,
)
from layerskip_core.draft_vocab import ids_digest, resolve_draft_vocab_option
from layerskip_core.errors import UserError
from train.config import AdapterConfig
from train.data import IGNORE, Examples
from train.model import attention_masks, decoder_parts, next_token_targets, plain_model
from train.teacher_memo import TeacherMemo, TeacherTargets, top_k_distill_loss


class ExitAdapterModule(nn.Module):
    """The adapter as trainable modules; its state dict keys are ``AdapterShape.tensor_shapes``'s. ``norm``: the
    model's RMSNorm class (its final norm's), called as ``norm(hidden_size, eps=...)``."""

    def __init__(self, shape: AdapterShape, norm: type[nn.Module]):
        super().__init__()
        self.shape = s = shape
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.attn_norm, self.out_norm = norm(s.hidden_size, eps=s.rms_norm_eps), norm(s.hidden_size, eps=s.rms_norm_eps)
        self.q_proj, self.o_proj = nn.Linear(s.hidden_size, q, bias=False), nn.Linear(q, s.hidden_size, bias=False)
        self.k_proj, self.v_proj = (nn.Linear(s.hidden_size, kv, bias=False) for _ in range(2))
        if s.mlp_size:
            self.mlp_norm = norm(s.hidden_size, eps=s.rms_norm_eps)
            self.gate_proj, self.up_proj = (nn.Linear(s.hidden_size, s.mlp_size, bias=False) for _ in range(2))
            self.down_proj = nn.Linear(s.mlp_size, s.hidden_size, bias=False)

    @torch.no_grad()
    def init_from(self, parts) -> None:
        """Start as the plain early exit at E: output projections zero, the rest copied from layer E (whose
        attention is the closest trained one) and the output norm from the model's final norm."""
        layer = parts.layers[self.shape.exit_layer]
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(self, name).weight.copy_(getattr(attn, name).weight)
        self.attn_norm.weight.copy_(layer.input_layernorm.weight)
        self.out_norm.weight.copy_(parts.norm.weight)
        self.o_proj.weight.zero_()
        if self.shape.mlp_size:
            pre = getattr(layer, "pre_feedforward_layernorm", layer.post_attention_layernorm)  # Gemma 3: the MLP's own
            self.mlp_norm.weight.copy_(pre.weight)
            self.gate_proj.weight.copy_(layer.mlp.gate_proj.weight[:self.shape.mlp_size])
            self.up_proj.weight.copy_(layer.mlp.up_proj.weight[:self.shape.mlp_size])
            self.down_proj.weight.zero_()

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        """(B, T, d) stream entering layer E, RoPE (1, T, D) each -> (B, T, d) after the output norm."""
        s, (B, T, _) = self.shape, h.shape
        x = self.attn_norm(h)
        q = self.q_proj(x).view(B, T, s.num_heads, s.head_dim).transpose(1, 2)  # (B, Hq, T, D)
        k = self.k_proj(x).view(B, T, s.num_kv_heads, s.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, s.num_kv_heads, s.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=s.num_heads != s.num_kv_heads)  # (B, Hq, T, D)
        h = h + self.o_proj(out.transpose(1, 2).reshape(B, T, s.num_heads * s.head_dim))  # (B, T, d)
        if s.mlp_size:
            x = self.mlp_norm(h)
            h = h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, d)
        return self.out_norm(h)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF's rotary embedding on (B, H, T, D) with cos/sin (1, T, D)."""
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[:, None]


def draft_vocab_ids(model: nn.Module, tokenizer, cfg: AdapterConfig) -> tuple[int, ...] | None:
    """The token ids of ``adapter.draft_vocab`` for ``model`` (checked against its architecture and tokenizer, as the
    drafters check it), or None for the whole head."""
    vocab = resolve_draft_vocab_option(cfg.draft_vocab, model_identity(model), tokenizer)
    return None if vocab is None else vocab.ids


def model_identity(model: nn.Module) -> dict:
    """The base model's identity as ``Runner.identity()`` computes it from the same weights."""
    parts = decoder_parts(model)
    state = {k.removeprefix("model."): v for k, v in plain_model(model).state_dict().items()}

    def first_values(name: str) -> bytes | None:
        t = state.get(name)
        return None if t is None else t.detach().float().cpu().flatten()[:FINGERPRINT_VALUES].numpy().tobytes()

    c = parts.config
    return {"model_type": c.model_type, "num_layers": c.num_hidden_layers, "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size, "weight_fingerprint": weight_fingerprint(first_values)}


class DraftRows:
    """A reduced draft vocabulary in training: its rows of the frozen head and each token id's column."""

    def __init__(self, head_weight: Tensor, ids: Sequence[int]):
        self.ids = torch.as_tensor(list(ids), dtype=torch.long, device=head_weight.device)  # (N,) sorted
        self.rows = head_weight.detach().index_select(0, self.ids)  # (N, d): a copy, not a parameter
        self.columns = torch.full((head_weight.shape[0],), -1, dtype=torch.long, device=head_weight.device)  # (V,)
        self.columns[self.ids] = torch.arange(len(self.ids), device=head_weight.device)

    def argmax(self, logits: Tensor) -> Tensor:
        """(..., N) logits over the vocabulary -> (...) the top token ids."""
        return self.ids[logits.argmax(-1)]


class AdapterLM(nn.Module):
    """The frozen model (kept outside the module tree: checkpoints hold the adapter only) plus the adapter.

    ``forward`` returns what the LayerSkip loop reads (``loss``, ``exit_losses``, ``exits``, ``skipped``)."""

    def __init__(self, model: nn.Module, cfg: AdapterConfig, vocab_ids: Sequence[int] | None = None):
        super().__init__()
        self.frozen = [model.requires_grad_(False).eval()]  # a list: not a submodule
        self.cfg, parts = cfg, decoder_parts(model)
        c = parts.config
        self.num_layers = c.num_hidden_layers
        heads = c.num_attention_heads
        self.shape = AdapterShape(cfg.exit_layer, c.hidden_size, heads, getattr(c, "num_key_value_heads", heads),
                                  getattr(c, "head_dim", None) or c.hidden_size // heads, cfg.mlp_size, c.rms_norm_eps)
        self.shape.check_model(self.num_layers)
        self.exits = [cfg.exit_layer]
        self.adapter = ExitAdapterModule(self.shape, type(parts.norm))
        self.adapter.init_from(parts)
        self.memo = TeacherMemo(cfg.teacher_top_k) if cfg.teacher_top_k else None
        """The frozen model's outputs per training row after their first pass (``teacher_top_k`` > 0)."""
        self.commit = code_commit()
        """The code that trains it, taken when the run starts (the checkout may move on before the file is saved)."""
        self.vocab = None if vocab_ids is None else DraftRows(parts.lm_head.weight, vocab_ids)
        """The reduced draft vocabulary the head scores (``adapter.draft_vocab``), or None: the whole head."""

    def rates(self, step: int) -> list[float]:
        """Layer dropout rates (none: the base model is frozen)."""
        return [0.0] * self.num_layers

    @torch.no_grad()
    def base_states(self, input_ids: Tensor, teacher: bool) -> tuple[Tensor, Tensor | None, tuple]:
        """(stream entering layer E (B, T, d), the full model's logits (B, T, V) when ``teacher``, RoPE)."""
        parts = decoder_parts(self.frozen[0])
        T, E = input_ids.shape[1], self.cfg.exit_layer
        h = parts.embed(input_ids)  # (B, T, d)
        positions = torch.arange(T, device=h.device)[None]  # (1, T)
        ropes = parts.rope(h, positions)  # per layer (cos, sin), each (1, T, D)
        masks = attention_masks(parts.config, T, h.device, h.dtype)
        exit_h, last = None, h
        for i, layer in enumerate(parts.layers[:self.num_layers if teacher else E]):
            if i == E:
                exit_h = last
            out = layer(last, attention_mask=masks[i], position_ids=positions, position_embeddings=ropes[i])
            last = out[0] if isinstance(out, tuple) else out
        exit_h = last if exit_h is None else exit_h
        rope = parts.global_rope(h, positions)  # the adapter's layer attends fully with the global base
        return exit_h, parts.head(parts.norm(last)).float() if teacher else None, rope

    @torch.no_grad()
    def teacher(self, input_ids: Tensor) -> tuple[Tensor, Tensor | TeacherTargets, tuple]:
        """(stream entering layer E (B, T, d), the full model's distribution, RoPE). The distribution is its (B, T, V)
        logits, or with ``teacher_top_k`` its top K (``TeacherTargets``), kept per row after the first pass."""
        if self.memo is None:
            return self.base_states(input_ids, teacher=True)
        kept = self.memo.lookup(input_ids)
        if kept is not None:
            exit_h, target = kept
            positions = torch.arange(input_ids.shape[1], device=exit_h.device)[None]  # (1, T)
            return exit_h, target, decoder_parts(self.frozen[0]).global_rope(exit_h, positions)
        exit_h, logits, rope = self.base_states(input_ids, teacher=True)
        target = TeacherTargets.of(logits, self.memo.k, None if self.vocab is None else self.vocab.ids)  # (B, T, K)
        self.memo.store(input_ids, exit_h, target)
        return exit_h, target, rope

    def adapter_logits(self, exit_h: Tensor, rope: tuple) -> Tensor:
        """(B, T, d) -> (B, T, V) fp32 through the adapter and the frozen head (the gradient reaches the adapter); (B,
        T, N) over the draft vocabulary's N tokens when it has one."""
        return self.head_logits(self.adapter(exit_h, *rope, None))

    def head_logits(self, out: Tensor, whole: bool = False) -> Tensor:
        """The adapter's output (B, T, d) -> fp32 logits over the draft vocabulary (B, T, N), or the whole head's (B, T,
        V) when there is none or ``whole``."""
        rows = None if self.vocab is None or whole else self.vocab.rows
        return decoder_parts(self.frozen[0]).head(out, rows).float()

    def forward(self, input_ids: Tensor, labels: Tensor, step: int = 0, micro: int = 0) -> dict[str, Tensor]:
        targets = next_token_targets(labels)  # (B, T)
        valid = targets != IGNORE  # (B, T)
        if self.cfg.target == "distill":
            exit_h, teacher, rope = self.teacher(input_ids)
        else:
            exit_h, teacher, rope = self.base_states(input_ids, teacher=False)
        logits = self.adapter_logits(exit_h, rope)[valid]  # (N, V)
        if isinstance(teacher, TeacherTargets):
            columns = None if self.vocab is None else self.vocab.columns
            loss = top_k_distill_loss(logits, teacher.rows(valid), columns)  # to the (K + 1)-bucket distribution
        elif teacher is not None:  # KL(teacher || adapter) + H(teacher); on a draft vocabulary, the teacher's there
            teacher = teacher[valid] if self.vocab is None else teacher[valid][:, self.vocab.ids]  # (N, V) or (N, n)
            loss = F.cross_entropy(logits, torch.softmax(teacher, -1))
        else:
            loss = F.cross_entropy(logits, targets[valid])
        return {"loss": loss, "exit_losses": loss.detach()[None], "exits": torch.tensor(self.exits),
                "skipped": torch.zeros(self.num_layers, dtype=torch.long)}

    @torch.no_grad()
    def evaluate(self, examples: Examples, batch_size: int, pad_id: int, device, indices: list[int]) -> Tensor:
        """(5,) sums over ``indices``: adapter CE on the data (the whole head), adapter and plain-exit top-1 agreement
        with the full model, adapter top-1 accuracy (the adapter's top token over its draft vocabulary when it has
        one: the token it would draft), tokens (summed across processes by the caller)."""
        stats = torch.zeros(5, dtype=torch.float64)
        head, norm = decoder_parts(self.frozen[0]).lm_head, decoder_parts(self.frozen[0]).norm
        for start in range(0, len(indices), batch_size):
            batch = examples.batch(indices[start:start + batch_size], pad_id)
            targets = next_token_targets(batch["labels"]).to(device)  # (B, T)
            valid = targets != IGNORE  # (B, T)
            exit_h, teacher, rope = self.teacher(batch["input_ids"].to(device))
            out = self.adapter(exit_h, *rope, None)  # (B, T, d)
            logits = self.head_logits(out, whole=True)  # (B, T, V)
            full_top = teacher.greedy() if isinstance(teacher, TeacherTargets) else teacher.argmax(-1)  # (B, T)
            top = logits.argmax(-1) if self.vocab is None else self.vocab.argmax(self.head_logits(out))  # drafted
            plain_top = head(norm(exit_h)).argmax(-1)  # (B, T): the untrained early exit at E
            stats += torch.stack([F.cross_entropy(logits[valid], targets[valid], reduction="sum").double().cpu(),
                                  ((top == full_top) & valid).sum().cpu().double(),
                                  ((plain_top == full_top) & valid).sum().cpu().double(),
                                  ((top == targets) & valid).sum().cpu().double(), valid.sum().cpu().double()])
        return stats

    def load(self, path) -> dict:
        """Take the weights of an adapter file made for this model and shape; returns its provenance."""
        meta, state = read_file(path)
        shape, provenance = read_metadata(meta, model_identity(self.frozen[0]), str(path))
        if shape != self.shape:
            raise UserError(f"{path} is an adapter of another shape ({shape}); this run's is {self.shape}")
        self.adapter.load_state_dict(state)
        return provenance

    @classmethod
    def from_file(cls, model: nn.Module, path) -> tuple[AdapterLM, dict]:
        """(the adapter file ``path`` on ``model`` at the file's E and shape, its provenance); refused in one line
        when the file was made for another model."""
        meta, state = read_file(path)
        shape, provenance = read_metadata(meta, model_identity(model), str(path))
        lm = cls(model, AdapterConfig(enabled=True, exit_layer=shape.exit_layer, mlp_size=shape.mlp_size))
        shape.check_layout(lm.shape, path)
        lm.adapter.load_state_dict(state)
        return lm, provenance

    def save(self, path, provenance: dict) -> None:
        """Write the adapter file (fp32 safetensors + the header tying it to this base model)."""
        state = {k: v.detach().float().cpu().contiguous() for k, v in self.adapter.state_dict().items()}
        save_file(state, str(path), metadata=metadata(self.shape, model_identity(self.frozen[0]), provenance))
        os.chmod(path, 0o644)  # safetensors writes 0600: an adapter is shared like any model file


def adapter_summary(record: dict) -> str:
    """The one line an adapter run prints per evaluation (as a LayerSkip run prints ``eval_summary``'s)."""
    [E] = record["adapter_loss"]
    return (f"eval: adapter at E{E}: loss {record['adapter_loss'][E]:.3f}, agreement with the full model "
            f"{record['adapter_agreement'][E]:.3f} (the plain exit {E}: {record['exit_agreement'][E]:.3f}), "
            f"{record['tokens']} tokens")


def adapter_metrics(accelerator, model: AdapterLM, examples: Examples, indices: list[int], batch_size: int,
                    pad_id: int) -> dict:
    """Validation record of an adapter run: the adapter's loss, and top-1 agreement with the full model of the
    adapter and of the plain early exit at the same E (per-token greedy acceptance of each drafter)."""
    with accelerator.autocast():
        stats = model.evaluate(examples, batch_size, pad_id, accelerator.device, indices)
    if accelerator.num_processes > 1:
        stats = accelerator.reduce(stats.to(accelerator.device)).cpu()
    n = max(float(stats[4]), 1.0)
    E = str(model.cfg.exit_layer)
    record = {"split": "val", "adapter_loss": {E: float(stats[0]) / n}, "adapter_agreement": {E: float(stats[1]) / n},
              "exit_agreement": {E: float(stats[2]) / n}, "adapter_accuracy": {E: float(stats[3]) / n},
              "tokens": int(stats[4])}
    if model.memo is not None:  # training and validation rows whose frozen-model outputs are kept, batches served
        record |= {"teacher_kept_rows": len(model.memo.rows), "teacher_kept_batches": model.memo.hits}
    if accelerator.is_main_process:  # the evaluation line a LayerSkip or LoRA run prints too
        from tqdm.auto import tqdm

        tqdm.write(f"layerskip-train: {adapter_summary(record)}", file=sys.stderr)
    return record


def adapter_eval(model, adapter, examples, pad_id: int, batch_size: int = 2) -> dict:
    """Agreement with the full model of the adapter file ``adapter`` and of the plain exit at its E on
    ``examples``, on the loaded base ``model`` (checked against the file's header: refused if not its model), on the
    CPU (``scripts/eval_adapter.py``, ``tools.experiments.compare_adapter``)."""
    lm, provenance = AdapterLM.from_file(model, adapter)
    stats = lm.evaluate(examples, batch_size, pad_id, "cpu", list(range(len(examples))))
    n = float(stats[4])
    if n < 1:
        raise UserError("the held-out examples hold no token to score; give a recipe whose validation split has text")
    if not bool(stats.isfinite().all()):
        raise UserError(f"{adapter}: the adapter's loss is not a finite number (NaN or infinite); the adapter is "
                        "damaged or diverged in training: train it again")
    return {"adapter": str(adapter), "exit_layer": lm.shape.exit_layer, "provenance": provenance,
            "examples": len(examples), "tokens": int(n), "adapter_loss": float(stats[0]) / n,
            "adapter_agreement": float(stats[1]) / n, "exit_agreement": float(stats[2]) / n,
            "adapter_accuracy": float(stats[3]) / n}


def source_provenance(src) -> dict:
    """What an adapter file records of one data source: its type, file name and share limit, and for a
    self-distillation file (``train.self_distill``) its kind's prompts and generated tokens."""
    entry = {"type": src.type}
    if src.path:
        entry["name"] = Path(src.path).name
    if src.max_documents is not None:
        entry["max_documents"] = src.max_documents
    made = Path(src.path).expanduser().parent / "provenance.json" if src.type == "jsonl" else None
    if made is not None and made.is_file():
        record = json.loads(made.read_text())
        kind = Path(src.path).stem
        entry["self_distill"] = {"kind": kind, **record.get("kinds", {}).get(kind, {}),
                                 "data_commit": record.get("commit"), "settings": record.get("settings")}
    return entry


def save_adapter(accelerator, lm, cfg, path, tokens: int, step: int) -> None:
    """Write the adapter file from the main process (the others wait), with its provenance: target, steps, loss
    tokens, each source (``source_provenance``), block size and the commit of the code that trained it."""
    if accelerator.is_main_process:
        model = accelerator.unwrap_model(lm)
        vocab = None if model.vocab is None else {"option": model.cfg.draft_vocab, "size": len(model.vocab.ids),
                                                  "ids_sha256": ids_digest(model.vocab.ids.tolist())}
        model.save(path, {"target": model.cfg.target, "draft_vocab": vocab, "steps": step, "tokens": tokens,
                          "data": [s.type for s in cfg.data.sources],
                          "sources": [source_provenance(s) for s in cfg.data.sources],
                          "block_size": cfg.data.block_size, "commit": model.commit})
    accelerator.wait_for_everyone()


def code_commit() -> str:
    """The git commit of this checkout, with ``-dirty`` when tracked files differ from it (the code that ran is then
    not the commit's); 'unknown' outside a git checkout."""
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    if run.returncode != 0:
        return "unknown"
    changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True)
    return run.stdout.strip() + ("-dirty" if changed.returncode == 0 and changed.stdout.strip() else "")
