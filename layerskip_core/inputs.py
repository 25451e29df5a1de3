"""One check for every file a command reads (prompts, plans, vocabularies, gate memory, adapters, recipes).

A path that is not a regular file would block or never end: opening a FIFO for reading waits for a writer,
``/dev/zero`` reads forever, a socket cannot be opened at all, and a multi-gigabyte file given by mistake
fills memory. ``opened`` opens the path without blocking (``O_NONBLOCK``, so a FIFO opens at once), refuses
anything ``fstat`` does not call a regular file and anything larger than the reader's limit, and yields the
open binary file: the check and the read are on the same open file, so nothing can be swapped in between.
``check`` is the same refusal for readers that open the file themselves (safetensors). Every refusal is one
``UserError`` naming the file and what to give instead.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from layerskip_core.errors import UserError

MAX_BYTES = 256 * 2**20
"""Largest text input read whole (plans, vocabularies, counts, gate memory, recipes, prompts): 256 MiB."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _refuse(path: Path, st: os.stat_result, what: str, hint: str, max_bytes: int | None) -> None:
    tail = f" ({hint})" if hint else ""
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{what} {path} is {_kind(st.st_mode)}, not a regular file; give the path of a {what}{tail}")
    _check_size(path, st.st_size, what, hint, max_bytes)


def _check_size(path: Path, size: int, what: str, hint: str, max_bytes: int | None) -> None:
    if max_bytes is not None and size > max_bytes:
        tail = f" ({hint})" if hint else ""
        raise UserError(f"{what} {path} is {size / 2**20:.0f} MiB or more, larger than the {max_bytes / 2**20:.0f} "
                        f"MiB a {what} can be; check that this is the file you meant{tail}")


def _os_error(path: Path, e: OSError, what: str, hint: str) -> UserError:
    tail = f" ({hint})" if hint else ""
    if isinstance(e, FileNotFoundError):
        return UserError(f"{what} {path} does not exist{tail}")
    if isinstance(e, IsADirectoryError):
        return UserError(f"{what} {path} is a folder; give the path of a {what}{tail}")
    if e.errno == errno.ENXIO:  # a socket cannot be opened
        try:
            kind = _kind(os.stat(path).st_mode)
        except OSError:
            kind = "not a regular file"
        return UserError(f"{what} {path} is {kind}, not a regular file; give the path of a {what}{tail}")
    return UserError(f"cannot read {what} {path}: {e.strerror or e}")


def check(path: str | os.PathLike, what: str, hint: str = "", max_bytes: int | None = None) -> Path:
    """``path`` when it names a regular file (symlinks followed) of at most ``max_bytes``; else one UserError."""
    path = Path(path).expanduser()
    try:
        st = os.stat(path)
    except OSError as e:
        raise _os_error(path, e, what, hint) from None
    _refuse(path, st, what, hint, max_bytes)
    return path


@contextmanager
def opened(path: str | os.PathLike, what: str, hint: str = "", max_bytes: int | None = MAX_BYTES) -> Iterator[BinaryIO]:
    """The open binary file at ``path`` once it is known to be a regular file of at most ``max_bytes``."""
    path = Path(path).expanduser()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise _os_error(path, e, what, hint) from None
    try:
        _refuse(path, os.fstat(fd), what, hint, max_bytes)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        yield f


def read_bytes(path: str | os.PathLike, what: str, hint: str = "", max_bytes: int = MAX_BYTES) -> bytes:
    """The whole content of a regular file of at most ``max_bytes`` (one that grows past it while read is refused)."""
    with opened(path, what, hint, max_bytes) as f:
        try:
            data = f.read(max_bytes + 1)
        except OSError as e:
            raise _os_error(Path(path).expanduser(), e, what, hint) from None
    _check_size(Path(path).expanduser(), len(data), what, hint, max_bytes)
    return data


def read_text(path: str | os.PathLike, what: str, hint: str = "", max_bytes: int = MAX_BYTES) -> str:
    """``read_bytes`` as UTF-8 text; a file that is not UTF-8 is one UserError naming the first bad byte's line."""
    data = read_bytes(path, what, hint, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        tail = f" ({hint})" if hint else ""
        raise UserError(f"{Path(path).expanduser()} is not a valid {what}: not UTF-8 text (byte "
                        f"{data[e.start:e.start + 1]!r} on line {line}); save it as UTF-8{tail}") from None
