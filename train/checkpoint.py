"""Resumable checkpoints and the final plain Hugging Face model folder.

Layout of a run folder (``checkpoint.output_dir``)::

    config.yaml                   the resolved config of the run
    metrics.jsonl                 one JSON object per log/eval event
    checkpoints/step-000100/      accelerate state (model, optimizer, scheduler, RNG of every process)
        trainer_state.json        step, tokens seen; written last, so its presence marks a complete checkpoint
        config.yaml               the resolved config, beside every checkpoint
    final/                        config.json + model.safetensors + tokenizer (LoRA merged): load it with
                                  transformers, infer.model.runner.Runner or ``layerskip generate --model``

One folder holds one run: a new run into a folder holding another is refused (resume it, choose
another folder, or ``--overwrite`` to delete it first), a resume checks that the config matches,
and ``trainer_state.json`` records how many lines ``metrics.jsonl`` had, so a resumed run cuts the
log back to the checkpoint instead of repeating steps. A training holds the folder's lock
(``.layerskip-run.lock``, ``hold_run_folder``) for its whole life, so a second training into the same
folder is refused naming the holder, and temporary folders carry the run's tag (host and pid), so a
checkpoint never holds another run's files; a lock or temporaries left by a killed run are taken over.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import yaml

from layerskip_core import inputs, jsonfile
from layerskip_core.errors import UserError
from layerskip_core.locks import holding
from layerskip_core.packages import ensure_writable_dir, normal_permissions
from train.config import TrainConfig
from train.console import quiet_tied_weight_save
from train.recipe import dump_config, to_dict

STATE_FILE = "trainer_state.json"
PREFIX = "step-"
RUN_LOCK = ".layerskip-run.lock"
"""The lock file a training holds in its output folder while it runs."""


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_in_name(name: str) -> int | None:
    """The step a checkpoint folder's name says (``step-`` and ASCII digits, e.g. ``step-000300``), or None for
    any other name (``step-000300.bak``, a copy; ``step-²``, which ``str.isdigit`` accepts and ``int`` refuses).
    The one reader of checkpoint names."""
    named = name[len(PREFIX):] if name.startswith(PREFIX) else ""
    return int(named) if named.isascii() and named.isdigit() else None


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (a checkpoint's name, a state file), oldest first; anything else in ``checkpoints/``
    (a copy such as ``step-000300.bak``) is not one (:func:`note_skipped` says so)."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if step_in_name(p.name) is not None and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: step_in_name(p.name))


def note_skipped(output_dir: str | Path) -> list[str]:
    """Say once, on stderr, which entries of ``checkpoints/`` are not checkpoints by name and are skipped (a copied
    ``step-000300.bak``, another file); a run's own temporaries (``.tmp-*``) are not named. Returns the names."""
    root = checkpoints_dir(output_dir)
    skipped = sorted(p.name for p in root.iterdir() if step_in_name(p.name) is None
                     and not p.name.startswith(".tmp-")) if root.is_dir() else []
    if skipped:
        print(f"layerskip: note: skipped what in {root} is not a checkpoint by name ({PREFIX}<step>): "
              f"{', '.join(skipped)}", file=sys.stderr)
    return skipped


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


RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints", "final", ".tmp-final", "wandb")
"""What a training run writes into its output folder (``--overwrite`` removes exactly these)."""
RESUMABLE_CHANGES = ("optim.max_steps", "checkpoint.", "logging.", "threads", "data.cache_dir")
"""Config keys (or prefixes) that may differ between a checkpoint and the run resuming it: the run's
length, checkpointing, logging and threads. Everything else must match, or the resumed run would not
be the run the checkpoint came from."""


def run_files(output_dir: str | Path) -> list[str]:
    """The names of a training run's files present in ``output_dir``."""
    out = Path(output_dir)
    return [name for name in RUN_FILES if (out / name).exists()]


def check_overwrite(cfg: TrainConfig) -> None:
    """Refuse ``--overwrite`` when a path the run reads (the model, a data source, the token cache) lies in what
    it would delete: the run would delete its own input (e.g. ``model.name_or_path=<the run folder>/final``)."""
    out = Path(cfg.checkpoint.output_dir)
    doomed = [Path(os.path.realpath(out / name)) for name in run_files(out)]
    reads = [("model.name_or_path", cfg.model.name_or_path), ("data.cache_dir", cfg.data.cache_dir),
             *((f"data.sources[{i}].path", s.path) for i, s in enumerate(cfg.data.sources))]
    for key, value in reads:
        if not value or value == "default":
            continue
        src = Path(os.path.realpath(Path(value).expanduser()))
        hit = next((d for d in doomed if src == d or src.is_relative_to(d)), None)
        if hit is not None:
            raise UserError(f"--overwrite would delete {hit}, which holds {key}={value} that this run reads; copy "
                            "it out of the run folder first, or choose another checkpoint.output_dir")


def clear_run(output_dir: str | Path) -> None:
    """Delete a previous run's files from ``output_dir`` (other files stay)."""
    out = Path(output_dir)
    for name in run_files(out):
        target = out / name
        shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()


def _flatten(d: dict, prefix: str = "") -> dict:
    flat = {}
    for k, v in d.items():
        if isinstance(v, dict):
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def config_differences(saved: dict, current: dict, defaults: dict | None = None) -> list[str]:
    """``key: saved -> current`` for every key that differs and may not change on resume.

    A key missing from ``saved`` (written before the key existed) counts as its default.
    """
    old, new, dflt = _flatten(saved), _flatten(current), _flatten(defaults or {})
    diffs = []
    for key, value in new.items():
        if key.startswith(RESUMABLE_CHANGES) or key in RESUMABLE_CHANGES:
            continue
        before = old.get(key, dflt.get(key))
        if before != value:
            diffs.append(f"{key}: {before!r} -> {value!r}")
    return diffs


def _check_same_run(ckpt: Path, cfg: TrainConfig) -> None:
    if not (ckpt / "config.yaml").exists():
        return  # checkpoints of older versions lack it; nothing to compare against
    text = inputs.read_text(ckpt / "config.yaml", "checkpoint config file")  # not a FIFO, device or huge file
    try:
        saved = yaml.safe_load(text)
    except yaml.YAMLError:
        return
    if not isinstance(saved, dict):
        return
    diffs = config_differences(saved, to_dict(cfg), to_dict(TrainConfig()))
    if diffs:
        shown = "; ".join(diffs[:4]) + (f"; and {len(diffs) - 4} more" if len(diffs) > 4 else "")
        raise UserError(f"cannot resume {ckpt}: it was written with a different config ({shown}); resume with its "
                        f"values (see {ckpt / 'config.yaml'}) or start a new run in another checkpoint.output_dir")


def prepare_run_folder(cfg: TrainConfig, overwrite: bool = False) -> Path | None:
    """Decide how this run uses its output folder; return the checkpoint to resume from (or None).

    A folder holding another run is refused unless the run resumes it (``--resume``; the saved
    config must match, see :data:`RESUMABLE_CHANGES`) or ``overwrite`` is set (refused when the run reads a path
    inside what it would delete; the caller deletes the old run's files with :func:`clear_run` once the model and
    data have loaded). Only the (empty) folder is created here.
    """
    out = Path(cfg.checkpoint.output_dir)
    mode = cfg.checkpoint.resume
    if out.exists() and not out.is_dir():
        raise UserError(f"checkpoint.output_dir {out} is a file, not a folder; choose another checkpoint.output_dir")
    if overwrite and mode != "never":
        raise UserError("--overwrite starts the run again from step 0; it cannot be combined with --resume "
                        f"(checkpoint.resume={mode})")
    ensure_writable_dir(out, "checkpoint.output_dir", "choose a writable checkpoint.output_dir")
    present = run_files(out)
    if not overwrite:
        note_skipped(out)
    if overwrite:
        check_overwrite(cfg)
    if mode == "never":
        if present and not overwrite:
            found = list_checkpoints(out)
            resume = (f"continue it with --resume (from {found[-1].name}), " if found
                      else "it has no checkpoint to resume; ")
            raise UserError(f"{out} already holds a training run ({', '.join(present)}); {resume}write to a new "
                            "folder with checkpoint.output_dir=<dir>, or pass --overwrite to delete it and start again")
        return None
    ckpt = find_resume(cfg)
    if ckpt is None:
        if present:
            raise UserError(f"{out} holds a training run ({', '.join(present)}) but no checkpoint to resume from; "
                            "pass --overwrite to start it again, or use a new checkpoint.output_dir")
        return None
    if present and ckpt.resolve().parent.parent != out.resolve():
        raise UserError(f"{out} already holds a training run ({', '.join(present)}); to continue {ckpt} in it, "
                        "choose a new checkpoint.output_dir instead")
    newer = [p.name for p in list_checkpoints(out) if _step_of(p) > _step_of(ckpt)]
    if newer:
        raise UserError(f"cannot resume from {ckpt}: newer checkpoints of the run exist ({', '.join(newer)}), and "
                        "the resumed run would mix with them; resume from the newest (--resume) or remove them")
    _check_same_run(ckpt, cfg)
    return ckpt


def _step_of(ckpt: Path) -> int:
    try:
        return int(read_state(ckpt)["step"])
    except UserError:
        named = step_in_name(ckpt.name)
        return -1 if named is None else named


def read_state(path: Path) -> dict:
    """A checkpoint's ``trainer_state.json`` (step and tokens: non-negative integers; the step the folder's name
    ``step-N`` says, when it has such a name), strictly read."""
    file = Path(path) / STATE_FILE
    state = jsonfile.read(file, "checkpoint state file", hint="resume from another checkpoint")
    with jsonfile.checked(file, "checkpoint state file", "resume from another checkpoint"):
        step = jsonfile.integer(state["step"], "step", 0)
        jsonfile.integer(state.get("tokens", 0), "tokens", 0)
        named = step_in_name(Path(path).name)
        if named is not None and named != step:
            raise ValueError(f"it says step {step}, but its folder is {Path(path).name} (a checkpoint's state "
                             "describes the step it was saved at)")
    return state


def check_rng_states(ckpt: Path) -> None:
    """Refuse a checkpoint whose saved random states do not load (accelerate would go on without them, and the
    resumed run would draw other data orders and dropouts than the run it continues)."""
    import torch

    for path in sorted(Path(ckpt).glob("random_states_*.pkl")):
        try:
            torch.load(path, map_location="cpu", weights_only=False)  # as accelerate loads it
        except Exception as e:  # unpickling a damaged file raises many kinds
            raise UserError(f"cannot resume from {ckpt}: {path.name} is damaged or cut off ({type(e).__name__}); "
                            "resume from an earlier checkpoint (checkpoint.resume=<its folder>) or start again with "
                            "--overwrite") from None


@contextmanager
def hold_run_folder(cfg: TrainConfig) -> Iterator[None]:
    """Hold ``checkpoint.output_dir``'s lock while the body runs (the main process of a launch, RANK 0, only).

    Another live training holding it is refused in one line naming it; the lock of a training that died
    is taken over with a note, and its temporary folders are removed.
    """
    out = Path(cfg.checkpoint.output_dir)
    if os.environ.get("RANK", "0") not in ("", "0") or (out.exists() and not out.is_dir()):
        yield  # another rank of this launch, or a file where the folder should be (prepare_run_folder says so)
        return
    ensure_writable_dir(out, "checkpoint.output_dir", "choose a writable checkpoint.output_dir")
    with holding(out / RUN_LOCK, lambda holder: f"{out} is in use by another training ({holder}); wait for it to end "
                 "or choose another checkpoint.output_dir") as lock:
        if lock.previous is not None:
            print(f"layerskip: note: {out} was locked by a training that ended without releasing it "
                  f"({lock.previous.describe()}); taking it over", file=sys.stderr)
        for tmp in [*out.glob(".tmp-final*"), *checkpoints_dir(out).glob(".tmp-*")]:  # no one else writes here now
            shutil.rmtree(tmp, ignore_errors=True)
        with suppress(OSError):
            checkpoints_dir(out).rmdir()  # only when nothing but temporaries was there
        yield


def run_tag(accelerator) -> str:
    """This run's tag for temporary folder names: the main process's host and pid, the same on every process."""
    tag = [f"{socket.gethostname()}-{os.getpid()}"]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(tag)
    return tag[0]


def save_checkpoint(accelerator, cfg: TrainConfig, step: int, state: dict) -> Path:
    """Write ``checkpoints/step-N`` atomically (all processes call this) and prune old ones."""
    root = checkpoints_dir(cfg.checkpoint.output_dir)
    final = root / f"{PREFIX}{step:06d}"
    tmp = root / f".tmp-{PREFIX}{step:06d}-{run_tag(accelerator)}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    with quiet_tied_weight_save():
        accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        dump_config(cfg, tmp / "config.yaml")
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **state}, indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        keep = cfg.checkpoint.keep_last
        if keep:  # only checkpoints up to this step are this run's history; never prune past it
            mine = [p for p in list_checkpoints(cfg.checkpoint.output_dir) if _step_of(p) <= step]
            for old in mine[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def export_final(accelerator, lm, tokenizer, cfg: TrainConfig, out_dir: str | Path) -> Path:
    """Save a plain HF folder (config + safetensors + tokenizer), LoRA adapters merged into the weights."""
    from train.model import plain_model  # torch-heavy: only when exporting

    out_dir = Path(out_dir)
    state = None
    if not cfg.lora.enabled:  # gathers ZeRO-3 shards; every process must take part
        full = accelerator.get_state_dict(lm)
        state = {k[len("model."):]: v for k, v in full.items() if k.startswith("model.")}
    if accelerator.is_main_process:
        hf = plain_model(accelerator.unwrap_model(lm).model)
        hf.config.use_cache = True
        tmp = out_dir.with_name(f".tmp-{out_dir.name}-{socket.gethostname()}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        hf.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        dump_config(cfg, tmp / "layerskip_train.yaml")
        normal_permissions(tmp)  # safetensors writes 0600: the exported model must be readable like any file
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    accelerator.wait_for_everyone()
    return out_dir
