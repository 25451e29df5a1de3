"""The README's shell commands as written: every `layerskip ...` and `python train/layerskip.py ...` line parses
(subcommand and flags exist), every subcommand's --help answers, and the cheap ones run on the default model from a
clone's root (generation shortened with --max-new-tokens)."""

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from layerskip_cli.main import build_parser
from layerskip_cli.main import main as cli
from train.layerskip import build_parser as train_parser

REPO = Path(__file__).resolve().parents[1]


def readme_commands() -> list[list[str]]:
    """The README's bash lines (continuations joined, comments dropped) as argument lists."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                commands.append(argv)
    return commands


def layerskip_commands() -> list[list[str]]:
    return [argv[1:] for argv in readme_commands() if argv[0] == "layerskip"]


def test_the_readme_has_commands_to_check():
    assert len(layerskip_commands()) >= 10


@pytest.mark.parametrize("argv", layerskip_commands(), ids=lambda a: " ".join(a)[:60])
def test_every_layerskip_command_parses_as_written(argv):
    if argv[0] == "train":
        train_parser().parse_intermixed_args(argv[1:])
    else:
        build_parser().parse_args(argv)


def test_every_training_script_line_parses():
    lines = [argv for argv in readme_commands() if argv[:2] == ["python", "train/layerskip.py"]]
    assert lines
    for argv in lines:
        train_parser().parse_intermixed_args(argv[2:])


@pytest.mark.parametrize("command", sorted({argv[0] for argv in layerskip_commands()}))
def test_every_subcommand_answers_help(command, capsys):
    with pytest.raises(SystemExit) as done:
        cli([command, "--help"])
    assert done.value.code == 0 and "usage:" in capsys.readouterr().out


@pytest.mark.real_model
def test_the_generate_lines_run_from_a_clones_root(default_model_path, tmp_path, monkeypatch, capsys):
    (tmp_path / "plans").symlink_to(REPO / "plans")  # a clone's root, where the README's commands run
    monkeypatch.chdir(tmp_path)
    ran = 0
    for argv in readme_commands():
        if argv[0] == "printf":  # the README writes its prompts file itself
            subprocess.run(shlex.join(argv[:-2]) + " > " + argv[-1], shell=True, check=True)
        elif argv[:2] == ["layerskip", "generate"] and "runs/" not in " ".join(argv) and "--save-plan" not in argv:
            assert cli(argv[1:] + ["--max-new-tokens", "6", "--threads", "1"]) == 0, argv
            ran += 1
    assert ran >= 3 and capsys.readouterr().out
