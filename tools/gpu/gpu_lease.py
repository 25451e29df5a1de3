"""The GPU lease, one subcommand per device command (docs/GPU.md, "Running on an offline GPU machine").

    python3 -m tools.gpu.gpu_lease check      # device command 1 (carries runs/lease/meta and runs/lease/a)
    python3 -m tools.gpu.gpu_lease compare    # device command 2, back to back (runs/lease/meta and runs/lease/b)
    python3 -m tools.gpu.gpu_lease stash      # only keep the first half (when command 2 found a fresh machine)
    python -m tools.gpu.gpu_lease publish DIR # here, afterwards: DIR's results into docs/

``check`` keeps the GGUF's first half in the stash folder (``$LEASE_STASH``, default ``$LAYERSKIP_CACHE/lease``: kept
on the machine between back-to-back commands) and runs ``gpu_check.py`` under its wall budget. ``compare`` installs
the carried wheels into the stash's ``site``, joins the two
halves (sha256 checked) and runs ``gpu_compare.py --form first`` under its budget; ``--form full --previous FILE``
is a later stage that carries over an earlier stage's rows. Both write under ``$OUT`` (else ``runs/gpu/``),
``lease_<stage>.json`` included (what was staged, notes, exit codes, seconds). ``$LEASE_MODEL``: a model folder to
use instead of the carried GGUF (the CPU rehearsal in the tests; on a CPU both stages run tiny settings).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from layerskip_core.cli import Parser, finite_float
from layerskip_core.errors import UserError
from layerskip_core.packages import cache_root
from tools.doc_sections import GPU_CHECK, GPU_COMPARE, GPU_TRAINING, read_page, replace_section
from tools.gpu import lease
from tools.gpu.budget import COMMAND_BUDGET_S, GRACE_S, Budget

BUDGET_S = {"check": COMMAND_BUDGET_S, "compare": COMMAND_BUDGET_S}
"""Default wall budget of each device command's work (docs/GPU.md: timeout_s = budget + GRACE_S + start-up)."""
BUNDLE = Path(os.environ.get("LEASE_BUNDLE") or lease.REPO / "runs" / "lease")
"""Where gpu_bundle.py writes the carried folders: meta, a, b (``$LEASE_BUNDLE`` moves it: the tests' rehearsal)."""
STASH = Path(os.environ.get("LEASE_STASH") or cache_root() / "lease")
"""Kept on the GPU machine between back-to-back commands: the GGUF's first half, wheels, the run folder; in the
toolkit cache (``$LAYERSKIP_CACHE``, never the system's temporary folder), or ``$LEASE_STASH``."""
PROG = "gpu_lease"


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def stage_env() -> dict[str, str]:
    """The environment of a stage's program: the checkout (and installed wheels) on PYTHONPATH, W&B off."""
    paths = [str(lease.REPO)] + ([str(STASH / "site")] if (STASH / "site").is_dir() else [])
    paths += [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), WANDB_MODE="disabled", PYTHONUNBUFFERED="1")


def run_program(argv: list[str], budget: float, env: dict[str, str], notes: list[str]) -> int:
    """Run a stage's program, stopped GRACE_S after its budget (its results are rewritten as it goes)."""
    try:
        return subprocess.run(argv, cwd=lease.REPO, env=env, timeout=Budget(budget).limit(GRACE_S)).returncode
    except subprocess.TimeoutExpired:
        notes.append(f"{Path(argv[1]).name} was stopped {GRACE_S:.0f} s after its {budget:.0f} s budget")
        return -9


def install_wheels(notes: list[str]) -> None:
    """pip-install the carried wheels into STASH/site (no registry, no dependencies); a failure is a note."""
    wheels = sorted((BUNDLE / "meta" / "wheels").glob("*.whl"))
    if not wheels:
        notes.append("no wheels carried (runs/lease/meta/wheels)")
        return
    argv = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
            "--disable-pip-version-check", "--upgrade", "--target", str(STASH / "site"), *map(str, wheels)]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        notes.append(f"installing the carried wheels failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")


def stash(args, notes: list[str]) -> int:
    """Keep the first GGUF half in STASH for the next command (on the same machine, run back to back)."""
    half = sorted((BUNDLE / "a").glob("*.part1"))
    if not half:
        notes.append("runs/lease/a not carried: command 2 will lack the model's first half")
        return 0
    STASH.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(half[0], STASH / half[0].name)
    return 0


def check(args, notes: list[str]) -> int:
    """Device command 1: keep the first GGUF half for command 2, run gpu_check under the budget."""
    stash(args, notes)
    argv = [sys.executable, "-m", "tools.gpu.gpu_check", "--budget-s", str(args.budget_s), "--out", str(args.out)]
    if not cuda():  # a CPU rehearsal: compiled steps with the cheap backend, so the graph count is rehearsed too
        argv += ["--compile-backend", "eager"]
    argv += ["--force"] if args.force else []
    tokenizer = BUNDLE / "meta" / "tokenizer"
    if (tokenizer / "tokenizer.json").is_file():
        argv += ["--tokenizer-dir", str(tokenizer)]
    return run_program(argv, args.budget_s, stage_env(), notes)


def compare(args, notes: list[str]) -> int:
    """Device command 2: wheels, the joined model, gpu_compare under the budget (its run folder in STASH)."""
    install_wheels(notes)
    argv = [sys.executable, "-m", "tools.gpu.gpu_compare", "--form", args.form, "--budget-s", str(args.budget_s),
            "--results", str(args.out), "--out", str(STASH / f"compare-{args.form}"), "--quiet"]
    if os.environ.get("LEASE_MODEL"):
        argv += ["--model", os.environ["LEASE_MODEL"]]
    else:
        argv += ["--bundle", str(BUNDLE / "meta"), "--bundle", str(BUNDLE / "b"), "--bundle", str(STASH)]
    argv += ["--previous", args.previous] if args.previous else []
    env = stage_env() | {"LAYERSKIP_CACHE": os.environ.get("LAYERSKIP_CACHE") or str(STASH / "cache")}
    return run_program(argv, args.budget_s, env, notes)


PAGES = (("GPU.md", "GPU.md", GPU_CHECK), ("TRAINING.md", "TRAINING.md", GPU_TRAINING),
         ("gpu_section.md", "RESULTS.md", GPU_COMPARE))
"""(returned file, page in docs/, its markers): the returned file's marked block replaces the page's."""
COPIES = (("gpu_check.json", "gpu/latest.json"), ("compare.json", "gpu/compare.json"))
"""(returned file, its place under docs/)."""


def returned_section(path: Path, markers) -> str:
    """The marked section of a returned file, refused (nothing changed) unless it holds each marker once, in order."""
    found = markers.section(read_page(path), path)
    if found is None:
        raise UserError(f"{path} must hold {markers.begin} once and then {markers.end} once; nothing was changed")
    return found


def checked_json(path: Path) -> dict:
    """A returned result file, refused when it is not JSON or not a GPU run's (a CPU rehearsal, a dry run)."""

    try:
        value = json.loads(read_page(path))
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); nothing was changed") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} is not a result object; nothing was changed")
    if value.get("dry_run") or value.get("tiny") or value.get("device") == "cpu":
        raise UserError(f"{path} holds a CPU rehearsal or dry run, not GPU results; nothing was changed")
    return value


def publish(folder: Path) -> list[str]:
    """Put a run's returned files (its results folder) into docs/: every file is checked before any is written, so a
    refusal leaves docs/ as it was; returns what was written."""
    docs = lease.REPO / "docs"
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder; give the folder the run's files came back into")
    writes: dict[Path, str] = {}
    for name, target in COPIES:
        if (folder / name).is_file():
            checked_json(folder / name)
            writes[docs / target] = read_page(folder / name)
    for name, page, markers in PAGES:
        if (folder / name).is_file():
            target = writes.get(docs / page) or read_page(docs / page)
            writes[docs / page] = replace_section(target, markers, returned_section(folder / name, markers),
                                                  docs / page, append=False)
    if not writes:
        raise UserError(f"{folder} holds none of gpu_check.json, compare.json, GPU.md, TRAINING.md, gpu_section.md")
    for path, text in writes.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return [str(p) for p in writes]


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m tools.gpu.gpu_lease", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="stage", required=True)
    for stage in ("check", "compare", "stash"):
        one = sub.add_parser(stage)
        one.add_argument("--budget-s", type=finite_float, default=None,
                         help=f"wall budget of the work in seconds (default "
                         f"{BUDGET_S.get(stage, 0):.0f} on a GPU; none on a CPU, whose rehearsal measures nothing)")
        one.add_argument("--out", type=Path, default=None, help="results folder (default $OUT, else runs/gpu/)")
        one.add_argument("--force", action="store_true", help="write over an earlier run's results in --out")
    sub.choices["compare"].add_argument("--form", choices=("first", "full"), default="first")
    sub.choices["compare"].add_argument("--previous", default=None, help="an earlier stage's compare.json")
    sub.add_parser("publish").add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.stage == "publish":
            print("\n".join(f"wrote {w}" for w in publish(args.folder)))
            return 0
        if args.budget_s is None:
            args.budget_s = BUDGET_S.get(args.stage, 0.0) if cuda() else 0.0
        args.out = lease.out_dir(args.out)
        record = args.out / f"lease_{args.stage}.json"
        if record.exists() and not args.force:
            raise UserError(f"{record} exists (an earlier run's results folder); give an empty folder, or pass "
                            "--force to write over it")
        args.out.mkdir(parents=True, exist_ok=True)
        notes: list[str] = []
        t0 = time.perf_counter()
        code = {"check": check, "compare": compare, "stash": stash}[args.stage](args, notes)
        lease.write_json(args.out / f"lease_{args.stage}.json",
                         {"stage": args.stage, "commit": lease.commit(), "returncode": code, "notes": notes,
                          "seconds": round(time.perf_counter() - t0, 1), "budget_s": args.budget_s})
        for note in notes:
            print(f"{PROG}: note: {note}", file=sys.stderr)
        return code
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
