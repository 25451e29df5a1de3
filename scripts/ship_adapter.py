"""Ship a trained exit adapter as a model's default: the file (optionally in bf16) and its provenance beside it.

    python scripts/ship_adapter.py --run runs/cpu-adapter-sd --dtype bf16 --out infer/data/adapters --force

reads the run folder a recipe with an ``adapter:`` section wrote (``adapter.safetensors``, ``config.yaml``,
``metrics.jsonl``) and writes ``<out>/<model>-e<E>.safetensors`` (the same header; the tensors cast to ``--dtype``:
bf16 halves the file, and a runner casts the weights to its own dtype when it loads them) and
``<out>/<model>-e<E>.provenance.json``: the recipe and the commands that made the data and the adapter, the
self-distilled kinds with their prompts and tokens, the kinds held out, steps and loss tokens, the validation
agreement of every evaluation, the training time and the commits. Everything is read from the run, nothing typed.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from layerskip_core.cli import Parser, check_output_file, parse_and_run, write_result
from layerskip_core.errors import UserError

DTYPES = ("fp32", "bf16")
_FIRST = "chat,code_python,code_other,prose,math,code_continue"
_PASSES = [("runs/self-distill", _FIRST, ""), ("runs/self-distill-s1", _FIRST, " --decoding sampled --seed 1"),
           ("runs/self-distill-w", "questions,writing", ""), ("runs/self-distill-wc", "code_more", ""),
           ("runs/self-distill-w1", "questions,writing", " --decoding sampled --seed 1"),
           ("runs/self-distill-wc1", "code_more", " --decoding sampled --seed 1")]
DATA_COMMAND = " && ".join(f"python -m train.self_distill --out {out} --kinds {kinds} --batch-size 32 --threads 1{more}"
                           for out, kinds, more in _PASSES)
"""The commands that made the shipped adapter's data (recipes/cpu-adapter-selfdistill.yaml's header)."""
VOCAB_COMMAND = ('layerskip draft-vocab --model default --data "$(ls runs/self-distill*/*.jsonl | paste -sd, -)" '
                 "--mode text --size 8192 --out runs/vocab-sd/vocab.json --counts-out "
                 "layerskip_core/data/draft_vocab/smollm2-135m-instruct.json --force")
"""The command that counted the shipped counts ``draft_vocab: auto`` reads, on the same data (the recipe's header)."""


def counts_record(draft_vocab: dict | None, name: str) -> dict | None:
    """Which token counts an adapter trained with ``draft_vocab: auto`` or a size N (the top N of them) drafts from:
    the file shipped for the model ``name`` (its SHA-256, so a later recount shows) and the command that made it;
    None for any other vocabulary."""
    import hashlib

    from layerskip_core.draft_vocab import BUNDLED_DIR, names_shipped_top

    path = BUNDLED_DIR / f"{name}.json"
    if not names_shipped_top((draft_vocab or {}).get("option")) or not path.is_file():
        return None
    return {"file": f"layerskip_core/data/draft_vocab/{path.name}",
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "command": VOCAB_COMMAND}


def read_run(run: Path) -> tuple[dict, dict, list[dict]]:
    """(adapter header's metadata, tensors, metrics records) of a finished adapter run; refused in one line when
    the folder is not one."""
    from layerskip_core.adapter_spec import read_file  # lazy: torch, after the flags are checked

    adapter, metrics = run / "adapter.safetensors", run / "metrics.jsonl"
    if not adapter.is_file() or not metrics.is_file():
        raise UserError(f"{run} holds no finished adapter run (adapter.safetensors and metrics.jsonl); give the "
                        "output_dir of a recipe with an adapter: section after it finished")
    meta, tensors = read_file(adapter)
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return meta, tensors, records


def agreement_by_step(records: list[dict], exit_layer: int) -> dict:
    """The run's validation agreement: the plain exit's, then the adapter's at every evaluation."""
    E = str(exit_layer)
    evals = [r for r in records if r.get("split") == "val" and E in r.get("adapter_agreement", {})]
    if not evals:
        raise UserError("the run's metrics.jsonl holds no validation record; train with logging.eval_every > 0")
    out = {"plain_exit": round(evals[-1]["exit_agreement"][E], 3)}
    out |= {f"adapter_step_{r['step']}": round(r["adapter_agreement"][E], 3) for r in evals}
    return out


def provenance(run: Path, meta: dict, records: list[dict], recipe: str, data_command: str, name: str) -> dict:
    """The provenance file's fields, from the adapter's header, the run's metrics and its config's start time."""
    from train.distill_prompts import HELDOUT_KINDS  # lazy: torch via train

    shape, trained = json.loads(meta["shape"]), json.loads(meta["provenance"])
    distilled = [s for s in trained["sources"] if "self_distill" in s]
    raw = [s for s in trained["sources"] if "self_distill" not in s]
    kinds: dict[str, dict[str, int]] = {}  # a kind's prompts and tokens, summed over its files (passes)
    passes = []  # each generation pass's settings, once
    for src in distilled:
        counts = kinds.setdefault(src["self_distill"]["kind"], {"prompts": 0, "new_tokens": 0})
        for key in counts:
            counts[key] += src["self_distill"][key]
        settings = {k: v for k, v in (src["self_distill"].get("settings") or {}).items()
                    if k in ("max_new_tokens", "temperature", "top_p", "seed", "decoding")}
        if settings not in passes:
            passes.append(settings)
    started = (run / "config.yaml").stat().st_mtime  # written when the run starts
    steps = [r for r in records if "loss" in r and "split" not in r]
    return {
        "what": f"exit adapter: one attention layer{' and a SwiGLU MLP' if shape['mlp_size'] else ''} with its "
                f"norms on the stream entering layer {shape['exit_layer']} of the unchanged model, distilled from "
                "the frozen model's next-token distribution",
        "recipe": recipe, "data_command": data_command,
        "train_command": f"python train/layerskip.py --config {recipe}",
        "shape": shape, "target": trained["target"], "draft_vocab": trained.get("draft_vocab"),
        "draft_vocab_counts": counts_record(trained.get("draft_vocab"), name),
        "self_distilled_kinds": kinds,
        "self_distill_passes": passes,
        "self_distill_generated_tokens": sum(k["new_tokens"] for k in kinds.values()),
        "data_commit": distilled[0]["self_distill"].get("data_commit") if distilled else None,
        "raw_sources": raw, "held_out_kinds": list(HELDOUT_KINDS),
        "steps": trained["steps"], "loss_tokens": trained["tokens"], "block_size": trained["block_size"],
        "training_minutes": round((steps[-1]["time"] - started) / 60, 1) if steps else None,
        "validation_agreement_at_exit_" + str(shape["exit_layer"]): agreement_by_step(records, shape["exit_layer"]),
        "code_commit": trained["commit"],
        "measured": "docs/RESULTS.md, 'The shipped exit adapter by kind of text'",
    }


def run(args: argparse.Namespace) -> int:
    import torch
    from safetensors.torch import save_file

    meta, tensors, records = read_run(Path(args.run))
    shape = json.loads(meta["shape"])
    name = f"{args.name}-e{shape['exit_layer']}"
    out = Path(args.out)
    target = check_output_file(out / f"{name}.safetensors", "the shipped adapter", force=args.force,
                               inputs=(("--run", Path(args.run) / "adapter.safetensors"),))
    record = provenance(Path(args.run), meta, records, args.recipe, args.data_command, args.name)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(target), metadata=meta)
    os.chmod(target, 0o644)
    record = {"file": target.name, "dtype": args.dtype, "bytes": target.stat().st_size} | record
    if args.note:
        record["note"] = args.note
    write_result(out / f"{name}.provenance.json", record)
    print(f"shipped {target} ({record['bytes'] / 1e6:.1f} MB, {args.dtype}) and its provenance")
    return 0


def parser() -> Parser:
    ap = Parser(prog="python scripts/ship_adapter.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="the adapter run's output folder")
    ap.add_argument("--name", default="smollm2-135m-instruct", help="the model's name in the shipped file's name")
    ap.add_argument("--dtype", choices=DTYPES, default="fp32", help="the shipped tensors' dtype")
    ap.add_argument("--recipe", default="recipes/cpu-adapter-selfdistill.yaml", help="the recipe the run used")
    ap.add_argument("--data-command", default=DATA_COMMAND, help="the commands that made the self-distilled data")
    ap.add_argument("--note", default="", help="a remark the provenance carries as written (what the run cannot say)")
    ap.add_argument("--out", default="infer/data/adapters", help="the folder of shipped adapters")
    ap.add_argument("--force", action="store_true", help="replace a shipped adapter of the same name")
    return ap


def main(argv: list[str] | None = None) -> int:
    return parse_and_run(parser(), argv, "scripts/ship_adapter.py", run)


if __name__ == "__main__":
    raise SystemExit(main())
