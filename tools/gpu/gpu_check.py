"""One command for a GPU machine with a time limit: the headline numbers first, then the rest in falling order of value.

    python3 -m tools.gpu.gpu_check                                  # a GPU machine: the full run (240 s budget)
    python3 -m tools.gpu.gpu_check --device cpu                     # tiny stand-in shapes, a few tokens (CI)
    python3 -m tools.gpu.gpu_check --device cpu --compile-backend eager   # the same with compiled steps (graph counts)

Runs from a bare checkout (importing ``lease`` puts the checkout on ``sys.path``). Results go to ``--out``, else
``$OUT`` (a results folder that comes back from a batch job or a remote machine), else ``runs/gpu/``:
``gpu_check.json``, rewritten after every piece (a run cut at any point keeps everything finished before it),
``GPU.md`` (the result block) and ``TRAINING.md`` (the training table). ``--budget-s`` is the run's wall budget and
each part has its own (``PART_BUDGETS_S``): a piece that would start past either is cut with a note, so the run
ends with results. A missing optional package (``tools.gpu.run.OPTIONAL``) is a note, not a failure.

Parts, in falling order of value (a part that raises is recorded under ``errors`` and the run goes on; each records
its start offset, seconds, budget and dynamo graph compiles under ``parts``):

a. shapes: random-init SmolLM2-135M, Llama-3.2-1B-like and Llama-2-7B-like models in bf16 (on a CPU, fp32 4-layer
   stand-ins named "stand-in for ..."), each in turn: our plain decoding (compiled and captured on CUDA) tokens/s,
   then ``transformers`` compiled static-cache ``generate`` (``hf_static``) on the same model, then ms per full
   forward, v(T) (verifying T tokens / one token) and c(E) (a draft through layers [0, E) + head / one full
   forward, E = L/4, L/2, 3L/4), then kernels per forward (the profiler over the compiled forward run uncaptured,
   never over a graph replay, beside the eager forward's count; at least one kernel per layer is checked); at the
   first shape every drafter's per-cycle cost (draft and verify ms per cycle, tokens per cycle); on CUDA the bf16
   one-row vs many-row spread. Static forwards built, graphs captured and compiles in the timed runs are counted
   (must be 0).
b. greedy: every drafter's fp32 greedy output vs ``autoregressive`` on the tiny seeded Llama, on the check's
   executor and on eager, each mismatch classified with the drafter's own verification argmax and the fp32
   runner's measured rounding (``infer.measure.exactness``): on CUDA only mismatches beyond a tie flip fail
   (cuBLAS is not batch-invariant, fp32 included), on a CPU every mismatch fails.
c. checks: one seeded sampled generation per drafter (must complete); quantized drafts (``quant_self``: on the
   CPU rehearsal greedy output identical to plain decoding, on CUDA refused in one line); host syncs per draft-verify
   cycle of every drafter (``tools.syncs``) with the targets they are held to (reported, never failing the run).
d. train: ``train_bench.train_check`` (training step speed/memory and an end-to-end train -> save -> decode check).
e. rest: logits of our runner vs ``transformers`` on both tiny models (fp32, bf16), their one-row vs many-row
   spread, greedy identity on the tiny Qwen2, and the uncompiled ``generate`` peers at the shapes (dynamic cache,
   transformers' early-exit assistant).

Decoding runs under ``torch.no_grad()`` throughout (the engine's grad mode), and every runner of one model
geometry and dtype shares its compiled steps (``infer.model.compiled.StepCache``): the whole run compiles each step
kind once per geometry, ``compiles`` in the JSON counts them.

Only torch, transformers, tokenizers, safetensors, numpy, pyyaml and tqdm are needed: no model cache, no network;
accelerate, peft, optuna, datasets, wandb, gguf and deepspeed are optional.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import transformers

from infer.model.compiled import BACKENDS
from layerskip_cli.args import add_run_flags
from layerskip_core.cli import Parser, check_output_dir, finite_float, run_main
from layerskip_core.device import resolve_device
from layerskip_core.errors import UserError
from layerskip_core.settings import RunSettings, resolve_compile
from tools.doc_sections import GPU_CHECK, GPU_TRAINING, write_section
from tools.gpu import lease
from tools.gpu.budget import COMMAND_BUDGET_S
from tools.gpu.check_report import failures, markdown
from tools.gpu.exact import (
    TINY_MODELS,
    greedy_identity,
    identity_totals,
    parity,
    quant_case,
    runner_decode,
    sampled,
    spreads,
    syncs,
)
from tools.gpu.run import Run, Settings, optional_in, part
from tools.gpu.shapes import COMPILE_RESERVE_S, SHAPES, rest_peers, shapes_part
from tools.seeded_models import tiny_model

RESULT_FILE = "gpu_check.json"
"""The result, rewritten after every piece."""


def tiny_adapter(run: Run, kind: str, seed: int, folder: Path) -> Path | None:
    """An exit adapter file for the tiny model (its plain exit at L/2 with seeded noise: a stand-in for a trained
    one), so the adapter's layer is decoded, compiled and captured like the model's; None, with a note, where the
    training code cannot be imported."""
    try:  # local: the training code is optional on a GPU image (a note where it cannot load)
        from train.adapter import AdapterLM  # optional: see the try
        from train.config import AdapterConfig  # optional: see the try
    except ImportError as e:
        run.notes.append(f"exit adapter skipped ({e.name or e} not installed)")
        return None
    model = tiny_model(kind, seed, device=run.device)
    lm = AdapterLM(model, AdapterConfig(enabled=True, exit_layer=model.config.num_hidden_layers // 2))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lm.adapter.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen).to(p.device, p.dtype))
    path = folder / f"adapter-{kind}-{seed}.safetensors"
    lm.save(path, {"source": "gpu_check"})
    return path


def training(run: Run, tokenizer_dir: str | None, out: Path) -> dict:
    try:  # local: the training code is optional on a GPU image (a note, not a failure, where it cannot load)
        from tools.bench.train_bench import train_check, training_table
    except ImportError as e:
        run.notes.append(f"training part skipped: {e}")
        return {}
    result = train_check(str(run.device), tiny=run.settings.tiny, tokenizer_dir=tokenizer_dir, decode=runner_decode)
    missing = optional_in(result.get("train_e2e", {}).get("error", ""))
    if result.get("e2e_ok") is False and missing:  # an image without accelerate: a note, not a failure
        run.notes.append(f"end-to-end training check skipped: {missing} is not installed")
        result["e2e_ok"] = None
    block = GPU_TRAINING.block(training_table(result))
    try:
        write_section(out / "TRAINING.md", GPU_TRAINING, block, append=False, new_page=block + "\n")
    except UserError as e:
        run.notes.append(f"training table not written: {e}")
    return result


def parity_part(run: Run) -> dict:
    par = parity(run.device)
    return {"parity_max_abs": max(v for k, v in par.items() if k.endswith("fp32")), "parity": par,
            "tf32": torch.backends.cuda.matmul.allow_tf32}


def rest_part(run: Run, names: list[str] | None, new_tokens: int) -> dict:
    """Part e: parity and spreads of the tiny models, greedy identity on the second one, the uncompiled peers."""
    exact = run.result.setdefault("exact", {})
    if not run.cut("parity"):
        exact |= parity_part(run)
        run.save()
    if not run.cut("spread"):
        exact["spread"] = spreads(run)
        run.save()
    if not run.cut("greedy identity on the second tiny model"):
        found = greedy_identity(run, new_tokens, TINY_MODELS[1:], (run.executor,))
        exact |= identity_totals(found["greedy_detail"], "greedy_rest")
        run.save()
    rest_peers(run, names)
    return {}


def checks_part(run: Run, new_tokens: int, sync_tokens: int) -> dict:
    """Part c: one sampled generation per drafter, the quantized draft's case (drafts on the CPU, refused on CUDA),
    then the host syncs per cycle."""
    if not run.cut("sampling"):
        run.result.setdefault("exact", {})["sampling"] = sampled(run, new_tokens)
        run.save()
    if not run.cut("quantized drafts"):
        run.result.setdefault("exact", {})["quant_draft"] = quant_case(run, new_tokens)
        run.save()
    return {} if run.cut("syncs") else syncs(run, sync_tokens)


def head(args: argparse.Namespace, run: Run, tiny: bool) -> dict:
    settings = run.settings
    return {"device": torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__, "commit": lease.commit(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python -m tools.gpu.gpu_check " + " ".join(shlex.quote(a) for a in args.argv),
            "tiny": tiny, "executor": run.executor, "threads": torch.get_num_threads(),
            "settings": asdict(settings) | {"verify_sizes": list(settings.verify_sizes),
                                            "spread_sizes": list(settings.spread_sizes),
                                            "spread_prompt_lengths": list(settings.spread_prompt_lengths)},
            "complete": False, "notes": run.notes}


def check(args: argparse.Namespace, save: Callable[[dict], None]) -> dict:
    device = resolve_device(args.device)
    tiny = args.tiny or device.type == "cpu"
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny ops gain nothing from threads, and on a busy machine their spin-waits stall
    backend = args.compile_backend or ("inductor" if resolve_compile(None, device) else None)
    run = Run(device, Settings.for_run(tiny, args.budget_s), backend=backend, saver=save)
    run.result = head(args, run, tiny)
    new_tokens = run.settings.new_tokens * (2 if tiny else 1)
    if importlib.util.find_spec("optuna") is None:
        run.notes.append("optuna not installed: swift's Bayesian step is random search")
    run.save()
    part("shapes", lambda: shapes_part(run, args.shapes), run)
    part("greedy", lambda: greedy_identity(run, new_tokens, adapter_for=tiny_adapter), run, into="exact")
    part("checks", lambda: checks_part(run, new_tokens, 32 if tiny else 64), run)
    if not args.skip_train:
        part("train", lambda: training(run, args.tokenizer_dir, args.out), run, grad=True)
    part("rest", lambda: rest_part(run, args.shapes, new_tokens), run)
    run.result["complete"] = True
    run.result["failures"] = failures(run.result)
    return run.result


def run_check(args: argparse.Namespace) -> int:
    args.out = lease.out_dir(args.out)
    check_output_dir(args.out, "--out", writes=(RESULT_FILE,), force=args.force)  # + GPU.md and TRAINING.md
    args.out.mkdir(parents=True, exist_ok=True)
    latest = args.out / RESULT_FILE

    def save(result: dict) -> None:
        lease.write_json(latest, result)

    result = check(args, save)
    save(result)
    block = markdown(result)
    write_section(args.out / "GPU.md", GPU_CHECK, GPU_CHECK.block(block), new_page="# GPU results\n")
    print(block)
    print(f"wrote {latest} and {args.out / 'GPU.md'} in {result['seconds']:.0f}s", file=sys.stderr)
    for why in result["failures"]:
        print(f"gpu_check: FAILED: {why}", file=sys.stderr)
    return 1 if result["failures"] else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = Parser(description=__doc__.split("\n\n")[0])
    add_run_flags(p, skip=("dtype", "executor", "threads"))  # --device, declared once for every command
    p.set_defaults(device=RunSettings().device)  # its flag's value when not given (the help shows it)
    p.add_argument("--tiny", action="store_true", help="4-layer stand-ins and a few tokens (implied on a CPU)")
    p.add_argument("--out", type=Path, default=None, help=f"folder for {RESULT_FILE}, GPU.md (the result block) and "
                   "TRAINING.md (the training table) (default: $OUT when set, else runs/gpu/)")
    p.add_argument("--force", action="store_true", help=f"write over an earlier run's {RESULT_FILE} in --out")
    p.add_argument("--shapes", type=lambda s: [x.strip() for x in s.split(",") if x.strip()], default=None,
                   help=f"only these shapes (comma-separated): {', '.join(s.name for s in SHAPES)}")
    p.add_argument("--skip-train", action="store_true", help="skip the training part")
    p.add_argument("--tokenizer-dir", default=None, help="training end-to-end check: a model folder whose tokenizer "
                   "to use (default: a byte-level tokenizer built in code, so no model cache is needed)")
    p.add_argument("--budget-s", type=finite_float, default=None, metavar="SECONDS",
                   help="wall budget: no piece starts after it; each part also has its own budget, and an hf_static "
                   f"peer (a torch.compile) needs {COMPILE_RESERVE_S:.0f} s of its part's left (default: "
                   f"{COMMAND_BUDGET_S:.0f} on a GPU, none with tiny shapes; 0 = none)")
    p.add_argument("--compile-backend", choices=BACKENDS, default=None,
                   help="compile our static forwards with this torch.compile backend (default: inductor on CUDA, "
                   "no compiling on a CPU; 'eager' traces and counts graphs in seconds: a rehearsal)")
    args = p.parse_args(argv)
    args.argv = argv
    return run_main("gpu_check", lambda: run_check(args))


if __name__ == "__main__":
    sys.exit(main())
