"""The command line starts light: ``layerskip --help``, an unknown command or flag, and a bad flag of a command that
loads no model (fetch-model, export, plan, eval-exits, train's launcher) answer without importing torch; only the
command that runs has its parser built (the drafters' options, which import torch, only for the commands that
draft)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import contextlib, io, sys
from layerskip_cli.main import main
err = io.StringIO()
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
    try:
        code = main(sys.argv[1:])
    except SystemExit as e:
        code = e.code
heavy = sorted(m for m in ("torch", "transformers", "infer.drafters", "infer.model.runner") if m in sys.modules)
print(code, ",".join(heavy) or "-", err.getvalue().strip().count("\\n") + 1 if err.getvalue().strip() else 0)
"""


def run_probe(*argv: str) -> tuple[int, str, int]:
    """(exit code, the heavy modules imported, lines on stderr) of ``layerskip ARGV`` in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    code, heavy, lines = proc.stdout.split()
    return int(code), heavy, int(lines)


@pytest.mark.parametrize("argv, code", [
    (["--help"], 0),
    (["--bogus"], 2),
    (["nope"], 2),
    (["fetch-model", "--bogus"], 2),
    (["fetch-model", "--help"], 0),
    (["export", "--bogus"], 2),
    (["plan", "show"], 2),
    (["eval-exits", "--bogus"], 2),
])
def test_help_and_refusals_answer_without_torch(argv, code):
    got, heavy, lines = run_probe(*argv)
    assert (got, heavy) == (code, "-"), (argv, got, heavy)
    assert code == 0 or lines == 1  # a refusal is one line


def test_a_command_that_drafts_builds_its_own_parser_only():
    """``generate``'s parser (its drafter flags from the registry) is built for generate; the other commands are
    listed by name and help, and ``layerskip --help`` lists every command as before."""
    from layerskip_cli.main import COMMANDS, build_parser, command_name

    names = [command_name(module)[0] for module in COMMANDS]
    assert names == ["fetch-model", "generate", "search", "plan", "draft-vocab", "bench", "eval-exits", "train",
                     "export"]
    full, light = build_parser(), build_parser("fetch-model")
    listed = lambda parser: {a.dest: a.help for a in parser._subparsers._group_actions[0]._choices_actions}  # noqa: E731
    assert listed(full) == listed(light) and len(listed(full)) == len(names)
    argv = ["generate", "--prompt", "x", "--drafter", "early_exit", "--exit-layer", "2"]
    args = build_parser("generate").parse_args(argv)
    assert (args.command, args.exit_layer) == ("generate", 2)
