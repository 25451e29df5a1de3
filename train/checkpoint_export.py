"""A plain Hugging Face model folder from any training checkpoint (``layerskip export``), not only ``final/``.

A checkpoint (``checkpoints/step-N``) holds accelerate's training state: the model's weights (``model.safetensors``,
a tied LM head stored once), the optimizer, RNG states. Exporting rebuilds the run's model from the config beside the
checkpoint (the base model, LoRA adapters when the run used them), loads the checkpoint's weights into it, merges LoRA
and writes config + safetensors + tokenizer as ``final/`` is written. It cannot read DeepSpeed checkpoints (sharded
ZeRO state; DeepSpeed's ``zero_to_fp32.py`` turns them into one file) and needs the run's base model to be reachable.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from layerskip_core import inputs
from layerskip_core.errors import UserError
from layerskip_core.packages import normal_permissions
from train.checkpoint import STATE_FILE, list_checkpoints, note_skipped, read_state
from train.recipe import dump_config, load_config

WEIGHTS = "model.safetensors"
"""The file of the model's weights in an accelerate checkpoint."""


def find_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` if it is a complete checkpoint, or the newest checkpoint of the run folder ``path``; a checkpoint
    still being written (a ``.tmp-`` folder) is refused."""
    path = Path(path).expanduser()
    if path.name.startswith(".tmp-"):
        raise UserError(f"{path} is a checkpoint being written (or left by a killed run), not a complete one; give "
                        "a checkpoints/step-N folder or the run folder")
    if (path / STATE_FILE).is_file():
        read_state(path)  # a damaged or inconsistent state file is one line
        return path
    found = list_checkpoints(path)
    note_skipped(path)
    if found:
        return found[-1]
    raise UserError(f"{path} is neither a checkpoint (checkpoints/step-N with {STATE_FILE}) nor a run folder that "
                    "holds one; give a folder a training run wrote")


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the model of ``checkpoint`` (or of a run folder's newest) to ``out`` as a plain HF folder; returns it.

    ``out`` must not exist yet (nothing is overwritten)."""
    import torch

    from train.model import add_lora, load_model, plain_model  # lazy: torch; a wrong folder is refused at once

    ckpt, out = find_checkpoint(checkpoint), Path(out).expanduser()
    if out.exists():
        raise UserError(f"{out} already exists; choose a new folder for the exported model")
    if not (ckpt / WEIGHTS).is_file():
        raise UserError(f"{ckpt} has no {WEIGHTS} (a DeepSpeed checkpoint? convert it with DeepSpeed's "
                        "zero_to_fp32.py); nothing to export")
    cfg = load_config(str(ckpt / "config.yaml"), [])
    state = _read_weights(ckpt / WEIGHTS)  # before the base model loads: a damaged file is refused at once
    model, tokenizer, _ = load_model(cfg.model.name_or_path, cfg.model.dtype, cfg.model.attn_implementation)
    if cfg.lora.enabled:
        model = add_lora(model, cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules)
    with torch.no_grad():
        missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")} if model.config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise UserError(f"{ckpt / WEIGHTS} does not fit the run's model ({len(missing)} missing, {len(unexpected)} "
                        f"unexpected tensors, e.g. {sorted(set(missing) - tied or unexpected)[:2]})")
    hf = plain_model(model)
    hf.config.use_cache = True
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    hf.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    dump_config(cfg, tmp / "layerskip_train.yaml")
    normal_permissions(tmp)
    os.replace(tmp, out)
    return out


def _read_weights(path: Path) -> dict:
    """The checkpoint's weights by model name (``model.`` prefix dropped); a cut-off or damaged file is one line."""
    from safetensors.torch import load_file

    inputs.check(path, "checkpoint weights file")
    try:
        state = load_file(path)
    except Exception as e:  # safetensors raises its own error types for a file that is not safetensors
        raise UserError(f"{path} is damaged or cut off ({' '.join(str(e).split())[:200]}); export an earlier "
                        "checkpoint") from None
    bad = next((k for k, v in state.items() if v.is_floating_point() and not bool(v.isfinite().all())), None)
    if bad is not None:
        raise UserError(f"{path}: tensor {bad!r} holds NaN or infinite values; export an earlier checkpoint")
    return {k.removeprefix("model."): v for k, v in state.items()}


def describe(ckpt: Path) -> str:
    """'step N of the run in FOLDER' for messages."""
    return f"step {read_state(ckpt).get('step', '?')} of the run in {ckpt.parent.parent}"
