"""What the training launcher checks before any work, and what it says on screen beside metrics.jsonl.

``check_launch`` refuses, in one line, a launch that would run but not as asked: a DeepSpeed config on a machine
without a GPU (accelerate's DeepSpeed plugin needs one: on a CPU it starts every process as plain DDP, and 8 of them
exhaust a small machine's memory minutes later). It runs in every launched process before torch is imported; only
local rank 0 prints. ``accelerate launch --cpu --num_processes N`` (N > 1) starts one process that would train alone:
``cpu_relaunch`` gives the launch that starts the N synchronised processes asked for, which the script replaces
itself with (so nothing fails under accelerate's launcher). The launching command is read from ``/proc`` (Linux);
elsewhere that case cannot be seen.

``quiet_tied_weight_save`` drops accelerate's "Removed shared tensor" warning while a checkpoint is saved: a tied
LM head is stored once by design and comes back on load (the resume tests check it bit for bit).

``eval_summary`` is the one line an evaluation prints; ``resume_hint`` what an interrupted run prints, and
``interrupt_on_sigterm`` makes SIGTERM (a scheduler's stop, ``kill``) end the run the way Ctrl-C does;
``sigterm_held`` keeps it out of a checkpoint or export being written (it arrives when the write is done): an
exception raised at an arbitrary point of a save could leave a writer thread's lock taken and the process unable
to exit.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from layerskip_core.errors import UserError

TWO_CPU_PROCESSES = ("ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes {n} --num_machines 1 "
                     "train/layerskip.py ...  (or --config_file configs/accelerate/cpu-ddp.yaml)")
"""The launch that does start N synchronised CPU processes (DDP over gloo)."""


def launcher_command(pid: int | None = None) -> list[str]:
    """The command line of the process that started this one (``accelerate launch ...``); [] where unknown."""
    try:
        raw = Path(f"/proc/{pid or os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def requested_processes(command: Sequence[str]) -> int:
    """``--num_processes N`` (or ``--num-processes``) of an ``accelerate launch`` command; 1 when absent."""
    if not any("accelerate" in part for part in command[:3]):
        return 1
    for i, part in enumerate(command):
        match = re.fullmatch(r"--num[_-]processes(?:=(\d+))?", part)
        if match:
            value = match.group(1) or (command[i + 1] if i + 1 < len(command) else "1")
            return int(value) if value.isascii() and value.isdigit() else 1
    return 1


def check_launch(environ: Mapping[str, str], command: Sequence[str], has_gpu) -> None:
    """Refuse a DeepSpeed launch without a GPU.

    ``has_gpu``: a callable (so torch is imported only for a DeepSpeed launch)."""
    if environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true" and not has_gpu():
        if environ.get("LOCAL_RANK", "0") != "0":
            raise SystemExit(2)  # local rank 0 says why
        raise UserError(
            "this is a DeepSpeed launch, but no GPU is visible: accelerate's DeepSpeed plugin needs GPUs; on a CPU "
            "use configs/accelerate/cpu-ddp.yaml (two processes) or plain `python train/layerskip.py` (one)")


RELAUNCHED = "LAYERSKIP_RELAUNCHED"
"""Set in the environment of a relaunch (``cpu_relaunch``), so that it never relaunches again."""


def cpu_relaunch(environ: Mapping[str, str], command: Sequence[str], script: str | os.PathLike,
                 argv: Sequence[str]) -> list[str] | None:
    """The launch of ``script argv`` as the N synchronised CPU processes (DDP over gloo) that ``command``, an
    ``accelerate launch --cpu --num_processes N``, asked for but did not start (it starts one); None when the
    processes did start or one was asked for. Run it with ``ACCELERATE_USE_CPU=true`` and ``RELAUNCHED`` set."""
    wanted = requested_processes(command)
    if "WORLD_SIZE" in environ or wanted <= 1:
        return None
    if environ.get(RELAUNCHED):
        raise UserError(f"the relaunch as {wanted} CPU processes started one process again; launch with: "
                        f"{TWO_CPU_PROCESSES.format(n=wanted)}")
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(wanted),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(script), *argv]


def eval_summary(record: Mapping) -> str:
    """One line per evaluation: the final layer's loss, then each exit's top-1 agreement with it and its loss."""
    loss, agreement = record.get("exit_loss", {}), record.get("exit_agreement", {})
    exits = sorted(loss, key=int)
    if not exits:
        return "eval: no validation examples"
    parts = [f"E{e} agree {agreement.get(e, float('nan')):.3f} loss {loss[e]:.3f}" for e in exits[:-1]]
    return f"eval: final loss {loss[exits[-1]]:.3f}" + (f"; {', '.join(parts)}" if parts else "")


def resume_hint(argv: Sequence[str], output_dir: str | os.PathLike, has_checkpoint: bool = True) -> str:
    """What an interrupted run prints: where its checkpoints are and the command that continues it; with no
    checkpoint saved (``--resume`` would be refused), the command that starts it again."""
    args = " ".join(a for a in argv if a not in ("--resume", "--overwrite"))
    if not has_checkpoint:
        return (f"interrupted before its first checkpoint; nothing to resume in {output_dir}; start again with: "
                f"python train/layerskip.py {args} --overwrite".replace("  ", " "))
    return (f"interrupted; checkpoints are in {output_dir}; continue with: "
            f"python train/layerskip.py {args} --resume".replace("  ", " "))


def interrupt_on_sigterm() -> None:
    """From now on SIGTERM raises KeyboardInterrupt in the main thread, as Ctrl-C does."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


@contextmanager
def sigterm_held():
    """While inside, a SIGTERM is recorded, not delivered; on leaving, the handler it would have reached runs
    (once). Only the main thread handles signals, so elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[tuple[int, object]] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
    if received and callable(previous):
        previous(*received[0])
    elif received and previous == signal.SIG_DFL:
        os.kill(os.getpid(), signal.SIGTERM)


class _DropSharedTensorNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Removed shared tensor" not in record.getMessage()


@contextmanager
def quiet_tied_weight_save():
    """While inside, accelerate's "Removed shared tensor ... while saving" warning is not shown (only that one)."""
    logger = logging.getLogger("accelerate.utils.other")
    note = _DropSharedTensorNote()
    logger.addFilter(note)
    try:
        yield
    finally:
        logger.removeFilter(note)
