"""What the GPU lease programs (gpu_check, gpu_compare, gpu_bundle, gpu_lease) share: the checkout's root, where
results go, their JSON written whole, the commit without ``.git``. Their library is the rest of ``tools.gpu``.

They run from a bare checkout (no pip install: a GPU image with its own torch) as ``python3 -m tools.gpu.NAME`` in the
checkout's root, which puts the root on ``sys.path``. That cannot make a missing required package (torch,
transformers, tokenizers, safetensors, numpy, pyyaml, tqdm) importable; optional ones become notes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from infer.measure.provenance import git_commit
from layerskip_core import jsonfile

REPO = Path(__file__).resolve().parents[2]
"""The checkout's root (``tools/gpu/lease.py`` two folders down)."""
COMMIT_FILE = REPO / "runs" / "lease" / "meta" / "COMMIT"
"""Written by ``gpu_bundle.py`` into the carried ``runs/lease/meta`` folder: the commit, where ``.git`` is absent."""


def out_dir(given: str | os.PathLike | None) -> Path:
    """Where a lease command writes: ``given``, else ``$OUT`` (the folder that comes back from the device), else
    ``runs/gpu/`` in the checkout."""
    if given:
        return Path(given)
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "runs" / "gpu"


def write_json(path: Path, value) -> None:
    """Write ``value`` as JSON atomically (``jsonfile.write``), so a command killed mid-write leaves the last complete
    version."""
    jsonfile.write(path, json.dumps(value, indent=1) + "\n")


def commit() -> str:
    """The checkout's commit: from git ('+dirty' for local changes), else ``runs/lease/meta/COMMIT``, else '?'."""
    return git_commit(REPO) or (COMMIT_FILE.read_text().strip() if COMMIT_FILE.is_file() else "?")
