"""Trained vs training-free self-speculation on one GPU, end to end in one command.

    python -m tools.gpu.gpu_compare                               # on a GPU machine: one run, target <= 8 min (H200)
    python -m tools.gpu.gpu_compare --bundle runs/gpu-bundle      # same, after unpacking gpu_bundle's files
    python -m tools.gpu.gpu_compare --dry-run --out /tmp/gpu-dry  # a quick CPU rehearsal: the first form's steps on
                                                                  # a tiny seeded model, a few tokens (measures nothing)

Run it from the checkout's root (``-m`` puts the root on ``sys.path``, so it runs where the toolkit is not
pip-installed: a GPU image with its own torch; the same holds for gpu_check and gpu_bundle).

Steps (each records its command and wall time; a step whose output exists in --out is reused):
  1. train recipes/gpu-smollm2-code.yaml (the default model on the deduplicated stdlib, packages held out);
  2. before/after quality of base and trained: per-exit loss and agreement with the final layer on the
     held-out packages (scripts/eval_exits.py), loss on HumanEval prompts, greedy GSM8K answer accuracy;
  3. a Self-SD plan searched for each model on this device (skipped, with a note, without optuna);
  4. `layerskip bench` of base and trained in bf16: autoregressive, early_exit at several E/k (and the
     adaptive gate), dynamic_exit, self_sd, swift and the peers hf_generate, hf_static, hf_early_exit, on held-out code
     (prompts cut from the held-out packages), HumanEval and GSM8K, methods interleaved per prompt;
  5. docs/gpu/compare.json and the GPU section of docs/RESULTS.md (with --dry-run: only under --out).

On a GPU machine without registry access that takes 64 MiB per run: `python -m tools.gpu.gpu_bundle` here,
then one run carrying runs/gpu-bundle/part1 and, while the machine is still warm, one carrying
runs/gpu-bundle/part2 that runs `python -m tools.gpu.gpu_compare --bundle runs/gpu-bundle` and copies
docs/gpu/compare.json, docs/RESULTS.md and runs/gpu-compare/gpu_section.md to where results come back.
Time: training is sized for <= 3 min of one H200; the bench (2 models x 3 tasks x 8 prompts x 2 repeats
x 10 methods x 48 tokens) depends on the engine's GPU speed, so every step's wall time is recorded, and a
run stopped midway continues where it stopped when started again with the same --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

from layerskip_core.cli import Parser, finite_float
from layerskip_core.device import resolve_device
from layerskip_core.errors import UserError
from layerskip_core.models import resolve_model
from layerskip_core.packages import cache_root
from tools.doc_sections import GPU_COMPARE, write_section
from tools.gpu import lease
from tools.gpu.budget import Budget
from tools.gpu.bundle import unpack_bundle
from tools.gpu.compare_report import Report, bench_rows, markdown_section, partial_rows
from tools.gpu.compare_settings import CODE_TASK, SEARCHED, CompareSettings, form_settings, searched
from tools.gpu.pipeline import PROG, OutOfBudget, Pipeline, device_flags, layerskip, python
from tools.gpu.task_quality import quality
from train.recipe import load_config

REPO = lease.REPO
RECIPE = "recipes/gpu-smollm2-code.yaml"
"""The training recipe of the comparison (the default model on the deduplicated stdlib, packages held out)."""
STEP_LOG = "steps.log"
"""Every step's log, merged, in the results folder (it comes back with compare.json)."""


def tiny_stand_in(folder: Path) -> Path:
    """A tiny seeded Llama (8 layers) with a byte-level tokenizer, saved once in ``folder``: the model of a CPU
    rehearsal with ``--model default`` (the real default model would take minutes there and measure nothing)."""
    if not (folder / "config.json").is_file():
        from tools.seeded_models import byte_tokenizer, tiny_model  # local: torch, for a CPU rehearsal only

        tiny_model("llama", 0, layers=8, max_position_embeddings=4096).save_pretrained(folder)
        byte_tokenizer().save_pretrained(folder)
    print(f"[{PROG}] CPU rehearsal: a tiny seeded model ({folder}) in place of the default model", file=sys.stderr)
    return folder


def has_optuna() -> bool:
    try:
        import optuna  # noqa: F401  (lazy: optional, only the Self-SD search and SWIFT need it)
    except ImportError:
        return False
    return True


def code_prompts(overrides: list[str], n: int, max_chars: int = 1200) -> list[dict]:
    """``n`` prompts cut from held-out files of the recipe, spread over its held-out packages (round robin)."""
    from train.data import package_of, split_sources  # local: keeps gpu_compare's start-up torch-free

    cfg = load_config(REPO / RECIPE, overrides)
    _, val, _ = split_sources(cfg.data)
    by_pkg: dict[str, list] = {}
    for doc in sorted(val, key=lambda d: d.id):
        if len(doc.text) >= 400:
            by_pkg.setdefault(package_of(doc.id), []).append(doc)
    picked, depth = [], 0
    while len(picked) < n and any(len(docs) > depth for docs in by_pkg.values()):
        picked += [docs[depth] for _, docs in sorted(by_pkg.items()) if len(docs) > depth]
        depth += 1
    if not picked:
        raise UserError("the recipe's held-out packages hold no file of 400+ characters to cut prompts from")
    rows = []
    for doc in picked[:n]:
        head = doc.text[:max_chars]
        cut = head.rfind("\n")
        rows.append({"id": doc.id, "prompt": head[: cut + 1] if cut > 0 else head})
    return rows


def exits_that_fit(p: Pipeline, layers: int, overrides: list[str]) -> list[str]:
    """An ``early_exit.exits`` override keeping the recipe's exits below ``layers`` (a smaller model than the recipe's,
    e.g. the CPU rehearsal's), with a note; none when they all fit or ``overrides`` set the exits."""
    if any(o.startswith("early_exit.exits=") for o in overrides):
        return []
    exits = list(load_config(REPO / RECIPE, []).early_exit.exits)
    kept = [e for e in exits if e < layers] or [max(1, layers // 2)]
    if kept == exits:
        return []
    p.note(f"the model has {layers} layers: early exits {kept} of the recipe's {exits}")
    return [f"early_exit.exits=[{','.join(map(str, kept))}]"]


def train(p: Pipeline, base: str, overrides: list[str]) -> Path:
    run_dir = p.out / "train"
    argv = python("train/layerskip.py", "--config", RECIPE, *overrides, f"model.name_or_path={base}",
                  f"checkpoint.output_dir={run_dir}")
    if run_dir.exists() and not (run_dir / "final" / "config.json").is_file():
        argv.insert(4, "--overwrite")  # an unfinished run of this pipeline in its own folder: start it again
    p.run("train", argv, output=run_dir / "final" / "config.json")
    return run_dir / "final"


def eval_exits(p: Pipeline, name: str, model: Path | str, overrides: list[str], exits: list[int]) -> dict:
    out = p.out / f"exits_{name}.json"
    base = python("scripts/eval_exits.py")
    argv = [*base, "--model", str(model), "--config", RECIPE, "--exits", ",".join(map(str, exits)),
            "--max-examples", str(p.s.eval_examples),
            "--batch-size", str(p.s.eval_batch), "--json", str(out)]
    argv += device_flags(p.s)
    p.run(f"eval_exits_{name}", [*argv, *overrides], output=out)
    return json.loads(out.read_text())


def search_plan(p: Pipeline, name: str, model: Path | str) -> Path:
    out = p.out / "plans" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    base = layerskip("search")
    argv = [*base, "--model", str(model), "--data", "humaneval", "--trials", str(p.s.trials), "--objective", "model",
            "--n", str(p.s.search_prompts), "--max-new-tokens", str(p.s.search_tokens),
            "--timeout", str(p.s.search_timeout), "--quiet", "--out", str(out)]
    argv += device_flags(p.s)
    p.run(f"search_{name}", argv, output=out)
    return out


def bench(p: Pipeline, models: dict[str, str], source: str, task: str, drafters: list[str],
          peers: list[str]) -> dict:
    """One `layerskip bench` per task (its own step: a run stopped midway continues with the next task)."""
    out = p.out / f"bench_{task}"
    base = layerskip("bench")
    argv = [*base, *[x for name, path in models.items() for x in ("--model", f"{name}={path}")],
            "--drafters", ",".join(drafters), "--peers", ",".join(peers) or "none",
            "--data", source, "--n", str(p.s.prompts), "--max-new-tokens", str(p.s.max_new_tokens),
            "--repeats", str(p.s.repeats), "--quiet", "--out", str(out)]
    argv += device_flags(p.s)
    # exit 1 = greedy mismatches that are not tie flips: results are written, the rows say which
    code = p.run(f"bench_{task}", argv, output=out / "results.json", ok_codes=(0, 1))
    if code == 1:
        p.note(f"layerskip bench found greedy mismatches that are not tie flips on {task} (mismatches column)")
    return json.loads((out / "results.json").read_text())


def _device_name(device) -> str:
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def _num_layers(model: Path) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"])


def run_compare(args, s: CompareSettings, device) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the steps' commands find this checkout's packages even where it is not pip-installed (a GPU image)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, WANDB_MODE=os.environ.get("WANDB_MODE", "disabled"), PYTHONPATH=path)
    p = Pipeline(out, s, env, quiet=args.quiet, budget=Budget(args.budget_s), cwd=REPO,
                 merged_log=Path(args.results) / STEP_LOG)
    previous = json.loads(Path(args.previous).read_text()) if args.previous else None
    head = {"device": _device_name(device), "commit": lease.commit(), "form": args.form,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "dry_run": device.type != "cuda",
            "command": shlex.join(["python", "-m", "tools.gpu.gpu_compare", *args.argv]), "recipe": RECIPE,
            "settings": asdict(s)}
    report = Report(Path(args.results), head, previous)
    rows: list[dict] = []
    quality_: dict = {}
    try:
        compare_steps(args, p, rows, quality_, lambda: report.save(p, rows, quality_, p.budget.elapsed()))
        report.data["complete"] = True
    except OutOfBudget as e:
        p.note(str(e))
    except UserError as e:  # a failed step: what was measured before it is kept, and the run exits 2
        report.data["error"] = str(e)
        report.save(p, rows, quality_, p.budget.elapsed())
        raise
    report.save(p, rows, quality_, p.budget.elapsed())
    if not report.data["dry_run"] and args.publish:
        docs = REPO / "docs"
        (docs / "gpu").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(args.results) / "compare.json", docs / "gpu" / "compare.json")
        write_section(docs / "RESULTS.md", GPU_COMPARE, markdown_section(report.data))
    p.log(f"done in {p.budget.elapsed():.0f} s: {Path(args.results) / 'compare.json'}")
    return report.data


def compare_steps(args, p: Pipeline, rows: list[dict], quality_: dict, save) -> None:
    """Train, evaluate the exits (and quality), search plans, bench each task; ``save()`` after every step."""
    s, out = p.s, p.out
    if args.bundle:
        cache = Path(p.env.get("LAYERSKIP_CACHE") or cache_root())
        p.timed("unpack_bundle", unpack_bundle, [Path(b) for b in args.bundle], cache, p)
    base_path = p.timed("resolve_model", resolve_model, args.model)
    layers = _num_layers(base_path)
    recipe_overrides = [*s.data_overrides, *exits_that_fit(p, layers, args.set), *args.set]
    trained_path = train(p, str(base_path), [*s.train_overrides, *recipe_overrides])
    models = {"base": str(base_path), "trained": str(trained_path)}
    save()
    prompts_file = out / "prompts" / f"{CODE_TASK}.jsonl"
    if CODE_TASK in s.tasks and not prompts_file.exists():
        prompts = p.timed("code_prompts", code_prompts, recipe_overrides, s.prompts)
        prompts_file.parent.mkdir(parents=True, exist_ok=True)
        prompts_file.write_text("".join(json.dumps(r) + "\n" for r in prompts))
    exit_list = sorted(set(load_config(REPO / RECIPE, recipe_overrides).early_exit.exits) | {layers})
    for name, path in models.items():
        exits = eval_exits(p, name, path, recipe_overrides, exit_list)
        quality_[name] = {"exits": {"loss": exits["loss"], "agreement": exits["agreement"],
                                    "examples": exits.get("examples")}}
        if s.quality:
            q_file = out / f"quality_{name}.json"
            if not q_file.exists():
                p.check_budget(f"quality_{name}")
                q_file.write_text(json.dumps(p.timed(f"quality_{name}", quality, Path(path), s), indent=1) + "\n")
            quality_[name] |= json.loads(q_file.read_text())
        save()
    fill = {"e1": str(max(1, layers // 4)), "e2": str(max(1, layers // 2))}
    drafters = [d.format(plan="{plan}", **fill) for d in s.drafters]
    peers = [x.format(**fill) for x in s.peers]
    if s.search and has_optuna():
        for name, path in models.items():
            search_plan(p, name, path)
        drafters = [d.replace("{plan}", str(out / "plans" / "{model}.json")) for d in drafters]
    elif any(searched(d) for d in drafters):
        p.note(f"optuna is not installed: {' and '.join(SEARCHED)} are skipped (bring its wheels with "
               "tools/gpu/gpu_bundle.py)")
        drafters = [d for d in drafters if not searched(d)]
    sources = {CODE_TASK: str(prompts_file), "humaneval": "humaneval", "gsm8k": "gsm8k"}
    for task in s.tasks:
        try:
            results = bench(p, models, sources[task], task, drafters, peers)
        except OutOfBudget:  # the bench stopped midway: the rows of its finished records are kept
            rows += partial_rows(p, task)
            save()
            raise
        rows += bench_rows(results)
        save()


def build_parser() -> Parser:
    """The comparison's options (the refusals of bad ones answer before torch loads)."""
    parser = Parser(prog="python -m tools.gpu.gpu_compare", description=__doc__.split("\n\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--form", choices=("first", "full"), default=None,
                        help="first: one short command (short training, held-out code only, no compiled peer, no "
                        "search); full: the whole comparison (default on a GPU; first in a dry run)")
    parser.add_argument("--dry-run", action="store_true",
                        help="a quick rehearsal of the form on the CPU (implied without CUDA): a couple of training "
                        "steps, one prompt, few tokens, fp32, and with --model default a tiny seeded model in its "
                        "place; it checks the wiring and measures nothing")
    parser.add_argument("--out", default=None, help="run folder: checkpoints, logs, step outputs (default "
                        "runs/gpu-compare, or runs/gpu-compare-dry); a run stopped midway resumes from it")
    parser.add_argument("--results", default=None, help="where compare.json and gpu_section.md go, rewritten after "
                        "every step (default: $OUT when set, else the run folder)")
    parser.add_argument("--previous", default=None, metavar="COMPARE_JSON",
                        help="an earlier stage's compare.json (from its $OUT): its rows and quality are carried over, "
                        "and rows this run measures again replace them")
    parser.add_argument("--budget-s", type=finite_float, default=0.0, metavar="SECONDS",
                        help="wall budget: no step starts after it and a running step is stopped at it; the results "
                        "so far are written (0 = none)")
    parser.add_argument("--publish", action="store_true", help="also copy compare.json to docs/gpu/ and the section "
                        "into docs/RESULTS.md (not with the tiny CPU version)")
    parser.add_argument("--model", default="default", help="base model: 'default' (SmolLM2-135M-Instruct) or a folder")
    parser.add_argument("--bundle", action="append", default=[], metavar="FOLDER",
                        help="a folder made by tools/gpu/gpu_bundle.py, or one holding some of its parts (repeatable): "
                        "join the model halves, copy the prompt sets into the cache, install the carried wheels")
    parser.add_argument("--set", action="append", default=[], metavar="key.sub=value",
                        help="override of the recipe for training, held-out prompts and eval (repeatable)")
    parser.add_argument("--prompts", type=int, default=None, help="bench prompts per task")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="bench tokens per generation")
    parser.add_argument("--repeats", type=int, default=None, help="bench repeats")
    parser.add_argument("--trials", type=int, default=None, help="Self-SD search trials per model")
    parser.add_argument("--quiet", action="store_true", help="only errors on stderr")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        import torch  # local: the refusals above answer without it

        device = resolve_device("cpu" if args.dry_run else "auto")
        cuda = device.type == "cuda"
        args.form = args.form or ("full" if cuda else "first")
        if not cuda and not args.dry_run:
            print(f"[{PROG}] no CUDA device: the tiny CPU version of --form {args.form} (checks the wiring, "
                  "measures nothing)", file=sys.stderr)
        args.out = args.out or ("runs/gpu-compare" if cuda else "runs/gpu-compare-dry")
        args.results = str(lease.out_dir(args.results)) if args.results or os.environ.get("OUT") else args.out
        if Path(args.out).exists() and any(Path(args.out).iterdir()) \
                and not any((Path(args.out) / name).exists() for name in ("train", "tiny-model")):
            raise UserError(f"--out {args.out} is not empty and holds no earlier run of this script; "
                            "pick an empty or new folder")
        if args.previous and not Path(args.previous).is_file():
            raise UserError(f"--previous {args.previous}: no such file; give an earlier stage's compare.json")
        settings = form_settings(args.form, cuda)
        if not cuda and args.model == "default" and not args.bundle:
            args.model = str(tiny_stand_in(Path(args.out) / "tiny-model"))
        for name in ("prompts", "max_new_tokens", "repeats", "trials"):
            if getattr(args, name) is not None:
                setattr(settings, name, getattr(args, name))
        torch.set_num_threads(1) if not cuda else None
        run_compare(args, settings, device)
        return 0
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
