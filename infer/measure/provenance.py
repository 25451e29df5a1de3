"""Where a measurement came from: the toolkit's git commit and the machine, device and library versions."""

from __future__ import annotations

import platform
import subprocess
import time
from pathlib import Path

from layerskip_core.device import dtype_name
from layerskip_core.settings import Resolved


def machine_info(run: Resolved) -> dict:
    """CPU, versions, threads, commit, date, device, GPU, dtype and executor of a run with ``run``'s settings."""
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else None
    return {"cpu": cpu, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": run.threads, "git": git_commit(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "device": str(run.device), "gpu": gpu,
            "dtype": dtype_name(run.dtype), "executor": run.executor}


def git_commit(root: Path | None = None) -> str | None:
    """The commit of the checkout at ``root`` (default: the toolkit's own) with '+dirty' for local changes, when it
    is a git checkout."""
    root = root or Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("+dirty" if dirty else "") if rev else None

