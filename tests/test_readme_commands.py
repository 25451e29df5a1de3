"""The commands the README, docs/ and the recipes' headers show, as written.

Every command line in a ``bash`` (or unlabelled) code block of README.md and docs/*.md, and every command of a
recipe's header comment, that starts a program of this project (``layerskip``, ``python train/layerskip.py``,
``python scripts/X.py``, ``accelerate launch ... train/layerskip.py``, ``make``) parses: its entry point runs up to
the end of argument parsing, every drafter spec it names is a valid spec, a recipe it names loads with its
overrides, and every drafter spec quoted in the docs' prose is one. Commands that take hours (training, benchmarks,
the GPU scripts) are checked that far only. The cheap ones run for real, in document order, in a copy of the
repository (generation shortened with --max-new-tokens, searches with tiny settings), and none of them may be
refused or change a committed file (``git status`` of the copy).
"""

import argparse
import importlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from layerskip_cli.main import main as cli
from script_modules import load_script
from train.layerskip import main as train_main

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PROGRAMS = ("layerskip", "python", "python3", "accelerate", "make", "printf", "tail")
PLACEHOLDERS = re.compile(r"\.\.\.|<[^>]*>|\bX\.yaml\b|\$[A-Z]|\b(M|D|P\.json|DIR|OUT|FILE)\b")
"""Commands with a placeholder (elided options, recipes/X.yaml, a model M, a folder DIR, $E, <path>) only parse."""
REFUSED_ON_PURPOSE = {"autoregressive:E=8"}
"""Old spellings the README names as refused (it says so next to them)."""


def doc_commands(path: Path) -> list[list[str]]:
    """The command lines of ``path``'s bash and unlabelled code blocks (continuations joined, env assignments and
    comments dropped, ``&&`` chains split) that start one of ``PROGRAMS``."""
    commands = []
    for lang, block in re.findall(r"```(\w*)\n(.*?)```", path.read_text(encoding="utf-8"), re.S):
        if lang not in ("", "bash"):
            continue
        for line in block.replace("\\\n", " ").splitlines():
            try:
                argv = shlex.split(line, comments=True)
            except ValueError:  # not a shell line (a table, prose)
                continue
            while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
                argv = argv[1:]
            while "&&" in argv:
                i = argv.index("&&")
                commands.append(argv[:i])
                argv = argv[i + 1:]
            if argv and argv[0] in PROGRAMS:
                commands.append(argv)
    return [c for c in commands if c and c[0] in PROGRAMS]


def recipe_commands(path: Path) -> list[list[str]]:
    """The commands a recipe's header comment shows (``#   python train/layerskip.py --config ...``)."""
    comments = [line[1:] for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("#")]
    commands = []
    for line in "\n".join(comments).replace("\\\n", " ").splitlines():
        match = re.match(r"\s+(?:[\w ?]+:\s+)?((?:layerskip|python|accelerate) .*)", line)
        if match:
            commands.append(shlex.split(match.group(1), comments=True))
    return commands


def all_commands() -> list[tuple[str, list[str]]]:
    pages = [(p.name, argv) for p in DOCS for argv in doc_commands(p)]
    return pages + [(p.name, argv) for p in sorted((REPO / "recipes").glob("*.yaml")) for argv in recipe_commands(p)]


def entry(argv: list[str]):
    """(main function, its arguments) of a project command; None for shell utilities and ``python -c``."""
    if argv[0] == "layerskip":
        return cli, argv[1:]
    if argv[0] == "accelerate":
        script = next(i for i, a in enumerate(argv) if a.endswith(".py"))
        assert argv[script] == "train/layerskip.py", argv
        return train_main, argv[script + 1:]
    if argv[0].startswith("python") and argv[1:2] == ["-m"]:
        assert argv[2].startswith(("train.", "infer.", "layerskip_", "tools.")), f"not a project module: {argv[2]}"
        return importlib.import_module(argv[2]).main, argv[3:]
    if argv[0].startswith("python") and argv[1:2] != ["-c"]:
        if argv[1] == "train/layerskip.py":
            return train_main, argv[2:]
        assert argv[1].startswith("scripts/") and (REPO / argv[1]).is_file(), f"no such script: {argv[1]}"
        return load_script(Path(argv[1]).stem).main, argv[2:]
    return None


class Parsed(Exception):
    """Raised by argument parsing in ``parse_only``: the command got as far as its options."""


@pytest.fixture()
def parse_only(monkeypatch):
    """Every parser stops its program right after parsing, with the namespace."""
    for name in ("parse_args", "parse_intermixed_args"):
        original = getattr(argparse.ArgumentParser, name)

        def stop(self, *args, _original=original, **kwargs):
            raise Parsed(_original(self, *args, **kwargs))

        monkeypatch.setattr(argparse.ArgumentParser, name, stop)


def check_specs(argv: list[str]) -> None:
    """Every drafter spec of ``--drafters`` is valid (a plan file made by an earlier step may be missing), every
    ``--drafter`` names one and every peer of ``--peers`` is one."""
    from infer import parse_spec
    from infer.drafters import drafter_class
    from infer.drafters.spec import BEST
    from infer.measure.methods import parse_peer
    from layerskip_core.errors import UserError

    for flag, value in zip(argv, argv[1:], strict=False):
        if flag == "--drafter":
            parse_spec(value) if value == BEST else drafter_class(value)  # a drafter's name, or `best`
        if flag == "--drafters":
            for spec in (s for s in value.split(",") if "$" not in s):  # $P: a shell variable the doc sets
                try:
                    parse_spec(spec)
                except UserError as e:
                    assert "does not exist" in str(e), f"{spec}: {e}"
        if flag == "--peers" and value != "none":
            for peer in value.split(","):
                parse_peer(peer)


def test_the_docs_have_commands_of_every_kind():
    kinds = {argv[0] if argv[0] != "python3" else "python" for _, argv in all_commands()}
    assert {"layerskip", "python", "accelerate", "make"} <= kinds and len(all_commands()) >= 60


@pytest.mark.parametrize("doc,argv", all_commands(), ids=lambda x: x if isinstance(x, str) else " ".join(x)[:70])
def test_every_documented_command_parses(doc, argv, parse_only, capsys):
    if argv[0] == "make":
        proc = subprocess.run(["make", "-n", "--no-print-directory", *argv[1:], "VENV=/tmp/dry-venv"], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return
    target = entry(argv)
    if target is None:
        return
    main, args = target
    if "..." in args:
        return  # elided options: a record of what ran, not a command to run
    with pytest.raises((Parsed, SystemExit)) as done:
        main(args)
    if done.type is SystemExit:  # --help and --help-config end here, successfully
        assert done.value.code in (0, None), capsys.readouterr().err
        return
    check_specs(args)
    namespace = done.value.args[0]
    config = getattr(namespace, "config", None)
    overrides = list(getattr(namespace, "overrides", []))
    if main is train_main and config and (REPO / config).is_file() and not re.search(r"[$\[]", " ".join(overrides)):
        from train.recipe import load_config

        load_config(REPO / config, overrides)  # the recipe and its overrides load (strict keys and values)


def test_every_drafter_spec_in_the_docs_is_valid():
    from infer import parse_spec
    from layerskip_core.errors import UserError

    pattern = re.compile(r"\b(autoregressive|early_exit|self_sd|swift)((?::[A-Za-z_]+=[^\s`',|)\"]+)+)")
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for match in pattern.finditer(text):
            spec = match.group(0).rstrip(".;:")
            if "$" in spec:
                continue  # $E: a shell variable the doc sets
            if spec in REFUSED_ON_PURPOSE:
                assert "refused" in text[match.start():match.end() + 80], spec
                continue
            try:
                parse_spec(spec)
            except UserError as e:
                assert "does not exist" in str(e), f"{doc.name}: {spec}: {e}"  # a plan an earlier step makes


# --------------------------------------------------------------------------- the cheap commands, run
CHEAP = {  # what is appended to a command so that it runs in seconds (later options override earlier ones)
    "generate": ["--max-new-tokens", "6", "--threads", "1"],
    "search": ["--n", "1", "--max-new-tokens", "4", "--trials", "2", "--cost", "weights", "--quiet", "--threads", "1"],
    "plan": [],
}
RUN_ELSEWHERE = ("runs/", "skip_layers.json", "--model default --drafters")
"""Inputs made by hours-long steps (runs/), external files, and benchmarks: parsed above, not run here."""


def runnable(argv: list[str]) -> bool:
    line = " ".join(argv)
    if argv[0] == "printf" or argv[:2] == ["python", "-c"] or argv[:3] == ["python", "-m",
                                                                           "tools.results.write_results"]:
        return True
    return (argv[0] == "layerskip" and argv[1] in CHEAP and not PLACEHOLDERS.search(line)
            and not any(s in line for s in RUN_ELSEWHERE))


def copy_of_the_repo(dest: Path) -> Path:
    """The working tree's tracked files, committed in a fresh repository at ``dest``."""
    listed = shutil.which("git") and subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True)
    if not listed or listed.returncode != 0:
        pytest.skip("not a git checkout (or no git): no committed files to compare with")
    files = listed.stdout
    for name in filter(None, files.split("\0")):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for step in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "copy"]):
        subprocess.run(git + step, cwd=dest, check=True, capture_output=True)
    return dest


def pages_with_runnable_commands() -> list[str]:
    return [p.name for p in DOCS if any(runnable(argv) for argv in doc_commands(p))]


def run_shell(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """A shell line of the docs (``printf ... > f``, ``python -c ...``, ``tail``), with this checkout's code."""
    line = shlex.join([sys.executable if argv[0] == "python" else argv[0], *argv[1:]]).replace(" '>' ", " > ")
    return subprocess.run(line, shell=True, cwd=cwd, capture_output=True, text=True,
                          env=os.environ | {"PYTHONPATH": str(REPO)}, executable="/bin/bash")


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.parametrize("page", pages_with_runnable_commands())
def test_the_cheap_documented_commands_run_and_change_no_committed_file(page, default_model_path, tmp_path,
                                                                         monkeypatch, capsys):
    """Each page's cheap commands in its order, in a fresh copy of the repository (a page's steps build on each
    other, pages do not)."""
    clone = copy_of_the_repo(tmp_path / "clone")
    monkeypatch.chdir(clone)
    (clone / "runs" / "compare").mkdir(parents=True)  # a fresh clone's run folder before `make compare` fills it
    ran = []
    for argv in doc_commands(REPO / page if page == "README.md" else REPO / "docs" / page):
        if not runnable(argv):
            continue
        if entry(argv) is None:  # shell lines: the prompts files the docs write
            proc = run_shell(argv, clone)
            assert proc.returncode == 0, (argv, proc.stderr)
        else:
            main, args = entry(argv)
            cheap = CHEAP.get(argv[1], []) if argv[0] == "layerskip" else []
            code = main(args + cheap + (["--trials", "3"] if "--resume" in argv else []))  # a resume adds trials
            assert code in (0, None), (argv, capsys.readouterr().err[-2000:])
        ran.append(" ".join(argv))
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=clone,
                            capture_output=True, text=True, check=True).stdout
    assert status == "", f"documented commands changed committed files:\n{status}"
    assert ran
