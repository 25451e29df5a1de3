"""``deadline(seconds)``: a test body that runs longer fails with TimeoutError instead of hanging the suite.

SIGALRM interrupts the main thread, including a blocking system call (opening a FIFO, reading a pipe); the
earlier alarm is restored afterwards. For work that may hang inside C code that never returns to Python, run
a child process with ``subprocess.run(..., timeout=...)`` instead.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
