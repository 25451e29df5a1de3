"""The project's lock file: whatever is found in its place (a symlink, a folder, a FIFO, a damaged or foreign stamp)
is one line or an unknown holder, never a traceback, a hang or a write through a symlink (issue 37)."""

from __future__ import annotations

import json
import os
import socket

import pytest

from deadline import deadline
from layerskip_core.errors import UserError
from layerskip_core.locks import FileLock, Holder


def test_a_symlinked_lock_never_writes_its_target(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    lock = tmp_path / "x.lock"
    lock.symlink_to(target)
    with deadline(10), pytest.raises(UserError, match="symbolic link") as e:
        FileLock(lock).acquire()
    assert target.read_text() == "keep me\n" and lock.is_symlink() and "\n" not in str(e.value)
    dangling = tmp_path / "y.lock"
    dangling.symlink_to(tmp_path / "not-yet")
    with pytest.raises(UserError, match="symbolic link"):
        FileLock(dangling).acquire()
    assert not (tmp_path / "not-yet").exists()  # not created through the link either


@pytest.mark.parametrize("kind", ["folder", "fifo", "socket"])
def test_something_else_in_the_locks_place_is_one_line(tmp_path, kind):
    lock = tmp_path / "x.lock"
    {"folder": lock.mkdir, "fifo": lambda: os.mkfifo(lock),
     "socket": lambda: socket.socket(socket.AF_UNIX).bind(str(lock))}[kind]()
    with deadline(10), pytest.raises(UserError, match=f"lock file {lock} cannot be used") as e:
        FileLock(lock).acquire()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("stamp", ['{"pid": 1e999, "host": "h", "started": "t"}', '{"pid": -3, "host": "h", '
                                   '"started": "t"}', '{"pid": true, "host": "h", "started": "t"}',
                                   '{"pid": 12, "host": ["h"], "started": "t"}', "", "\x00\xff garbage",
                                   "[" * 100_000, '{"pid": 99999999999999999999999, "host": "h", "started": "t"}'])
def test_a_damaged_stamp_is_an_unknown_holder_not_a_crash(tmp_path, stamp):
    assert Holder.parse(stamp) is None
    lock = tmp_path / "x.lock"
    lock.write_text(stamp, errors="surrogateescape")
    taker = FileLock(lock)
    assert taker.acquire() is None and taker.previous is None  # a free lock with garbage in it: taken over
    assert Holder.parse(lock.read_text()).pid == os.getpid()
    taker.release()


def test_a_stale_stamp_from_another_host_is_taken_over_naming_it(tmp_path):
    lock = tmp_path / "x.lock"
    lock.write_text(json.dumps({"pid": 4242, "host": "other-machine", "started": "2026-01-01T00:00:00+00:00"}))
    taker = FileLock(lock)
    assert taker.acquire() is None
    assert taker.previous.describe() == "pid 4242 on other-machine, since 2026-01-01T00:00:00+00:00"
    taker.release()
