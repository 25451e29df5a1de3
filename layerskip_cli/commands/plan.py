"""``layerskip plan``: bring a published skip set in as a plan file tied to a model, or show a plan file."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from infer.model.plan import LayerPlan, PlanFile
from layerskip_core import jsonfile
from layerskip_core.cli import check_output_file
from layerskip_core.errors import UserError

ATTN_KEYS = ("attention", "attn", "skip_attn", "attn_skip_layer_id_set")
MLP_KEYS = ("mlp", "skip_mlp", "mlp_skip_layer_id_set")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="import a published skip set as a plan file, or show a plan file",
                       description="Plan files tie a sublayer skip set to one model (its identity and weight "
                       "fingerprint); self_sd and swift read them.")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    imp = actions.add_parser("import", help="write a plan for --model from layer indices or a Self-SD/SWIFT JSON",
                             description="Skipped attention/MLP layer indices (0-based) from --attn/--mlp, or from "
                             "a JSON file: {\"attention\": [...], \"mlp\": [...]} (Self-SD's skip_layers.json entries; "
                             "pick one with --entry when the file maps model names to sets), SWIFT-style "
                             "attn_skip_layer_id_set/mlp_skip_layer_id_set, or skip_attn/skip_mlp.")
    imp.add_argument("--model", default="default",
                     help="the model the plan is for: a local folder, 'default' or 'gemma3-270m'")
    imp.add_argument("--attn", default=None, help="skipped attention layers, e.g. 3,5,9")
    imp.add_argument("--mlp", default=None, help="skipped MLP layers, e.g. 7,11")
    imp.add_argument("--from", dest="source", type=Path, default=None, help="a JSON file of skipped layer indices")
    imp.add_argument("--entry", default=None, help="with --from: which entry of a file keyed by model name")
    imp.add_argument("--out", type=Path, required=True, help="plan file to write (.json)")
    imp.add_argument("--force", action="store_true", help="overwrite an existing --out")
    imp.set_defaults(func=run_import)
    show = actions.add_parser("show", help="print a plan file")
    show.add_argument("path", type=Path)
    show.add_argument("--json", action="store_true", help="print the whole file as JSON")
    show.set_defaults(func=run_show)


def parse_indices(text: str, what: str) -> list[int]:
    """'3,5,9' -> [3, 5, 9] (blank = none)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what} {text!r}: give comma-separated layer numbers, e.g. 3,5,9") from None


def read_skip_json(path: Path, entry: str | None) -> tuple[list[int], list[int]]:
    """Skipped (attention, MLP) layer indices from a Self-SD/SWIFT-style JSON file."""
    d = jsonfile.read(path, "--from file of skipped layer lists")
    if entry is not None:
        if entry not in d or not isinstance(d[entry], dict):
            raise UserError(f"--from {path} has no entry {entry!r}; entries: {', '.join(map(str, d))}")
        d = d[entry]
    elif d.get("format") is not None and isinstance(d.get("plan"), dict):  # one of our plan files
        d = d["plan"]
    attn = next((d[k] for k in ATTN_KEYS if k in d), None)
    mlp = next((d[k] for k in MLP_KEYS if k in d), None)
    if attn is None and mlp is None:
        models = [k for k, v in d.items() if isinstance(v, dict)]
        hint = f" (it maps names to skip sets: pick one with --entry, e.g. --entry {models[0]})" if models else ""
        raise UserError(f"--from {path}: no skipped layer lists found (keys {'/'.join(ATTN_KEYS)} and "
                        f"{'/'.join(MLP_KEYS)}){hint}")
    with jsonfile.checked(path, "--from file of skipped layer lists"):
        return jsonfile.integers(attn or [], "the attention layers"), jsonfile.integers(mlp or [], "the MLP layers")


def run_import(args: argparse.Namespace) -> int:
    from infer.loading import load_model  # loads torch and transformers

    if args.source is not None and (args.attn is not None or args.mlp is not None):
        raise UserError("give either --from FILE or --attn/--mlp, not both")
    if args.source is None and args.attn is None and args.mlp is None:
        raise UserError("nothing to import: give --attn/--mlp layer numbers or --from FILE")
    if args.out.suffix != ".json":
        raise UserError(f"--out {args.out} should be a .json file")
    check_output_file(args.out, "--out", force=args.force, inputs=(("--from", args.source),))
    if args.source is not None:
        attn, mlp = read_skip_json(args.source, args.entry)
        task = f"imported from {args.source.name}" + (f" ({args.entry})" if args.entry else "")
    else:
        attn, mlp = parse_indices(args.attn or "", "--attn"), parse_indices(args.mlp or "", "--mlp")
        task = "imported"
    model = load_model(args.model)
    L = model.runner.num_layers
    bad = sorted(i for i in attn + mlp if not 0 <= i < L)
    if bad:
        raise UserError(f"layer numbers {bad} are out of range: {args.model} has {L} layers (0..{L - 1})")
    plan = LayerPlan(L, frozenset(attn), frozenset(mlp))
    PlanFile(plan, model.runner.identity(), task=task, source="import").save(args.out)
    print(f"{plan.describe()}; for {L}-layer {model.runner.spec.model_type}", file=sys.stderr)
    print(args.out)
    return 0


def run_show(args: argparse.Namespace) -> int:
    plan_file = PlanFile.load(args.path)
    if args.json:
        print(json.dumps(plan_file.to_dict(), indent=2))
        return 0
    m = plan_file.model
    lines = [f"plan:      {plan_file.plan.describe()}",
             f"model:     {m.get('model_type')} with {m.get('num_layers')} layers, hidden {m.get('hidden_size')}, "
             f"weights {m.get('weight_fingerprint')}",
             f"source:    {plan_file.source or '-'}" + (f" ({plan_file.task})" if plan_file.task else "")]
    if plan_file.objective:
        lines.append("objective: " + ", ".join(f"{k}={v}" for k, v in plan_file.objective.items()))
    print("\n".join(lines))
    return 0
