"""Resumable checkpoints and the final plain Hugging Face model folder.

Layout of a run folder (``checkpoint.output_dir``)::

    config.yaml                   the resolved config of the run
    metrics.jsonl                 one JSON object per log/eval event
    checkpoints/step-000100/      accelerate state (model, optimizer, scheduler, RNG of every process)
        trainer_state.json        step, tokens seen; written last, so its presence marks a complete checkpoint
        config.yaml               the resolved config, beside every checkpoint
    final/                        config.json + model.safetensors + tokenizer (LoRA merged): load it with
                                  transformers, infer.runner.Runner or ``layerskip generate --model``
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from core.errors import UserError
from train.config import TrainConfig, dump_config

STATE_FILE = "trainer_state.json"
PREFIX = "step-"


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def find_resume(cfg: TrainConfig) -> Path | None:
    """The checkpoint to resume from: ``never`` -> None, ``auto`` -> newest (or None), else the given folder."""
    mode = cfg.checkpoint.resume
    if mode == "never":
        return None
    if mode == "auto":
        found = list_checkpoints(cfg.checkpoint.output_dir)
        return found[-1] if found else None
    path = Path(mode).expanduser()
    if not (path / STATE_FILE).is_file():
        raise UserError(f"checkpoint.resume: {path} is not a complete checkpoint (no {STATE_FILE}); "
                        "use 'auto', 'never' or a checkpoints/step-N folder")
    return path


def read_state(path: Path) -> dict:
    return json.loads((Path(path) / STATE_FILE).read_text())


def save_checkpoint(accelerator, cfg: TrainConfig, step: int, state: dict) -> Path:
    """Write ``checkpoints/step-N`` atomically (all processes call this) and prune old ones."""
    root = checkpoints_dir(cfg.checkpoint.output_dir)
    final = root / f"{PREFIX}{step:06d}"
    tmp = root / f".tmp-{PREFIX}{step:06d}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        dump_config(cfg, tmp / "config.yaml")
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **state}, indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        keep = cfg.checkpoint.keep_last
        if keep:
            for old in list_checkpoints(cfg.checkpoint.output_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def export_final(accelerator, lm, tokenizer, cfg: TrainConfig, out_dir: str | Path) -> Path:
    """Save a plain HF folder (config + safetensors + tokenizer), LoRA adapters merged into the weights."""
    from train.model import plain_model

    out_dir = Path(out_dir)
    state = None
    if not cfg.lora.enabled:  # gathers ZeRO-3 shards; every process must take part
        full = accelerator.get_state_dict(lm)
        state = {k[len("model."):]: v for k, v in full.items() if k.startswith("model.")}
    if accelerator.is_main_process:
        hf = plain_model(accelerator.unwrap_model(lm).model)
        hf.config.use_cache = True
        tmp = out_dir.with_name(f".tmp-{out_dir.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        hf.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        dump_config(cfg, tmp / "layerskip_train.yaml")
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    accelerator.wait_for_everyone()
    return out_dir
