"""Metrics: a local JSON-lines log (always) and Weights & Biases (optional, never blocking).

wandb is imported lazily and only on the main process. ``offline`` writes its run under
``<output_dir>/wandb`` and needs no network; ``disabled`` never imports it. ``online`` is the
user's explicit choice; if wandb is missing or fails to start we say so in one line and keep
training with the local log.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from layerskip_core.errors import UserError


def _flatten(record: dict, prefix: str = "") -> dict[str, float]:
    flat = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "/"))
        elif isinstance(value, list):
            flat.update({f"{name}/{i}": v for i, v in enumerate(value) if isinstance(v, (int, float))})
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[name] = value
    return flat


def truncate_metrics(path: Path, lines: int | None, step: int) -> None:
    """Cut ``metrics.jsonl`` back to a checkpoint: its first ``lines`` lines, as recorded when the
    checkpoint was saved (checkpoints without that count: the records of steps <= ``step``)."""
    path = Path(path)
    if not path.is_file():
        return
    kept = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(keepends=True)):
        if lines is not None:
            if i >= lines:
                break
        else:
            try:
                if int(json.loads(line).get("step", 0)) > step:
                    continue
            except (ValueError, AttributeError, TypeError):
                continue  # a line cut short by the kill
        kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


class Tracker:
    """Writes every record to ``metrics.jsonl`` and, if enabled, to wandb. Main process only."""

    def __init__(self, output_dir: Path, enabled: bool, wandb_mode: str, project: str, run_name: str,
                 config: dict):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.run = None
        self.lines = 0  # lines in metrics.jsonl so far, saved with each checkpoint (see truncate_metrics)
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_file():
            self.lines = len(self.path.read_text(encoding="utf-8").splitlines())
        if wandb_mode != "disabled":
            self.run = _start_wandb(Path(output_dir), wandb_mode, project, run_name, config)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        self.lines += 1
        if self.run is not None:
            prefix = "val/" if record.get("split") == "val" else ""
            self.run.log(_flatten({k: v for k, v in record.items() if k not in ("time", "split")}, prefix),
                         step=int(record.get("step", 0)))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def _start_wandb(output_dir: Path, mode: str, project: str, run_name: str, config: dict):
    try:
        import wandb
    except ImportError:
        if mode == "online":
            raise UserError("logging.wandb is 'online' but wandb is not installed "
                            "(pip install -e '.[wandb]')") from None
        print("layerskip-train: wandb is not installed; metrics go to metrics.jsonl only", file=sys.stderr)
        return None
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ["WANDB_MODE"] = mode  # offline: no network at all (a set API key must not make it try)
    try:
        return wandb.init(project=project, name=run_name or output_dir.name, dir=str(output_dir), mode=mode,
                          config=config, settings=wandb.Settings(init_timeout=60, silent=True))
    except Exception as e:  # noqa: BLE001 - tracking must never stop training
        print(f"layerskip-train: wandb did not start ({type(e).__name__}: {e}); metrics go to metrics.jsonl only",
              file=sys.stderr)
        return None
