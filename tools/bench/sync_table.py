"""Host syncs per draft-verify cycle of each drafter, counted by ``tools.syncs`` (same counts on CPU and GPU).

    python -m tools.bench.sync_table                                   # default model, static executor, greedy
    python -m tools.bench.sync_table --device cuda --executor graphs   # on a GPU

Every read of a device value on the host drains the GPU's queue, which is what CUDA graphs exist to avoid.
This decodes one prompt with each drafter and prints syncs per cycle (propose + verify + accept), per
token, draft forwards per cycle and the syncs of the drafter's ``update`` (SWIFT's optimiser) apart, with
the budget each drafter is held to: 1 for a chain that does not stop on confidence, one more per draft step
for one that does, and one more for SWIFT's tree.
"""

from __future__ import annotations

import argparse
import sys

from layerskip_cli.args import add_model_flags, model_settings
from layerskip_core.cli import Parser, add_output_flags, check_output_file, parse_and_run, write_result
from layerskip_core.settings import ModelSettings

SETTINGS = ModelSettings(executor="static")
"""This script's defaults: one thread, the static executor (what CUDA graphs capture)."""

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
DRAFTERS = ("autoregressive,early_exit:E=24:k=4,early_exit:E=24:k=4:confidence=0.3,"
            "self_sd:plan=plans/smollm2-135m-humaneval-speed.json,swift:adaptive=false:remember=off")


def budget(drafter, result: dict) -> float:
    """The most syncs per cycle a drafter may make (greedy, static executor)."""
    if not getattr(drafter.config, "confidence", 0.0):  # a chain that does not stop on confidence
        return 1.0
    tree = drafter.name == "swift" and drafter.config.tree
    return result["draft_steps_per_cycle"] + (2.0 if tree else 1.0)


def measure(args: argparse.Namespace) -> list[dict]:
    # torch and the engine load only after argument parsing (so --help answers at once)
    from infer.decode.engine import DecodeConfig  # lazy: torch, after the flags are checked
    from infer.drafters import parse_spec  # lazy: torch, after the flags are checked
    from infer.loading import load_resolved  # lazy: transformers, after the flags are checked
    from tools.syncs import measure_decode  # lazy: torch, after the flags are checked

    specs = [s.strip() for s in args.drafters.split(",") if s.strip()]
    parsed = [parse_spec(s) for s in specs]  # bad specs fail before the model loads
    model = load_resolved(model_settings(args, SETTINGS).resolve())
    prompt = model.encode(args.prompt)
    base = DecodeConfig(max_new_tokens=args.max_new_tokens, stop_at_eos=False)
    rows = []
    for spec, parsed_spec in zip(specs, parsed, strict=True):
        engine, config = model.method(parsed_spec, base)
        with engine:
            result = measure_decode(engine, prompt, config)
        rows.append({"drafter": spec, **result, "budget": budget(engine.drafter, result),
                     "executor": model.runner.executor, "device": str(model.runner.device)})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| drafter | syncs/cycle | budget | syncs/token | draft steps/cycle | update syncs/cycle |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        ok = "" if r["per_cycle"] <= r["budget"] + 1e-9 else " (over)"
        lines.append(f"| `{r['drafter']}` | {r['per_cycle']:.2f}{ok} | {r['budget']:.2f} | {r['per_token']:.2f} | "
                     f"{r['draft_steps_per_cycle']:.2f} | {r['update_per_cycle']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    add_model_flags(p, SETTINGS)
    p.add_argument("--drafters", default=DRAFTERS, help=f"comma-separated drafter specs (default {DRAFTERS})")
    p.add_argument("--prompt", default=PROMPT, help="the prompt text")
    p.add_argument("--max-new-tokens", type=int, default=64)
    add_output_flags(p, "also write the rows here", flag="--json")
    return parse_and_run(p, argv, "sync_table", run)


def run(args: argparse.Namespace) -> int:
    if args.json is not None:
        check_output_file(args.json, "--json", force=args.force)
    rows = measure(args)
    print(table(rows))
    if args.json is not None:
        write_result(args.json, rows)
    return 0 if all(r["per_cycle"] <= r["budget"] + 1e-9 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
