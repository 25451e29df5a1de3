"""One command-line policy for every entry point: bad input is one line on stderr and exit code 2.

``run_main`` wraps a command's body; ``split_named`` parses the ``NAME=PATH`` labels that several
commands accept for models (``--model base=default --model trained=runs/x/final``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from core.errors import UserError


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
