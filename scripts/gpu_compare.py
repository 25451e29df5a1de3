"""Trained vs training-free self-speculation on one GPU, end to end in one command.

    python scripts/gpu_compare.py                               # on a GPU machine: one run, target <= 8 min (H200)
    python scripts/gpu_compare.py --bundle runs/gpu-bundle      # same, after unpacking scripts/gpu_bundle.py's files
    python scripts/gpu_compare.py --dry-run --out /tmp/gpu-dry  # a quick CPU rehearsal: the first form's steps on
                                                                # a tiny seeded model, a few tokens (measures nothing)

Where the toolkit is not pip-installed (a GPU image with its own torch), run it from the checkout's
root as ``PYTHONPATH=. python scripts/gpu_compare.py ...`` (the same holds for gpu_check and gpu_bundle).

Steps (each records its command and wall time; a step whose output exists in --out is reused):
  1. train recipes/gpu-smollm2-code.yaml (the default model on the deduplicated stdlib, packages held out);
  2. before/after quality of base and trained: per-exit loss and agreement with the final layer on the
     held-out packages (scripts/eval_exits.py), loss on HumanEval prompts, greedy GSM8K answer accuracy;
  3. a Self-SD plan searched for each model on this device (skipped, with a note, without optuna);
  4. `layerskip bench` of base and trained in bf16: autoregressive, early_exit at several E/k (and the
     adaptive gate), dynamic_exit, self_sd, swift and the peers hf_generate, hf_static, hf_early_exit, on held-out code
     (prompts cut from the held-out packages), HumanEval and GSM8K, methods interleaved per prompt;
  5. docs/gpu/compare.json and the GPU section of docs/RESULTS.md (with --dry-run: only under --out).

On a GPU machine without registry access that takes 64 MiB per run: `python scripts/gpu_bundle.py` here,
then one run carrying runs/gpu-bundle/part1 and, while the machine is still warm, one carrying
runs/gpu-bundle/part2 that runs `python scripts/gpu_compare.py --bundle runs/gpu-bundle` and copies
docs/gpu/compare.json, docs/RESULTS.md and runs/gpu-compare/gpu_section.md to where results come back.
Time: training is sized for <= 3 min of one H200; the bench (2 models x 3 tasks x 8 prompts x 2 repeats
x 10 methods x 48 tokens) depends on the engine's GPU speed, so every step's wall time is recorded, and a
run stopped midway continues where it stopped when started again with the same --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import lease  # first: puts the checkout on sys.path (a bare checkout on a GPU image)

from layerskip_core import jsonfile
from layerskip_core.cli import Parser, finite_float
from layerskip_core.errors import UserError

REPO = Path(__file__).resolve().parent.parent
RECIPE = "recipes/gpu-smollm2-code.yaml"
CODE_TASK = "code_heldout"
TASKS = (CODE_TASK, "humaneval", "gsm8k")
SECTION_BEGIN = "<!-- gpu-compare:begin -->"
SECTION_END = "<!-- gpu-compare:end -->"
PROG = "gpu_compare"
STEP_LOG = "steps.log"
"""Every step's log, merged, in the results folder (it comes back with compare.json)."""


@dataclass
class Settings:
    """How large every step of the comparison is (``gpu_settings`` / ``dry_settings``)."""

    device: str
    """Where everything runs: ``cuda`` (``auto``) or ``cpu`` for the dry run."""
    dtype: str
    """Bench and quality dtype: ``bf16`` on the GPU, ``fp32`` in the dry run."""
    train_overrides: list[str]
    """Recipe overrides for the training run only (the dry run shrinks it to a couple of steps)."""
    data_overrides: list[str]
    """Recipe overrides for training, held-out prompts and evaluation alike (the same held-out split)."""
    eval_examples: int
    """Held-out blocks for the per-exit loss/agreement."""
    eval_batch: int
    """Batch size of the per-exit evaluation."""
    prompts: int
    """Bench prompts per task (held out)."""
    max_new_tokens: int
    """Bench tokens per generation."""
    repeats: int
    """Bench repeats (median tokens/s)."""
    trials: int
    """Self-SD search trials per model."""
    search_timeout: float
    """Stop starting search trials after this many seconds."""
    search_prompts: int
    """Calibration prompts of the search."""
    search_tokens: int
    """Tokens per calibration prompt of the search."""
    humaneval_items: int | None
    """HumanEval problems for the prompt loss (None: all 164)."""
    gsm8k_items: int | None
    """GSM8K sample questions for the answer accuracy (None: all)."""
    gsm8k_tokens: int
    """Greedy tokens per GSM8K answer."""
    gsm8k_batch: int
    """GSM8K questions generated together (left-padded)."""
    drafters: list[str] = field(default_factory=list)
    """Bench drafter specs (``{plan}`` is the per-model Self-SD plan)."""
    peers: list[str] = field(default_factory=list)
    """Bench peer specs."""
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    """Bench tasks, in order."""
    quality: bool = True
    """Measure HumanEval loss and GSM8K accuracy (needs the carried prompt sets)."""
    search: bool = True
    """Search a Self-SD plan per model (needs optuna)."""


EARLY_EXITS = ["early_exit:E=12:k=3", "early_exit:E=16:k=3", "early_exit:E=24:k=2", "early_exit:E=16:k=3:adaptive=true"]
"""The first GPU run's best E/k after training (12/3, 16/3, 24/2), and the adaptive gate at 16/3."""
SEARCHED = ["self_sd:plan={plan}", "swift"]
DYNAMIC = "dynamic_exit:verify_slope=0.02"
"""The exit chosen per context; verifying extra rows is nearly free on an H200 in bf16 (2-32 rows cost 1.16-1.26
plain steps: docs/RESULTS.md), unlike the CPU default slope of 0.13."""


def gpu_settings() -> Settings:
    """The real run: sized for about 8 minutes of one H200 (train ~2-3 min, the rest evaluation and bench)."""
    return Settings(device="auto", dtype="bf16", train_overrides=[], data_overrides=[], eval_examples=64,
                    eval_batch=16, prompts=8, max_new_tokens=48, repeats=2, trials=40, search_timeout=40.0,
                    search_prompts=4, search_tokens=32, humaneval_items=None, gsm8k_items=None, gsm8k_tokens=256,
                    gsm8k_batch=50,
                    drafters=["autoregressive", *EARLY_EXITS, DYNAMIC, *SEARCHED],
                    peers=["hf_generate", "hf_early_exit:E=12:k=3", "hf_static"])  # the compiled peer last


def first_settings() -> Settings:
    """The first lease's form, one device command of <= 5 minutes: a short training, the per-exit evaluation, one task
    (held-out code), four prompts, the early exits against autoregressive and uncompiled ``generate`` (no compiled
    peer, no search, no HumanEval/GSM8K quality)."""
    return Settings(device="auto", dtype="bf16", train_overrides=["optim.max_steps=60"], data_overrides=[],
                    eval_examples=16, eval_batch=16, prompts=4, max_new_tokens=48, repeats=1, trials=0,
                    search_timeout=0.0, search_prompts=0, search_tokens=0, humaneval_items=None, gsm8k_items=None,
                    gsm8k_tokens=0, gsm8k_batch=1, drafters=["autoregressive", *EARLY_EXITS[:3]],
                    peers=["hf_generate"], tasks=[CODE_TASK], quality=False, search=False)


def tiny_settings(form: Settings) -> Settings:
    """``form`` shrunk to a CPU check of the wiring: ``dry_settings`` with the form's tasks, steps and kinds of peer."""
    dry = dry_settings()
    kinds = {x.split(":")[0] for x in form.peers}
    return replace(dry, tasks=form.tasks, quality=form.quality, search=form.search,
                   drafters=dry.drafters if form.search else [d for d in dry.drafters if d not in SEARCHED],
                   peers=[x for x in dry.peers if x.split(":")[0] in kinds])


def tiny_stand_in(folder: Path) -> Path:
    """A tiny seeded Llama (8 layers) with a byte-level tokenizer, saved once in ``folder``: the model of a CPU
    rehearsal with ``--model default`` (the real default model would take minutes there and measure nothing)."""
    if not (folder / "config.json").is_file():
        from infer.measure.seeded_models import byte_tokenizer, tiny_model

        tiny_model("llama", 0, layers=8, max_position_embeddings=4096).save_pretrained(folder)
        byte_tokenizer().save_pretrained(folder)
    print(f"[{PROG}] CPU rehearsal: a tiny seeded model ({folder}) in place of the default model", file=sys.stderr)
    return folder


def form_settings(form: str, cuda: bool) -> Settings:
    """The settings of ``--form`` (first | full) on a GPU, or their tiny CPU version."""
    settings = first_settings() if form == "first" else gpu_settings()
    return settings if cuda else tiny_settings(settings)


def dry_settings() -> Settings:
    """The same pipeline on CPU in fp32, as small as it goes: checks wiring, measures nothing."""
    return Settings(device="cpu", dtype="fp32",
                    train_overrides=["optim.max_steps=2", "optim.micro_batch_size=1", "optim.warmup_steps=0",
                                     "optim.mixed_precision='no'", "logging.log_every=1", "threads=1"],
                    data_overrides=["data.block_size=64", "data.max_val_examples=2",
                                    "data.sources.0.max_documents=150"],
                    eval_examples=2, eval_batch=2, prompts=1, max_new_tokens=6, repeats=1, trials=2,
                    search_timeout=20.0, search_prompts=1, search_tokens=4, humaneval_items=2, gsm8k_items=2,
                    gsm8k_tokens=8, gsm8k_batch=2,
                    drafters=["autoregressive", "early_exit:E={e1}:k=2", "early_exit:E={e2}:k=2:adaptive=true",
                              DYNAMIC, *SEARCHED],
                    peers=["hf_generate", "hf_early_exit:E={e1}:k=2", "hf_static"])


# --------------------------------------------------------------------------------------------
# Running steps
# --------------------------------------------------------------------------------------------


@dataclass
class Step:
    """One step of the run: what ran, how long it took, and whether its output was reused."""

    name: str
    command: str
    seconds: float
    reused: bool = False
    returncode: int = 0


class OutOfBudget(Exception):
    """The run's wall budget is spent: no further step starts (the message says which did not)."""


class Pipeline:
    """The run's state: output folder, settings, wall budget, the steps done so far and notes for the reader."""

    def __init__(self, out: Path, settings: Settings, env: dict[str, str], quiet: bool = False,
                 budget: lease.Budget | None = None, merged_log: Path | None = None):
        self.out, self.s, self.env, self.quiet = out, settings, env, quiet
        self.merged_log = merged_log
        """One file (in the results folder) every step's log is appended to as the step ends."""
        self.budget = budget or lease.Budget(0.0)
        self.steps: list[Step] = []
        self.notes: list[str] = []
        self._help: dict[str, str] = {}

    def check_budget(self, name: str) -> None:
        """Raise OutOfBudget when the budget is spent before step ``name`` starts."""
        if self.budget.over():
            raise OutOfBudget(f"the {self.budget.seconds:.0f} s budget was spent before step {name} "
                              f"({self.budget.elapsed():.0f} s); it and the steps after it did not run")

    def left(self) -> float | None:
        """Seconds of budget left (None: no budget)."""
        return None if self.budget.seconds <= 0 else max(1.0, self.budget.seconds - self.budget.elapsed())

    def log(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{PROG}] {msg}", file=sys.stderr, flush=True)

    def note(self, msg: str) -> None:
        if msg not in self.notes:
            self.notes.append(msg)
            self.log(f"note: {msg}")

    def run(self, name: str, argv: list[str], output: Path | None = None, ok_codes: tuple[int, ...] = (0,)) -> int:
        """Run ``argv`` in the repository (skipped when ``output`` exists); a failing step is a UserError."""
        command = shlex.join(argv)
        if output is not None and output.exists():
            self.steps.append(Step(name, command, 0.0, reused=True))
            self.log(f"{name}: reusing {output}")
            return 0
        self.check_budget(name)
        log_file = self.out / "logs" / f"{name}.log"
        log_file.parent.mkdir(parents=True, exist_ok=True)
        self.log(f"{name}: {command}  (output: {log_file})")
        t0 = time.perf_counter()
        with open(log_file, "w") as f:
            try:
                proc = subprocess.run(argv, cwd=REPO, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                      timeout=self.left())
            except subprocess.TimeoutExpired:
                self.steps.append(Step(name, command, round(time.perf_counter() - t0, 2), returncode=-9))
                self.merge_log(log_file, self.steps[-1])
                raise OutOfBudget(f"step {name} was stopped at the {self.budget.seconds:.0f} s budget") from None
        seconds = time.perf_counter() - t0
        self.steps.append(Step(name, command, round(seconds, 2), returncode=proc.returncode))
        self.merge_log(log_file, self.steps[-1])
        if proc.returncode not in ok_codes:
            tail = [ln for ln in log_file.read_text(errors="replace").splitlines() if ln.strip()][-3:]
            raise UserError(f"step {name!r} failed (exit {proc.returncode}; {log_file}): "
                            f"{' | '.join(tail) or 'no output'}")
        return proc.returncode

    def merge_log(self, log_file: Path, step: Step, limit: int = 256 * 1024) -> None:
        """Append a finished (or stopped) step's log to ``merged_log`` under a header (its last ``limit`` bytes)."""
        if self.merged_log is None:
            return
        data = log_file.read_bytes()[-limit:].decode("utf-8", errors="replace") if log_file.is_file() else ""
        self.merged_log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.merged_log, "a", encoding="utf-8") as f:
            f.write(f"===== step {step.name}: exit {step.returncode}, {step.seconds:.1f} s\n$ {step.command}\n{data}"
                    + ("" if data.endswith("\n") or not data else "\n"))

    def supports(self, argv: list[str], flag: str) -> bool:
        """Whether a command's --help lists ``flag`` (options other helpers add are used once they exist)."""
        key = shlex.join(argv)
        if key not in self._help:
            proc = subprocess.run([*argv, "--help"], cwd=REPO, env=self.env, capture_output=True, text=True)
            self._help[key] = proc.stdout
        return flag in self._help[key]

    def timed(self, name: str, fn, *args):
        """Run an in-process step and record its wall time."""
        self.check_budget(name)
        t0 = time.perf_counter()
        value = fn(*args)
        self.steps.append(Step(name, f"(in process) {fn.__name__}", round(time.perf_counter() - t0, 2)))
        return value


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def layerskip(*args: str) -> list[str]:
    return [sys.executable, "-m", "layerskip_cli", *args]


def device_flags(p: Pipeline, argv: list[str], what: str) -> list[str]:
    """``--device``/``--dtype`` for a command that has them; a note where it does not (it then runs its default)."""
    flags = []
    for flag, value in (("--device", p.s.device), ("--dtype", p.s.dtype)):
        if p.supports(argv, flag):
            flags += [flag, value]
        else:
            p.note(f"{what} has no {flag} option yet: it ran with its own default")
    return flags


# --------------------------------------------------------------------------------------------
# The bundle brought to a GPU machine without registry access (scripts/gpu_bundle.py)
# --------------------------------------------------------------------------------------------


def _find(bundle: list[Path], name: str) -> Path | None:
    hits = sorted(hit for folder in bundle if folder.is_dir() for hit in folder.rglob(name))
    return hits[0] if hits else None


def unpack_bundle(bundle: list[Path], cache: Path, p: Pipeline) -> None:
    """Model halves (found in any of the ``bundle`` folders) -> one verified GGUF in the cache, prompt sets into the
    cache, wheels installed."""
    from layerskip_core.packages import sha256_of

    where = ", ".join(map(str, bundle))
    manifest_path = _find(bundle, "manifest.json")
    if manifest_path is None:
        raise UserError(f"--bundle {where}: no manifest.json inside; make the bundle with scripts/gpu_bundle.py")
    manifest = json.loads(manifest_path.read_text())
    model = manifest["model"]
    target = cache / "packages" / model["filename"]
    if not (target.is_file() and sha256_of(target) == model["sha256"]):
        parts = [_find(bundle, part["name"]) for part in model["parts"]]
        missing = [part["name"] for part, path in zip(model["parts"], parts, strict=True) if path is None]
        if missing:
            raise UserError(f"--bundle {where}: missing model part(s) {', '.join(missing)}; carry every "
                            "part of the bundle to this machine (the halves may travel in separate runs)")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".partial")
        with open(tmp, "wb") as f:
            for path in parts:
                f.write(path.read_bytes())
        if sha256_of(tmp) != model["sha256"]:
            tmp.unlink()
            raise UserError(f"--bundle {where}: the joined model has the wrong sha256; rebuild the bundle")
        os.replace(tmp, target)
    for item in manifest["data"]:
        src = _find(bundle, item["filename"])
        if src is None or sha256_of(src) != item["sha256"]:
            raise UserError(f"--bundle {where}: data file {item['filename']} missing or corrupt")
        (cache / "data").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, cache / "data" / item["filename"])
    wheels = manifest.get("wheels", {})
    wheels["install"] = [name for name in wheels.get("install", []) if importlib.util.find_spec(name) is None]
    if wheels["install"]:  # what is importable already (gpu_lease.py installs the wheels first) is left alone
        wheel_dir = _find(bundle, wheels["files"][0]).parent if wheels.get("files") else bundle[0]
        # --no-deps: the compiled dependencies (markupsafe for mako) cannot travel as pure wheels, and optuna
        # with its in-memory / journal storage imports neither alembic nor mako
        argv = python("-m", "pip", "install", "--no-index", "--no-deps", "--disable-pip-version-check", "-q",
                      "--find-links", str(wheel_dir), *wheels["install"])
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["?"])[-1]
            p.note(f"installing {', '.join(wheels['install'])} from the bundle failed ({last})")


def has_optuna() -> bool:
    try:
        import optuna  # noqa: F401  (lazy: optional, only the Self-SD search and SWIFT need it)
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------------------------
# Held-out prompts and quality
# --------------------------------------------------------------------------------------------


def code_prompts(overrides: list[str], n: int, max_chars: int = 1200) -> list[dict]:
    """``n`` prompts cut from held-out files of the recipe, spread over its held-out packages (round robin)."""
    from train.data import package_of, split_sources
    from train.recipe import load_config

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


def answer_number(text: str) -> str | None:
    """The last number in a text (commas and a trailing dot dropped), as GSM8K answers are scored."""
    found = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    if not found:
        return None
    value = found[-1].replace(",", "")
    return value[:-2] if value.endswith(".0") else value


def quality(model_path: Path, s: Settings) -> dict:
    """Loss on HumanEval prompts (and on the canonical solutions given the prompt) and GSM8K accuracy."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from layerskip_core.device import parse_dtype, resolve_device
    from layerskip_core.heldout import loss_sums, next_token_targets
    from layerskip_core.prompts import load_prompts

    device = resolve_device(s.device)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=parse_dtype(s.dtype, device)).to(device).eval()
    tok = AutoTokenizer.from_pretrained(model_path)
    sums = {"prompt": [0.0, 0], "solution": [0.0, 0]}
    with torch.no_grad():
        for item in load_prompts("humaneval", s.humaneval_items):
            p_ids = tok(item.prompt)["input_ids"]
            s_ids = tok(item.reference, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([p_ids + s_ids], device=device)  # (1, T)
            logits = model(ids).logits[0]  # (T, V): position t predicts token t+1
            targets = next_token_targets(ids)[0]  # (T,)
            for part, span in (("prompt", slice(0, len(p_ids) - 1)), ("solution", slice(len(p_ids) - 1, None))):
                nats, count = loss_sums(logits[span], targets[span])  # the one held-out loss
                sums[part][0] += float(nats)
                sums[part][1] += int(count)
        items = load_prompts("gsm8k", s.gsm8k_items)
        tok.padding_side = "left"
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        correct = 0
        for i in range(0, len(items), s.gsm8k_batch):
            chunk = items[i:i + s.gsm8k_batch]
            texts = [tok.apply_chat_template([{"role": "user", "content": it.prompt}], add_generation_prompt=True,
                                             tokenize=False) for it in chunk]
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)  # (B, T)
            out = model.generate(**enc, max_new_tokens=s.gsm8k_tokens, do_sample=False, pad_token_id=pad)
            answers = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            for it, answer in zip(chunk, answers, strict=True):
                expected = answer_number(it.reference.rpartition("####")[2])
                correct += int(expected is not None and answer_number(answer) == expected)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"humaneval_prompt_loss": sums["prompt"][0] / max(1, sums["prompt"][1]),
            "humaneval_solution_loss": sums["solution"][0] / max(1, sums["solution"][1]),
            "humaneval_items": s.humaneval_items or 164, "gsm8k_accuracy": correct / len(items),
            "gsm8k_items": len(items), "gsm8k_max_new_tokens": s.gsm8k_tokens}


# --------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------


def exits_that_fit(p: Pipeline, layers: int, overrides: list[str]) -> list[str]:
    """An ``early_exit.exits`` override keeping the recipe's exits below ``layers`` (a smaller model than the recipe's,
    e.g. the CPU rehearsal's), with a note; none when they all fit or ``overrides`` set the exits."""
    from train.recipe import load_config

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
        if not p.supports(python("train/layerskip.py"), "--overwrite"):
            raise UserError(f"{run_dir} holds an unfinished run; remove it or pick another --out")
        argv.insert(4, "--overwrite")
    p.run("train", argv, output=run_dir / "final" / "config.json")
    return run_dir / "final"


def eval_exits(p: Pipeline, name: str, model: Path | str, overrides: list[str], exits: list[int]) -> dict:
    out = p.out / f"exits_{name}.json"
    base = python("scripts/eval_exits.py")
    argv = [*base, "--model", str(model), "--config", RECIPE, "--exits", ",".join(map(str, exits)),
            "--max-examples", str(p.s.eval_examples),
            "--batch-size", str(p.s.eval_batch), "--json", str(out)]
    argv += device_flags(p, base, "scripts/eval_exits.py")
    p.run(f"eval_exits_{name}", [*argv, *overrides], output=out)
    return json.loads(out.read_text())


def search_plan(p: Pipeline, name: str, model: Path | str) -> Path:
    out = p.out / "plans" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    base = layerskip("search")
    argv = [*base, "--model", str(model), "--data", "humaneval", "--trials", str(p.s.trials), "--objective", "model",
            "--n", str(p.s.search_prompts), "--max-new-tokens", str(p.s.search_tokens),
            "--timeout", str(p.s.search_timeout), "--quiet", "--out", str(out)]
    argv += device_flags(p, base, "layerskip search")
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
    argv += device_flags(p, base, "layerskip bench")
    # exit 1 = greedy mismatches that are not tie flips: results are written, the rows say which
    code = p.run(f"bench_{task}", argv, output=out / "results.json", ok_codes=(0, 1))
    if code == 1:
        p.note(f"layerskip bench found greedy mismatches that are not tie flips on {task} (mismatches column)")
    return json.loads((out / "results.json").read_text())


def bench_rows(results: dict) -> list[dict]:
    """compare.json rows from the bench summary (the bench's task for the held-out code file is its stem)."""
    rows = []
    for r in results["summary"]:
        mismatches = r.get("mismatches", r.get("exact_mismatches"))
        rows.append({"model": r["model"], "method": r["method"], "task": r["task"],
                     "tok_s": r["tokens_per_second"], "vs_ar": r["speedup_vs_autoregressive"],
                     "alpha": r["acceptance_rate"], "mismatches": mismatches, "tie_flips": r.get("tie_flips"),
                     "tokens_per_verify": r.get("tokens_per_verify"), "draft_cost": r.get("draft_cost_ratio"),
                     "verify_cost": r.get("verify_cost_ratio"), "prompts": r.get("prompts"),
                     "verifier_loss": r.get("verifier_loss"), "verifier_delta_nats": r.get("verifier_delta_nats"),
                     "verifier_flag": r.get("verifier_flag")})
    return rows


def targets(rows: list[dict], quality_: dict, total_s: float) -> dict:
    """The issue's targets, each with the measured value and whether it is met (None: not measured)."""

    def best(model: str, task: str, prefix: str) -> float | None:
        vals = [r["vs_ar"] for r in rows if r["model"] == model and r["task"] == task
                and r["method"].startswith(prefix) and r["vs_ar"] is not None]
        return max(vals) if vals else None

    def worst_over_tasks(model: str, prefix: str) -> float | None:
        vals = [best(model, t, prefix) for t in TASKS]
        return min(v for v in vals if v is not None) if any(v is not None for v in vals) else None

    def check(value, ok) -> dict:
        return {"value": value, "met": None if value is None else bool(ok(value))}

    base_q, trained_q = quality_.get("base", {}), quality_.get("trained", {})
    both = [q for q in (base_q, trained_q) if "gsm8k_accuracy" in q and "humaneval_prompt_loss" in q]
    acc_drop = (base_q["gsm8k_accuracy"] - trained_q["gsm8k_accuracy"]) if len(both) == 2 else None
    loss_ratio = (trained_q["humaneval_prompt_loss"] / base_q["humaneval_prompt_loss"]) if len(both) == 2 else None
    return {
        "trained early_exit vs AR, held-out code (>= 1.5)": check(best("trained", CODE_TASK, "early_exit"),
                                                                  lambda v: v >= 1.5),
        "trained early_exit vs AR, HumanEval (>= 1.0)": check(best("trained", "humaneval", "early_exit"),
                                                              lambda v: v >= 1.0),
        "GSM8K accuracy drop base -> trained (<= 0.02)": check(acc_drop, lambda v: v <= 0.02),
        "HumanEval prompt loss trained / base (<= 1.05)": check(loss_ratio, lambda v: v <= 1.05),
        "trained self_sd vs AR, worst task (>= 1.0)": check(worst_over_tasks("trained", "self_sd"),
                                                           lambda v: v >= 1.0),
        "trained swift vs AR, worst task (>= 1.0)": check(worst_over_tasks("trained", "swift"), lambda v: v >= 1.0),
        "whole run in seconds (<= 480)": check(round(total_s, 1), lambda v: v <= 480),
    }


def _device_name(device) -> str:
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def _num_layers(model: Path) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"])


class Report:
    """compare.json, rewritten into ``results`` after every step (a command killed midway keeps what it measured),
    with ``gpu_section.md`` beside it; rows and quality of a ``previous`` stage's compare.json are carried over."""

    def __init__(self, results: Path, head: dict, previous: dict | None):
        self.results, self.previous = results, previous or {}
        self.data = {**head, "rows": [], "quality": {}, "targets": {}, "steps": [], "notes": [], "complete": False,
                     "stage_of": self.previous.get("command")}

    def save(self, p: Pipeline, rows: list[dict], quality_: dict, total: float) -> None:
        fresh = {(r["model"], r["task"], r["method"]) for r in rows}
        carried = [r for r in self.previous.get("rows", []) if (r["model"], r["task"], r["method"]) not in fresh]
        quality_ = {**self.previous.get("quality", {}), **quality_}
        self.data |= {"rows": carried + rows, "quality": quality_, "steps": [asdict(st) for st in p.steps],
                      "notes": p.notes, "total_seconds": round(total, 1)}
        self.data["targets"] = targets(self.data["rows"], quality_, total)
        self.results.mkdir(parents=True, exist_ok=True)
        lease.write_json(self.results / "compare.json", self.data)
        jsonfile.write((self.results / "gpu_section.md"), markdown_section(self.data))


def run_compare(args, s: Settings, device) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the steps' commands find this checkout's packages even where it is not pip-installed (a GPU image)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, WANDB_MODE=os.environ.get("WANDB_MODE", "disabled"), PYTHONPATH=path)
    p = Pipeline(out, s, env, quiet=args.quiet, budget=lease.Budget(args.budget_s),
                 merged_log=Path(args.results) / STEP_LOG)
    previous = json.loads(Path(args.previous).read_text()) if args.previous else None
    head = {"device": _device_name(device), "commit": lease.commit(), "form": args.form,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "dry_run": device.type != "cuda",
            "command": shlex.join(["scripts/gpu_compare.py", *args.argv]), "recipe": RECIPE, "settings": asdict(s)}
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
        write_section(docs / "RESULTS.md", markdown_section(report.data))
    p.log(f"done in {p.budget.elapsed():.0f} s: {Path(args.results) / 'compare.json'}")
    return report.data


def compare_steps(args, p: Pipeline, rows: list[dict], quality_: dict, save) -> None:
    """Train, evaluate the exits (and quality), search plans, bench each task; ``save()`` after every step."""
    s, out = p.s, p.out
    if args.bundle:
        from layerskip_core.packages import cache_root

        cache = Path(p.env.get("LAYERSKIP_CACHE") or cache_root())
        p.timed("unpack_bundle", unpack_bundle, [Path(b) for b in args.bundle], cache, p)
    from layerskip_core.models import resolve_model

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
    from train.recipe import load_config

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
    elif any(d.startswith(("self_sd", "swift")) for d in drafters):
        p.note("optuna is not installed: self_sd and swift are skipped (bring its wheels with scripts/gpu_bundle.py)")
        drafters = [d for d in drafters if not d.startswith(("self_sd", "swift"))]
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


def partial_rows(p: Pipeline, task: str) -> list[dict]:
    """Rows of a bench stopped midway, from the records it wrote as it went (``records.jsonl``)."""
    from infer.measure.report import RECORDS_FILE, rebuild

    out = p.out / f"bench_{task}"
    if not (out / RECORDS_FILE).is_file():
        return []
    summary = [asdict(r) for r in rebuild(out)]
    p.note(f"bench_{task} was stopped before its end: {len(summary)} row(s) from its finished records")
    return bench_rows({"summary": summary})


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------


def _f(x, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def method_key(label: str) -> str:
    """A method label without its per-model plan path (``self_sd:plan=runs/x/plans/base.json`` -> ``self_sd``)."""
    return re.sub(r":plan=[^:]*", "", label)


def _exact(row: dict) -> str:
    if row["mismatches"] is None and row["tie_flips"] is None:
        return "–"
    cells = [f"{row['tie_flips']} tie flip(s)"] if row.get("tie_flips") else []
    cells += [f"**{row['mismatches']} mismatched**"] if row.get("mismatches") else []
    return ", ".join(cells) or "identical"


def _verifier(row: dict | None) -> str:
    """The trained row's verifier change against the base model: its flag, its delta, or 'not measured'."""
    if row is None or row.get("verifier_loss") is None:
        return "not measured"
    if row.get("verifier_flag"):
        return f"**{row['verifier_flag']}**"
    return _f(row.get("verifier_delta_nats"), "+.3f")


def markdown_section(c: dict) -> str:
    s = c["settings"]
    lines = [SECTION_BEGIN, "## GPU: trained vs training-free, one run", "",
             f"`{c['command']}` on {c['device']}, commit {c['commit']}, {c['date']}, {c['total_seconds']:.0f} s in all"
             + (" (**dry run**: CPU, tiny settings; it checks the wiring and measures nothing)" if c["dry_run"] else "")
             + ".", "",
             f"Recipe `{c['recipe']}`; bench in {s['dtype']}: {s['prompts']} held-out prompts per task, "
             f"{s['max_new_tokens']} new tokens, median of {s['repeats']} repeats, methods interleaved per prompt.",
             "", "### Quality, base -> trained", "",
             "| | base | trained |", "|---|---:|---:|"]
    qb, qt = c["quality"].get("base", {}), c["quality"].get("trained", {})
    for key, label in (("humaneval_prompt_loss", "HumanEval prompt loss"),
                       ("humaneval_solution_loss", "HumanEval solution loss (given the prompt)"),
                       ("gsm8k_accuracy", "GSM8K sample greedy accuracy")):
        lines.append(f"| {label} | {_f(qb.get(key), '.3f')} | {_f(qt.get(key), '.3f')} |")
    eb, et = qb.get("exits", {}), qt.get("exits", {})
    for e in eb.get("agreement", {}):
        lines.append(f"| held-out code, exit {e}: agreement / loss | {_f(eb['agreement'][e])} / "
                     f"{_f(eb['loss'][e])} | {_f(et.get('agreement', {}).get(e))} / "
                     f"{_f(et.get('loss', {}).get(e))} |")
    lines += ["", "### Decoding speed", "",
              "trained verifier: the trained model's held-out loss minus the base model's, in nats per token, on the "
              "bench's split (the front of HumanEval, none of it timed; `infer/measure/quality.py`): every lossless "
              "method's output is its verifier's, so a speed-up of a worse verifier is flagged.", "",
              "| task | method | base tok/s | base vs AR | base α | trained tok/s | trained vs AR | trained α "
              "| trained verifier | exact |",
              "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    by_key = {(r["model"], r["task"], method_key(r["method"])): r for r in c["rows"]}
    methods = list(dict.fromkeys(method_key(r["method"]) for r in c["rows"]))
    for task in TASKS:
        for m in methods:
            b, t = by_key.get(("base", task, m)), by_key.get(("trained", task, m))
            if b is None and t is None:
                continue
            exact = "; ".join(x for x in (_exact(b) if b else "", _exact(t) if t else "") if x)
            lines.append(f"| {task} | `{m}` | {_f(b and b['tok_s'], '.1f')} | {_f(b and b['vs_ar'], '.2f', 'x')} | "
                         f"{_f(b and b['alpha'])} | {_f(t and t['tok_s'], '.1f')} | "
                         f"{_f(t and t['vs_ar'], '.2f', 'x')} | {_f(t and t['alpha'])} | {_verifier(t)} | {exact} |")
    lines += ["", "### Targets", "", "| target | measured | met |", "|---|---:|---|"]
    for name, t in c["targets"].items():
        met = "–" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {name} | {_f(t['value'], '.3g')} | {met} |")
    lines += ["", "### Steps", "", "| step | seconds | |", "|---|---:|---|"]
    for st in c["steps"]:
        lines.append(f"| {st['name']} | {st['seconds']:.1f} | {'reused' if st['reused'] else ''} |")
    if c["notes"]:
        lines += ["", "Notes: " + " ".join(f"{n}." if not n.endswith(".") else n for n in c["notes"])]
    lines += ["", SECTION_END, ""]
    return "\n".join(lines)


def write_section(path: Path, section: str) -> None:
    """Replace the marked GPU section of ``path`` (append it when the markers are missing)."""
    text = path.read_text() if path.exists() else ""
    if SECTION_BEGIN in text and SECTION_END in text:
        head, _, rest = text.partition(SECTION_BEGIN)
        _, _, tail = rest.partition(SECTION_END)
        text = head + section.rstrip("\n") + tail
    else:
        text = text.rstrip("\n") + "\n\n" + section
    jsonfile.write(path, text)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="scripts/gpu_compare.py", description=__doc__.split("\n\n")[0],
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
                        help="a folder made by scripts/gpu_bundle.py, or one holding some of its parts (repeatable): "
                        "join the model halves, copy the prompt sets into the cache, install the carried wheels")
    parser.add_argument("--set", action="append", default=[], metavar="key.sub=value",
                        help="override of the recipe for training, held-out prompts and eval (repeatable)")
    parser.add_argument("--prompts", type=int, default=None, help="bench prompts per task")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="bench tokens per generation")
    parser.add_argument("--repeats", type=int, default=None, help="bench repeats")
    parser.add_argument("--trials", type=int, default=None, help="Self-SD search trials per model")
    parser.add_argument("--quiet", action="store_true", help="only errors on stderr")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        import torch

        from layerskip_core.device import resolve_device

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
