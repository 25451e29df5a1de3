"""SWIFT over one stream of real prompts that alternates between tasks, against autoregressive decoding.

    python scripts/swift_stream.py --model base=default --model trained=runs/cpu-demo/final \\
        --data humaneval,gsm8k --n 3 --max-new-tokens 128 --repeats 2 --threads 1 --out runs/compare/swift_stream

SWIFT keeps its plan and optimiser across the prompts of a stream, so the interesting numbers are
over a stream, not per prompt: per task, tokens/s of SWIFT and of `autoregressive` on the same
prompts (medians over repeats; each repeat starts a fresh SWIFT), the speed-up, acceptance,
tokens per verify, the optimisation time share, the plan's skip ratio and the matchness of the
best plan over time. Prompts alternate between tasks (held-out: taken from the end of each set),
so a plan found on one task is carried into the other. Greedy outputs are checked against
`autoregressive` token for token. Writes stream.json, stream.md and matchness.png into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from tqdm.auto import tqdm

from infer.drafters import build_drafter
from infer.engine import Engine, GenerationConfig
from infer.loading import load_model, set_threads
from infer.plots import plot_matchness
from infer.prompts import load_prompts


def interleaved(sources: list[str], n: int) -> list[tuple[str, str, str]]:
    """(task, prompt id, text), alternating tasks: a1 b1 a2 b2 ..."""
    per_task = {s: load_prompts(s, n, from_end=True) for s in sources}
    out = []
    for i in range(n):
        out += [(task, items[i].id, items[i].prompt) for task, items in per_task.items() if i < len(items)]
    return out


def run_stream(model, drafter: str, options: dict, prompts: list[tuple[str, str, list[int]]],
               gen: GenerationConfig, bar) -> list[dict]:
    """One stream: a single engine (one drafter state) over every prompt in order."""
    engine = Engine(model.runner, build_drafter(drafter, model.runner, options), model.eos_token_ids, model.decode)
    rows = []
    for task, pid, ids in prompts:
        r = engine.generate(ids, gen)
        s = r.stats
        rows.append({"task": task, "id": pid, "tokens": r.tokens, "new_tokens": s.new_tokens, "wall": s.wall_time,
                     "verify_calls": s.verify_calls, "drafted": s.drafted, "accepted": s.accepted,
                     "drafter": {k: v for k, v in s.drafter.items()}})
        bar.update()
    return rows


def summarise(runs: dict[str, list[list[dict]]]) -> dict:
    """Per task: medians over repeats of tokens/s, and SWIFT's acceptance, M, optimisation share, skip ratio."""
    out: dict[str, dict] = {}
    tasks = sorted({row["task"] for row in runs["autoregressive"][0]})
    for task in tasks:
        entry: dict = {}
        for method, repeats in runs.items():
            tps = []
            for rows in repeats:
                rs = [r for r in rows if r["task"] == task]
                tps.append(sum(r["new_tokens"] for r in rs) / sum(r["wall"] for r in rs))
            entry[f"{method}_tokens_per_second"] = statistics.median(tps)
        swift = [r for rows in runs["swift"] for r in rows if r["task"] == task]
        drafted = sum(r["drafted"] for r in swift)
        wall = sum(r["wall"] for r in swift)
        entry["speedup"] = entry["swift_tokens_per_second"] / entry["autoregressive_tokens_per_second"]
        entry["acceptance_rate"] = sum(r["accepted"] for r in swift) / drafted if drafted else 0.0
        entry["tokens_per_verify"] = (sum(r["new_tokens"] - 1 for r in swift)
                                      / max(1, sum(r["verify_calls"] for r in swift)))
        entry["opt_time_share"] = sum(float(r["drafter"].get("opt_time", 0.0)) for r in swift) / wall
        entry["plain_step_share"] = (sum(int(r["drafter"].get("plain_steps", 0)) for r in swift)
                                     / max(1, sum(r["verify_calls"] for r in swift)))
        out[task] = entry
    return out


def exact(runs: dict[str, list[list[dict]]]) -> tuple[int, int]:
    """(identical, compared) greedy outputs of SWIFT vs autoregressive, first repeat."""
    ref = {r["id"]: r["tokens"] for r in runs["autoregressive"][0]}
    same = sum(r["tokens"] == ref[r["id"]] for r in runs["swift"][0])
    return same, len(runs["swift"][0])


def final_state(runs: dict[str, list[list[dict]]]) -> dict:
    last = runs["swift"][0][-1]["drafter"]
    return {k: last.get(k) for k in ("plan", "skip_ratio", "best_matchness", "mode", "stop_reason",
                                      "predicted_speedup", "opt_steps")}


def trajectory(rows: list[dict]) -> list[tuple[int, float]]:
    return [tuple(p) for r in rows for p in r["drafter"].get("matchness_trajectory", [])]


def markdown(results: dict) -> str:
    lines = ["| model | task | autoregressive tok/s | swift tok/s | speed-up | α | M | opt. share | plain-step share |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, res in results.items():
        for task, e in res["tasks"].items():
            lines.append(f"| {label} | {task} | {e['autoregressive_tokens_per_second']:.2f} | "
                         f"{e['swift_tokens_per_second']:.2f} | {e['speedup']:.2f}x | {e['acceptance_rate']:.2f} | "
                         f"{e['tokens_per_verify']:.2f} | {e['opt_time_share']:.1%} | {e['plain_step_share']:.0%} |")
    lines.append("")
    for label, res in results.items():
        st = res["final_state"]
        lines.append(f"- **{label}**: exact {res['exact'][0]}/{res['exact'][1]}; final plan skips "
                     f"{st['skip_ratio']:.0%} of sublayers, best matchness {st['best_matchness']:.2f}, "
                     f"mode `{st['mode']}`, stop reason `{st['stop_reason']}`, {st['opt_steps']} optimisation steps")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True, help="LABEL=PATH or PATH ('default' allowed)")
    p.add_argument("--data", default="humaneval,gsm8k")
    p.add_argument("--n", type=int, default=3, help="prompts per task")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--swift", default="", help="SWIFT options, e.g. 'skip_ratio=0.3,tree=false'")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    set_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    options = dict(kv.split("=", 1) for kv in args.swift.split(",") if kv)
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens)
    items = interleaved(args.data.split(","), args.n)
    results = {}
    for spec in args.model:
        label, _, source = spec.rpartition("=") if "=" in spec else (spec, "", spec)
        model = load_model(source)
        prompts = [(task, pid, model.encode(text, chat=(task == "gsm8k"))) for task, pid, text in items]
        runs: dict[str, list[list[dict]]] = defaultdict(list)
        with tqdm(total=2 * args.repeats * len(prompts), desc=label) as bar:
            for _ in range(args.repeats):
                runs["autoregressive"].append(run_stream(model, "autoregressive", {}, prompts, gen, bar))
                runs["swift"].append(run_stream(model, "swift", options, prompts, gen, bar))
        results[label] = {"tasks": summarise(runs), "exact": exact(runs), "final_state": final_state(runs),
                          "matchness_trajectory": trajectory(runs["swift"][0]),
                          "order": [f"{t}/{i}" for t, i, _ in items]}
    (args.out / "stream.json").write_text(json.dumps(results, indent=1))
    (args.out / "stream.md").write_text(markdown(results))
    plot_matchness({label: res["matchness_trajectory"] for label, res in results.items()},
                   args.out / "matchness.png", "SWIFT over a HumanEval/GSM8K stream")
    print(markdown(results))


if __name__ == "__main__":
    main()
