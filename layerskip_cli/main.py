"""``layerskip``: fetch the default model, generate with any drafter, search plans, benchmark, train, evaluate exits."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from layerskip_cli.commands import bench, draft_vocab, eval_exits, export, fetch_model, generate, plan, search, train
from layerskip_core.cli import Parser, run_main

COMMANDS = (fetch_model, generate, search, plan, draft_vocab, bench, eval_exits, train, export)


class _Listed(Exception):
    """Raised by ``_Names.add_parser``: a command's register stops once its name and help are known."""


class _Names:
    """A stand-in for the subparsers of ``layerskip``: records the name and help a command's ``register`` gives its
    parser, and stops the rest of it (options, drafter flags: what imports torch)."""

    def __init__(self) -> None:
        self.found: list[tuple[str, str | None]] = []

    def add_parser(self, name: str, help: str | None = None, **_) -> None:
        self.found.append((name, help))
        raise _Listed


def command_name(command) -> tuple[str, str | None]:
    """The name and one-line help of a command module (its parser is not built)."""
    names = _Names()
    with contextlib.suppress(_Listed):
        command.register(names)
    [found] = names.found
    return found


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``layerskip`` parser: every command listed by name and help, and only ``command``'s own parser built
    (``None``: every command's), so ``--help``, an unknown command and a command's bad flags answer without building
    the others (the drafters' options import torch)."""
    parser = Parser(prog="layerskip", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        name, text = command_name(module)
        if command is None or name == command:
            module.register(sub)
        else:
            sub.add_parser(name, help=text)
    return parser


def chosen_command(argv: list[str]) -> str:
    """The command ``argv`` names (its first argument that is no option), or '' when it names none."""
    return next((a for a in argv if not a.startswith("-")), "")


BROKEN_PIPE = 128 + 13
"""The exit status of a command whose reader went away (``| head``): a Unix tool killed by SIGPIPE reports 141."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["train"]:  # every later argument (--help included) belongs to train/layerskip.py
            code = run_main("layerskip", lambda: train.main(argv[1:]))
        else:
            parser = build_parser(chosen_command(argv))
            args = parser.parse_args(argv)
            code = run_main("layerskip", lambda: args.func(args))
        sys.stdout.flush()  # a reader that left meanwhile is met here, not at the interpreter's exit
        return code
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """The output's reader closed it (``layerskip generate --json | head -c 10``): stop quietly as Unix tools do,
    with standard output pointed at the null device so the interpreter's last flush cannot fail again."""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # a stream without a descriptor (captured)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    return BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
