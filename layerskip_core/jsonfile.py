"""One strict reader for the JSON files the project writes (plans, gate memory, draft vocabularies, counts).

``read`` parses a file into a JSON object: nesting deeper than ``MAX_DEPTH`` is refused before parsing
(no RecursionError), and so are NaN, Infinity and numbers too large for a float (``1e999``), an object
with one key twice (the last silently winning would be a wrong result) and a byte order mark. Files are
read through ``layerskip_core.inputs`` (regular files of bounded size only). Every problem is one
``UserError`` naming the file, what is wrong and what to do. ``checked`` turns the ``ValueError`` of the
field checks (``integer``, ``integers``, ``number``, ``obj``, ``text``) into such a line; the checks
refuse booleans and fractional numbers where an integer belongs instead of rounding them.
It does not check a file's meaning beyond types and ranges: each reader does that.
"""

from __future__ import annotations

import json
import math
import operator
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from layerskip_core import inputs
from layerskip_core.errors import UserError

MAX_DEPTH = 64
"""Deepest nesting of arrays and objects accepted (the project's files nest at most 4 deep)."""

_BRACKETS = re.compile(r'"(?:[^"\\]++|\\.)*+"?|[\[\]{}]', re.DOTALL)
"""A string (possessive: never backtracks; one not closed runs to the end of the text) or a bracket, so the
depth count is one linear pass whatever the text: a cut-off string is scanned once, not once per way of
splitting it."""


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number this project accepts (finite numbers only)")


def _finite(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"number {literal[:20]} is too large (finite numbers only)")
    return value


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"key {key[:40]!r} appears twice in one object (which one is meant?)")
        seen.add(key)
    return dict(pairs)


def parse(text: str):
    """The JSON value of ``text``; ValueError when it is not JSON, nests too deep, holds a non-finite number or
    an object with one key twice, or starts with a byte order mark."""
    if text.startswith("\ufeff"):
        raise ValueError("it starts with a byte order mark (BOM); save it as UTF-8 without BOM")
    depth = 0
    for m in _BRACKETS.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise ValueError(f"nested more than {MAX_DEPTH} levels deep")
        elif c in "]}":
            depth -= 1
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite, object_pairs_hook=_unique_keys)


def write(path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a temporary file of its own beside it (unique per writer, so two
    processes saving the same file never share one), flushed to disk, then renamed over ``path``. A reader sees
    the old file or the new one, never a part; two writers at once leave one of their files whole. On failure
    the temporary file is removed and the OSError raised."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600: the file is shared like any plan or cache file
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise


def read(path, what: str, fmt: str | None = None, hint: str = "") -> dict:
    """The JSON object in ``path`` (a ``what``, e.g. 'plan file'), with ``"format": fmt`` when ``fmt`` is given.

    ``hint`` says how to make a good one; it ends the message of a missing or invalid file.
    """
    path = Path(path).expanduser()
    tail = f" ({hint})" if hint else ""
    data = inputs.read_bytes(path, what, hint)  # a regular file of sane size: else one line
    try:
        value = parse(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise UserError(f"{path} is not a valid {what}: not JSON (not UTF-8 text: byte {data[e.start:e.start + 1]!r} "
                        f"on line {line}){tail}") from None
    except (ValueError, RecursionError) as e:  # RecursionError: belt and braces, MAX_DEPTH stops it first
        raise UserError(f"{path} is not a valid {what}: not JSON ({e}){tail}") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} is not a valid {what}: it holds a JSON {type(value).__name__}, not an object{tail}")
    if fmt is not None and value.get("format") != fmt:
        raise UserError(f"{path} is not a valid {what}: format is {value.get('format')!r}, expected {fmt!r}{tail}")
    return value


@contextmanager
def checked(path, what: str, hint: str = "") -> Iterator[None]:
    """Inside: a ValueError, TypeError or KeyError of a field check becomes one UserError naming the file."""
    try:
        yield
    except KeyError as e:
        raise UserError(f"{Path(path).expanduser()} is not a valid {what}: {e} is missing"
                        + (f" ({hint})" if hint else "")) from None
    except (ValueError, TypeError) as e:
        raise UserError(f"{Path(path).expanduser()} is not a valid {what}: {e}"
                        + (f" ({hint})" if hint else "")) from None


def integer(value, name: str, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as an int in [lo, hi]; booleans, fractions and strings are refused, never rounded."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, not {str(value).lower()}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, not {value!r}") from None
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} is {value}, expected {_range(lo, hi)}")
    return value


def integers(values, name: str, lo: int | None = None, hi: int | None = None) -> list[int]:
    """A JSON list of integers in [lo, hi] (see ``integer``)."""
    if not isinstance(values, list):
        raise ValueError(f"{name} must be a list of integers, not {type(values).__name__}")
    return [integer(v, f"{name}[{i}]", lo, hi) for i, v in enumerate(values)]


def number(value, name: str, lo: float | None = None, hi: float | None = None) -> float:
    """``value`` as a finite float in [lo, hi] (integers accepted, booleans and strings refused)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, not {value!r}")
    if not math.isfinite(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} is {value}, expected a number {_range(lo, hi)}")
    return float(value)


def obj(value, name: str) -> dict:
    """``value`` when it is a JSON object."""
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object, not {type(value).__name__}")
    return value


def text(value, name: str) -> str:
    """``value`` when it is a JSON string."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, not {type(value).__name__}")
    return value


def _range(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"in [{lo}, {hi}]"
    return f">= {lo}" if lo is not None else f"<= {hi}"
