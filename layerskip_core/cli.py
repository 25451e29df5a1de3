"""One command-line policy for every entry point: bad input is one line on stderr and exit code 2.

``Parser`` is the one argument parser of every entry point (no prefix matching of long options);
``run_main`` wraps a command's body (``parse_and_run``: a script's parse-then-run tail); ``add_output_flags`` and
``write_result`` are a script's result file (its flag and ``--force``; the JSON written whole); ``split_named``
parses the ``NAME=PATH`` labels that several commands accept for models (``--model base=default --model
trained=runs/x/final``);
``holding_output_dir`` holds an output folder under a lock while a command writes there (two runs never mix);
``check_output_file`` / ``check_output_dir`` refuse an output path before any work is done: the one output-file
policy is that an existing file is refused unless the command was given ``--force``, and ``check_distinct``
refuses two outputs of one command that are the same file. Folders (``check_output_dir``) may already exist, but
one that holds files the command writes (an earlier run's results) is refused unless ``--force``, as a file is.
No output may be one of the command's own inputs (``inputs``; ``check_not_input``): ``--force`` never lets a
command write over what it reads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from layerskip_core import jsonfile
from layerskip_core.errors import UserError
from layerskip_core.locks import holding

OUTPUT_LOCK = ".layerskip-output.lock"
"""The lock file a command holds in its output folder while it writes there (``holding_output_dir``)."""


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` without abbreviations: ``--fallback`` is refused instead of being taken for
    ``--fallback-opt-budget``. Subcommand parsers (``add_subparsers().add_parser``) are of this class too."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        """A bad flag is one line and exit code 2, as every other refusal (no usage block first)."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def finite_float(text: str) -> float:
    """An argparse ``type`` for a number flag: a finite float (``inf``, ``nan`` and ``1e999`` refused in one line)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def run_main(prog: str, body: Callable[[], int | None]) -> int:
    """Call ``body``; a ``UserError`` becomes ``PROG: error: MESSAGE`` and exit code 2, Ctrl-C 130."""
    try:
        return body() or 0
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def parse_and_run(p: argparse.ArgumentParser, argv: list[str] | None, prog: str,
                  body: Callable[[argparse.Namespace], int | None]) -> int:
    """A script's tail: its flags parsed, then ``body(args)`` under ``run_main``'s error policy."""
    args = p.parse_args(argv)
    return run_main(prog, lambda: body(args))


def add_output_flags(p: argparse.ArgumentParser, help: str, flag: str = "--out", required: bool = False) -> None:
    """A script's result flag (``--out`` or ``--json``: a path, ``help`` saying what goes there) and ``--force``,
    which lets it write over an earlier run's result."""
    p.add_argument(flag, type=Path, default=None, required=required, help=help)
    p.add_argument("--force", action="store_true", help=f"write over an earlier run's result at {flag}")


def write_result(path: Path, value, lines: bool = False) -> None:
    """``value`` as strict JSON (no NaN) into ``path`` (its folder created), whole or not at all
    (``jsonfile.write``); ``lines``: a list written one JSON object per line (JSONL)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(v, allow_nan=False) + "\n" for v in value) if lines else \
        json.dumps(value, indent=1, allow_nan=False) + "\n"
    jsonfile.write(path, text)


def split_named(spec: str) -> tuple[str, str]:
    """``'NAME=PATH'`` -> ``('NAME', 'PATH')``; a plain ``'PATH'`` -> ``('', 'PATH')``.

    Only the first ``=`` separates, so a path may itself contain ``=``; an empty name or value is refused.
    """
    name, sep, value = spec.partition("=")
    if not sep:
        return "", spec
    if not name.strip() or not value.strip():
        raise UserError(f"{spec!r}: expected NAME=PATH (e.g. trained=runs/demo/final) or a plain path")
    return name.strip(), value.strip()


def _writable_ancestor(target: Path) -> Path | None:
    """The nearest existing folder above ``target`` if a file can be created in it (tried, then removed), else None.

    Trying beats ``os.access``: root passes every permission check, yet cannot create files in /proc.
    """
    parent = next((p for p in target.parents if p.exists()), None)
    if parent is None or not parent.is_dir():
        return None
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".layerskip-probe-"):
            pass
    except OSError:
        return None
    return parent


Inputs = tuple[tuple[str, "str | os.PathLike | None"], ...]
"""A command's inputs as (flag, path) pairs; None = not given."""


def _real(path: str | os.PathLike) -> Path:
    return Path(os.path.realpath(Path(path).expanduser()))


def check_not_input(what: str, target: str | os.PathLike, inputs: Inputs,
                    writes: tuple[str, ...] | None = None) -> None:
    """Refuse an output that is one of the command's ``inputs`` (symlinks resolved, hard links compared): an output
    file or folder equal to an input, or a folder output (``writes`` = the files it writes there) holding an input
    under a name it writes. A new folder inside an input folder is fine (an export into its run folder)."""
    out = _real(target)
    for flag, given in inputs:
        if given is None or str(given) == "":
            continue
        src = _real(given)
        same = src == out or (src.exists() and out.exists() and os.path.samefile(src, out))
        inside = writes is not None and any(src == out / name for name in writes)
        if same or inside:
            raise UserError(f"{what} {target} would write over {flag} {given}, which this command reads; give the "
                            "output its own path")


def check_output_file(path: str | os.PathLike, what: str, *, force: bool, inputs: Inputs = ()) -> Path:
    """Refuse, before any work, a file path that is a folder, that exists (unless ``force``: the user's --force),
    that is one of the command's ``inputs`` (even with ``force``) or whose folder cannot be created or written."""
    target = Path(path).expanduser()
    check_not_input(what, target, inputs)
    if target.is_dir():
        raise UserError(f"{what} {target} is a folder; give a file path")
    if target.exists() and not force:
        raise UserError(f"{what} {target} exists; pass --force to overwrite it or choose another path")
    if target.exists() and not os.access(target, os.W_OK):
        raise UserError(f"{what} {target} exists and is not writable; choose another path")
    if not target.exists() and _writable_ancestor(target) is None:
        raise UserError(f"{what} {target}: cannot create it (no writable folder above it); choose another path")
    return target


def check_distinct(*outputs: tuple[str, str | os.PathLike | None]) -> None:
    """Refuse two (flag, path) outputs of one command that name the same file (None = not asked for)."""
    seen: dict[Path, str] = {}
    for flag, path in outputs:
        if path is None:
            continue
        key = Path(os.path.realpath(Path(path).expanduser()))
        if key in seen:
            raise UserError(f"{seen[key]} and {flag} are the same file {path}; give each output its own path")
        seen[key] = flag


def check_output_dir(path: str | os.PathLike, what: str, *, writes: tuple[str, ...] = (), force: bool = False,
                     inputs: Inputs = ()) -> Path:
    """Refuse, before any work, an output folder that is an existing file, cannot be created or written, holds
    any of the files ``writes`` names (an earlier run's results) unless ``force`` (the user's --force), or would
    write over one of the command's ``inputs`` (``check_not_input``; even with ``force``)."""
    target = Path(path).expanduser()
    check_not_input(what, target, inputs, writes)
    if target.exists() and not target.is_dir():
        raise UserError(f"{what} {target} is an existing file; give a folder")
    if target.is_dir() and not os.access(target, os.W_OK | os.X_OK):
        raise UserError(f"{what} {target} is not writable; choose another folder")
    if not target.exists() and _writable_ancestor(target) is None:
        raise UserError(f"{what} {target}: cannot create it (no writable folder above it); choose another folder")
    held = [name for name in writes if (target / name).exists()]
    if held and not force:
        raise UserError(f"{what} {target} already holds {', '.join(held)} from an earlier run; pass --force to "
                        "write over them or choose a new folder")
    return target


@contextmanager
def holding_output_dir(path: str | os.PathLike, what: str) -> Iterator[Path]:
    """The output folder ``path`` (created), held under a lock for the ``with`` block: a second command writing into
    the same folder meanwhile is refused in one line naming the holder, instead of mixing its results in; a holder
    that died leaves nothing blocking (``layerskip_core.locks``)."""
    target = Path(path).expanduser()
    created = not target.exists()
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{what} {target}: cannot create it ({e.strerror or e}); choose another folder") from None
    try:
        with holding(target / OUTPUT_LOCK, lambda holder: f"{what} {target} is in use by another run ({holder}), "
                     "which writes its results there; wait for it to end or choose another folder"):
            yield target
    finally:
        if created:  # a command refused before it wrote anything leaves no empty folder behind
            with suppress(OSError):
                target.rmdir()
