"""SWIFT over one stream of real prompts that alternates between tasks, against autoregressive decoding.

    python -m tools.bench.swift_stream --model base=default --model trained=runs/cpu-demo/final \\
        --data humaneval,gsm8k --n 3 --max-new-tokens 128 --repeats 2 --threads 1 --out runs/compare/swift_stream

SWIFT keeps its plan and optimiser across the prompts of a stream, so the interesting numbers are
over a stream, not per prompt: per task, tokens/s of each SWIFT variant and of `autoregressive`
on the same prompts (they take turns prompt by prompt; medians over repeats; each repeat starts
fresh, cold drafters: `remember=off` unless a spec sets it), the speed-up, acceptance,
tokens per verify, the optimisation time share, the plan's skip ratio and the matchness of the
best plan over time. Prompts alternate between tasks (held-out: taken from the end of each set),
so a plan found on one task is carried into the other. Greedy outputs are checked against
`autoregressive` token for token. Writes stream.json, stream.md and matchness.png into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from tqdm.auto import tqdm

from infer.decode.engine import DecodeConfig, tokens_per_verify
from infer.drafters import parse_spec
from infer.loading import load_resolved
from infer.measure.methods import BASELINE
from infer.measure.plots import plot_matchness
from layerskip_cli.args import add_run_flags, run_settings
from layerskip_core import jsonfile
from layerskip_core.cli import Parser, run_main, split_named, write_result
from layerskip_core.device import dtype_name
from layerskip_core.models import resolve_model
from layerskip_core.prompts import load_prompts, use_chat_template


def interleaved(sources: list[str], n: int) -> list[tuple[str, str, str]]:
    """(task, prompt id, text), alternating tasks: a1 b1 a2 b2 ..."""
    per_task = {s: load_prompts(s, n, from_end=True) for s in sources}
    out = []
    for i in range(n):
        out += [(task, items[i].id, items[i].prompt) for task, items in per_task.items() if i < len(items)]
    return out


def cold(text: str):
    """The spec, with ``remember=off`` for a drafter that remembers state across commands unless the spec sets
    ``remember``: no repeat starts from what an earlier repeat (or command) saved."""
    return parse_spec(text).remembering("off")


def run_streams(model, specs: list[str], prompts: list[tuple[str, str, list[int]]], base_config: DecodeConfig,
                bar) -> dict[str, list[dict]]:
    """One stream per drafter spec (one engine, one drafter state each); prompt by prompt, the
    drafters take turns, so a change in machine load hits all of them alike."""
    methods = {spec: model.method(cold(spec), base_config) for spec in specs}  # (engine, its config) per spec
    rows: dict[str, list[dict]] = {spec: [] for spec in specs}
    for task, pid, ids in prompts:
        for spec, (engine, config) in methods.items():
            r = engine.generate(ids, config)
            s = r.stats
            rows[spec].append({"task": task, "id": pid, "tokens": r.tokens, "stats": s, "new_tokens": s.new_tokens,
                               "wall": s.wall_time, "verify_calls": s.verify_calls, "drafted": s.drafted,
                               "accepted": s.accepted, "drafter": s.to_dict()["drafter"]})
            bar.update()
    for engine, _ in methods.values():
        engine.close()  # the drafters' finish(): save_plan, the gate's memory
    return rows


def summarise(runs: dict[str, list[list[dict]]]) -> dict:
    """Per task and drafter: median tokens/s over repeats, speed-up, and acceptance, M, optimisation share."""
    out: dict[str, dict] = {}
    tasks = sorted({row["task"] for row in runs[BASELINE][0]})
    for task in tasks:
        per_method = {}
        for method, repeats in runs.items():
            tps = []
            for rows in repeats:
                rs = [r for r in rows if r["task"] == task]
                tps.append(sum(r["new_tokens"] for r in rs) / sum(r["wall"] for r in rs))
            rs = [r for rows in repeats for r in rows if r["task"] == task]
            drafted, calls = sum(r["drafted"] for r in rs), max(1, sum(r["verify_calls"] for r in rs))
            wall = sum(r["wall"] for r in rs)
            per_method[method] = {
                "tokens_per_second": statistics.median(tps), "tokens_per_second_repeats": tps,
                "acceptance_rate": sum(r["accepted"] for r in rs) / drafted if drafted else 0.0,
                "drafted": drafted, "new_tokens": sum(r["new_tokens"] for r in rs),
                "tokens_per_verify": tokens_per_verify([r["stats"] for r in rs]) or 1.0,
                "opt_time_share": sum(float(r["drafter"].get("opt_time", 0.0)) for r in rs) / wall,
                "plain_step_share": sum(int(r["drafter"].get("plain_steps", 0)) for r in rs) / calls,
                "opt_steps": sum(int(r["drafter"].get("opt_steps", 0)) for r in rs) / len(repeats)}
        base = per_method[BASELINE]["tokens_per_second"]
        for entry in per_method.values():
            entry["speedup"] = entry["tokens_per_second"] / base
        out[task] = per_method
    return out


def exact(runs: dict[str, list[list[dict]]]) -> dict[str, list[int]]:
    """Per drafter: [identical, compared] greedy outputs vs autoregressive, first repeat."""
    ref = {r["id"]: r["tokens"] for r in runs[BASELINE][0]}
    return {m: [sum(r["tokens"] == ref[r["id"]] for r in reps[0]), len(reps[0])] for m, reps in runs.items()}


def final_state(rows: list[dict]) -> dict:
    last = rows[-1]["drafter"]
    return {k: last.get(k) for k in ("plan", "skip_ratio", "best_matchness", "mode", "stop_reason",
                                      "predicted_speedup")}


def trajectory(rows: list[dict]) -> list[tuple[int, float]]:
    return [tuple(p) for r in rows for p in r["drafter"].get("matchness_trajectory", [])]


def markdown(results: dict) -> str:
    lines = ["| model | task | drafter | tok/s | vs autoregressive | α (drafted/tokens) | M | opt. share | opt. steps "
             "| plain steps |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, res in results.items():
        for task, per_method in res["tasks"].items():
            for method, e in per_method.items():
                lines.append(f"| {label} | {task} | `{method}` | {e['tokens_per_second']:.2f} | {e['speedup']:.2f}x | "
                             f"{e['acceptance_rate']:.2f} ({e.get('drafted', '–')}/{e.get('new_tokens', '–')}) | "
                             f"{e['tokens_per_verify']:.2f} | {e['opt_time_share']:.1%} | "
                             f"{e['opt_steps']:.0f} | {e['plain_step_share']:.0%} |")
    lines.append("")
    for label, res in results.items():
        for method, st in res["final_state"].items():
            same, total = res["exact"][method]
            if st.get("skip_ratio") is None:  # not a plan-searching drafter (e.g. lossy plain decoding)
                lines.append(f"- **{label}**, `{method}`: exact {same}/{total}")
                continue
            pred = f"{st['predicted_speedup']:.2f}x" if st["predicted_speedup"] is not None else "n/a"
            best = "none scored" if st["best_matchness"] is None else f"{st['best_matchness']:.2f}"
            lines.append(f"- **{label}**, `{method}`: exact {same}/{total}; final plan skips "
                         f"{st['skip_ratio']:.0%} of sublayers, best matchness {best}, "
                         f"last mode `{st['mode']}`, cost-model speed-up of drafting {pred}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return run_main("swift_stream", lambda: _run(argv))


def _run(argv: list[str] | None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True, help="LABEL=PATH or PATH ('default' allowed)")
    p.add_argument("--data", default="humaneval,gsm8k")
    p.add_argument("--n", type=int, default=3, help="prompts per task")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    add_run_flags(p)
    p.add_argument("--drafters", default="swift,swift:paper=true",
                   help="drafter specs run as streams next to autoregressive (default: ours, and exactly the "
                   "paper's settings: no fallback, no optimisation budget, uncapped tree widths)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    run = run_settings(args).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    base_config = DecodeConfig(max_new_tokens=args.max_new_tokens)
    items = interleaved(args.data.split(","), args.n)
    specs = [BASELINE] + [d for d in args.drafters.split(",") if d]
    for spec in specs:
        parse_spec(spec)  # bad specs fail before any model loads
    results = {}
    for spec in args.model:
        label, source = split_named(spec)
        label = label or source
        model = load_resolved(dataclasses.replace(run, model=resolve_model(source)))
        prompts = [(task, pid, model.encode(text, chat=use_chat_template(task, tokenizer=model.tokenizer)))
                   for task, pid, text in items]
        runs: dict[str, list[list[dict]]] = defaultdict(list)
        with tqdm(total=len(specs) * args.repeats * len(prompts), desc=label) as bar:
            for _ in range(args.repeats):
                for method, rows in run_streams(model, specs, prompts, base_config, bar).items():
                    runs[method].append(rows)
        swifts = [m for m in specs if m != BASELINE]
        results[label] = {"device": str(model.runner.device), "dtype": dtype_name(model.runner.dtype),
                          "tasks": summarise(runs), "exact": exact(runs),
                          "final_state": {m: final_state(runs[m][0]) for m in swifts},
                          "matchness_trajectory": {m: trajectory(runs[m][0]) for m in swifts},
                          "order": [f"{t}/{i}" for t, i, _ in items]}
    write_result(args.out / "stream.json", results)
    jsonfile.write((args.out / "stream.md"), markdown(results))
    plot_matchness({f"{label} · {m}": traj for label, res in results.items()
                    for m, traj in res["matchness_trajectory"].items()},
                   args.out / "matchness.png", "SWIFT over a HumanEval/GSM8K stream")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
