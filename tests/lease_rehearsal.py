"""The GPU lease sequence of docs/GPU.md, rehearsed once per session on the CPU: the documented `run` commands,
verbatim, through bash, each with an emptied $OUT as on the device; no model cache, no registry, no gguf (the
packages the GPU image lacks are hidden from every process); a tiny saved model in place of the carried GGUF."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from layerskip_core.packages import cache_root
from tiny_models import save_tiny

REPO = Path(__file__).resolve().parents[1]
ABSENT = ("optuna", "datasets", "wandb", "gguf", "deepspeed")
"""Packages the GPU machine's image lacks."""
HIDE = f"""
import sys
ABSENT = {ABSENT!r}


class Hide:
    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT or not hasattr(self.inner, "find_spec"):
            return None
        return self.inner.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self.inner, name)


sys.meta_path[:] = [Hide(f) for f in sys.meta_path]
"""
"""A sitecustomize that hides ABSENT from every import finder of every process that starts with it on its path."""


def lease_calls() -> list[dict]:
    """The `run` calls of docs/GPU.md's lease sequence (one JSON object per line between its markers)."""
    text = (REPO / "docs" / "GPU.md").read_text()
    block = text.split("<!-- lease:sequence:begin -->")[1].split("<!-- lease:sequence:end -->")[0]
    return [json.loads(line) for line in block.splitlines() if line.startswith("{")]


def rehearse(root: Path) -> dict:
    """Run every documented command in ``root``; returns {"calls", "outs": [$OUT of each], "procs", "stash"}."""
    hide, shim = root / "hide", root / "bin"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE)
    shim.mkdir()
    python3 = shim / "python3"  # the device's python3 is its torch interpreter; here, ours (a venv's: not a link)
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python3.chmod(0o755)
    model = save_tiny(root / "tiny", layers=8, max_position_embeddings=4096)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OUT")}
    env |= {"PATH": f"{shim}{os.pathsep}{env.get('PATH', '')}", "PYTHONPATH": str(hide),
            "LAYERSKIP_CACHE": str(root / "empty-cache"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "LEASE_STASH": str(root / "stash"), "LEASE_MODEL": str(model), "LEASE_BUNDLE": str(root / "no-bundle"),
            # the compiled CPU kernel is a build product, not a model: reuse it rather than rebuild it
            "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR") or str(cache_root() / "kernels")}
    calls, outs, procs = lease_calls(), [], []
    for i, call in enumerate(calls):
        out = root / f"out{i + 1}"
        out.mkdir()
        procs.append(subprocess.run(["bash", "-c", call["command"]], cwd=REPO, env=env | {"OUT": str(out)},
                                    capture_output=True, text=True, timeout=1800))  # a busy CPU, not a lease
        outs.append(out)
    return {"calls": calls, "outs": outs, "procs": procs, "stash": root / "stash"}


def returned_files(out: Path) -> list[Path]:
    """The files of $OUT that come back from the device, checked against its limits (8 files, 2 folders down, names
    of letters, digits, '.', '_' and '-')."""
    files = [f for f in out.rglob("*") if f.is_file()]
    assert len(files) <= 8, files
    for f in files:
        rel = f.relative_to(out)
        assert len(rel.parts) <= 3 and all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in rel.parts), rel
        assert f.stat().st_size <= 16 * 2**20, rel
    return files
