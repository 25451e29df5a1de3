"""``layerskip``: fetch the default model, generate with any drafter, search plans, benchmark."""

from __future__ import annotations

import argparse
import sys

from core.errors import UserError
from infer.commands import bench, fetch_model, generate, search

COMMANDS = (fetch_model, generate, search, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="layerskip", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        print(f"layerskip: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("layerskip: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
