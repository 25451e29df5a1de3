"""``layerskip``: fetch the default model, generate with any drafter, search plans, benchmark, train, evaluate exits."""

from __future__ import annotations

import argparse
import sys

from layerskip_cli.commands import bench, draft_vocab, eval_exits, export, fetch_model, generate, plan, search, train
from layerskip_core.cli import Parser, run_main

COMMANDS = (fetch_model, generate, search, plan, draft_vocab, bench, eval_exits, train, export)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="layerskip", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # every later argument (--help included) belongs to train/layerskip.py
        return run_main("layerskip", lambda: train.main(argv[1:]))
    parser = build_parser()
    args = parser.parse_args(argv)
    return run_main("layerskip", lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
