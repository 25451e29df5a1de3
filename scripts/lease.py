"""What the GPU lease commands (gpu_check, gpu_compare, gpu_bundle) share: where results go, the wall budget,
optional packages, the commit without ``.git`` and CUDA kernel names.

Importing this module puts the checkout's root on ``sys.path``, so ``python3 scripts/gpu_check.py`` runs from a bare
checkout (no pip install: a GPU image with its own torch). It cannot make a missing required package (torch,
transformers, tokenizers, safetensors, numpy, pyyaml, tqdm) importable; optional ones become notes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

OPTIONAL = ("accelerate", "optuna", "datasets", "wandb", "gguf", "deepspeed", "peft")
"""Packages a lease command runs without: a missing one is a recorded note, not a failure."""
COMMIT_FILE = REPO / "runs" / "lease" / "meta" / "COMMIT"
"""Written by ``gpu_bundle.py`` into the carried ``runs/lease/meta`` folder: the commit, where ``.git`` is absent."""
ATTENTION_WORDS = ("attention", "attn", "flash", "fmha", "sdpa", "softmax", "cudnn")
"""Substrings of the CUDA kernel names counted as attention kernels."""


def out_dir(given: str | os.PathLike | None) -> Path:
    """Where a lease command writes: ``given``, else ``$OUT`` (the folder that comes back from the device), else
    ``runs/gpu/`` in the checkout."""
    if given:
        return Path(given)
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "runs" / "gpu"


def write_json(path: Path, value) -> None:
    """Write ``value`` as JSON through a temporary file and a rename, so a command killed mid-write leaves the last
    complete version."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(tmp, path)


def commit() -> str:
    """The checkout's commit: from git ('+dirty' for local changes), else ``runs/lease/meta/COMMIT``, else '?'."""
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        if rev:
            return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return COMMIT_FILE.read_text().strip() if COMMIT_FILE.is_file() else "?"


def optional_missing(error: BaseException) -> str | None:
    """The optional package whose absence raised ``error`` (None when it is something else)."""
    if isinstance(error, ModuleNotFoundError) and error.name:
        root = error.name.split(".")[0]
        return root if root in OPTIONAL else None
    return None


class Budget:
    """A command's own wall budget: nothing new starts once ``seconds`` have passed (0: no budget)."""

    def __init__(self, seconds: float, started: float | None = None):
        self.seconds = seconds
        self.started = time.perf_counter() if started is None else started

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def over(self, reserve: float = 0.0) -> bool:
        """Whether fewer than ``reserve`` seconds of the budget are left."""
        return self.seconds > 0 and self.elapsed() > self.seconds - reserve


def kernel_profile(fn: Callable[[], object], device) -> dict:
    """CUDA kernels one call of ``fn`` launches (a forward): how many, and the attention kernels by name (torch's
    profiler). On a CPU the fields are present with a note."""
    if getattr(device, "type", str(device)) != "cuda":
        return {"kernels_per_forward": None, "attention_kernels": [], "kernel_note": "CPU: no CUDA kernels"}
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    attention = sorted({n for n in names if any(w in n.lower() for w in ATTENTION_WORDS)})
    return {"kernels_per_forward": len(names), "attention_kernels": attention,
            "kernel_note": "" if names else "the profiler saw no CUDA kernel (CUPTI unavailable?)"}


def compile_count() -> int:
    """Graphs torch.compile (dynamo) has compiled in this process so far (0 where torch does not count them)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])
