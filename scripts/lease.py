"""What the GPU lease commands (gpu_check, gpu_compare, gpu_bundle, gpu_lease) share as programs: the checkout on
``sys.path``, where results go, their JSON written whole, the commit without ``.git``. Their library part (the budget,
the check's parts, the comparison's pipeline) is ``infer.measure.gpu``.

Importing this module puts the checkout's root on ``sys.path``, so ``python3 scripts/gpu_check.py`` runs from a bare
checkout (no pip install: a GPU image with its own torch). It cannot make a missing required package (torch,
transformers, tokenizers, safetensors, numpy, pyyaml, tqdm) importable; optional ones become notes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from infer.measure.provenance import git_commit  # noqa: E402  (after the checkout is on sys.path)
from layerskip_core import jsonfile  # noqa: E402

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
