"""A lock file the project owns: one holder at a time, stamped with who holds it, never left stale by a crash.

``FileLock`` takes an exclusive ``flock`` on its file and writes the holder (pid, host, start time) into it.
The operating system drops the ``flock`` when its process dies, however it dies (``kill -9``, the OOM
killer), so a dead holder never blocks anyone: the next taker finds the old stamp with the lock free,
notes it (``previous``) and takes over. The file is removed on release. Used for the kernel build
(``infer.kernels``: wait with a message) and a training's run folder (``train.checkpoint``: refuse).

The lock file is opened without following symlinks and must be a regular file: a symlink (which would make the
stamp overwrite its target), a folder, a FIFO or a device in its place is refused in one line (``UserError``),
and a stamp that is garbage, empty or out of range (``{"pid": 1e999}``) is an unknown holder, never a crash.

What it cannot do: ``flock`` is advisory (a tool that ignores it is not stopped) and, on network file
systems without lock support, may lock nothing.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from layerskip_core.errors import UserError


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a lock."""

    pid: int
    """Process id of the holder."""
    host: str
    """Host name of the holder's machine."""
    started: str
    """When it took the lock (UTC, ISO 8601)."""

    def describe(self) -> str:
        if self.pid == 0:  # no stamp could be read: say so rather than name a process 0 that does not exist
            return "a process whose stamp in the lock file could not be read"
        return f"pid {self.pid} on {self.host}, since {self.started}"

    @classmethod
    def me(cls) -> Holder:
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        return cls(os.getpid(), socket.gethostname(), now)

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        """The holder stamped in a lock file's text; None when it is empty or not a stamp (a pid that is no
        positive integer, a host or time that is no short string)."""
        try:
            d = json.loads(text)
            pid, host, started = d["pid"], d["host"], d["started"]
        except (ValueError, TypeError, KeyError, RecursionError):
            return None
        if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid < 2**31:
            return None
        if not isinstance(host, str) or not isinstance(started, str) or len(host) > 255 or len(started) > 64:
            return None
        return cls(pid, host, started)


class FileLock:
    """An exclusive lock on ``path`` (created on demand); ``acquire`` returns the live holder when it is taken."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.previous: Holder | None = None
        """A holder that died without releasing (its stamp was found with the lock free), after ``acquire``."""
        self._fd: int | None = None

    def acquire(self) -> Holder | None:
        """Take the lock without waiting: None on success, else who holds it (an unknown holder: pid 0)."""
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _stamp(fd)
                os.close(fd)
                return holder or Holder(0, "unknown host", "unknown time")
            if _same_file(fd, self.path):  # not a file a releasing holder unlinked meanwhile
                break
            os.close(fd)
        self.previous = Holder.parse(_read(fd))
        stamp = json.dumps(Holder.me().__dict__).encode()
        os.pwrite(fd, stamp, 0)  # over the old stamp, then cut what is left of it: never an empty file between
        os.ftruncate(fd, len(stamp))
        os.fsync(fd)
        self._fd = fd
        return None

    def _open(self) -> int:
        """The lock file, opened (created if need be) without following a symlink or blocking; a regular file."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as e:
            raise UserError(f"lock file {self.path} cannot be used: {_what_is_there(self.path, e)}; remove it (no "
                            "process of this project holds it then) and start again") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UserError(f"lock file {self.path} cannot be used: it is not a regular file; remove it and start "
                            "again")
        os.set_blocking(fd, True)
        return fd

    def wait(self, seconds: float, what: str, poll: float = 0.5) -> Holder | None:
        """Acquire, waiting up to ``seconds`` with one line on stderr naming the holder; None when taken, else the
        holder still there at the end."""
        deadline = time.monotonic() + seconds
        holder = self.acquire()
        if holder is not None:
            print(f"layerskip: waiting for {holder.describe()}, which holds {self.path} ({what}); "
                  f"giving up after {seconds:.0f} s", file=sys.stderr, flush=True)
        while holder is not None and time.monotonic() < deadline:
            time.sleep(poll)
            holder = self.acquire()
        return holder

    def release(self) -> None:
        """Remove the file and drop the lock (nothing when not held)."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None


@contextmanager
def holding(path: str | os.PathLike, refusal: Callable[[str], str]) -> Iterator[FileLock]:
    """The lock ``path`` held for the ``with`` block and released after it; a live holder is refused in one line,
    ``refusal(its description)`` (a dead holder's lock is taken over: the lock's ``previous`` says whose)."""
    lock = FileLock(path)
    holder = lock.acquire()
    if holder is not None:
        raise UserError(refusal(holder.describe()))
    try:
        yield lock
    finally:
        lock.release()


def _what_is_there(path: Path, error: OSError) -> str:
    if path.is_symlink():
        return "it is a symbolic link (a lock never follows one: the stamp would overwrite its target)"
    if path.is_dir():
        return "it is a folder"
    return error.strerror or str(error)


STAMP_WAIT = 1.0
"""Seconds a refused taker waits for the holder's stamp: a holder writes it right after taking the lock, so one that
has just taken it may not have written it yet."""


def _stamp(fd: int) -> Holder | None:
    """The holder stamped in the locked file ``fd``, read again for up to ``STAMP_WAIT`` s while it is not there."""
    deadline = time.monotonic() + STAMP_WAIT
    while (holder := Holder.parse(_read(fd))) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return holder


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 4096, 0).decode("utf-8", "replace")
    except OSError:
        return ""


def _same_file(fd: int, path: Path) -> bool:
    try:
        mine, named = os.fstat(fd), os.stat(path)
        return (mine.st_dev, mine.st_ino) == (named.st_dev, named.st_ino)
    except FileNotFoundError:
        return False
