"""Drafters on independent prompts: each prompt decoded by a fresh drafter, as `layerskip generate` does.

    python -m tools.bench.bench_independent --data humaneval,gsm8k --n 4 --max-new-tokens 96 --repeats 3 --threads 1

`layerskip bench` keeps one drafter per method across a task's prompts (a stream). A user who runs
`layerskip generate` once per prompt gets a fresh drafter each time; what carries over is what a
drafter keeps in the toolkit cache through ``finish()`` (the fallback gate's measurements of
`swift` and `early_exit --adaptive`). This script measures that case: per prompt, every method in
turn (interleaved, so machine drift hits all alike) with a fresh engine, ``finish()`` after each
prompt. Only plain decoding warms up (kernels, allocator): the drafters start from whatever their
memory holds, so with an empty toolkit cache (``LAYERSKIP_CACHE=$(mktemp -d)``, with
``LAYERSKIP_MODEL_DIR`` pointing at the model) the first prompt is a cold start and counts like any
other. Reported per method: tokens/s over all prompts (median over repeats), the ratio to
`autoregressive` measured in the same run, per-prompt ratios (median over repeats), what the drafter
decided (plain steps, its last mode, its cost model's predicted speed-up) and greedy exactness.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from infer.decode.engine import DecodeConfig
from infer.drafters import parse_spec
from infer.loading import load_resolved
from infer.measure.methods import BASELINE
from layerskip_cli.args import add_model_flags, model_settings
from layerskip_core.cli import Parser, add_output_flags, check_output_dir, parse_and_run, write_result
from layerskip_core.prompts import load_prompts, task_name, use_chat_template


def decode_once(model, spec: str, ids: list[int], base_config: DecodeConfig):
    """One prompt with a fresh drafter, then its finish() hook (what a `layerskip generate` call does):
    (tokens, seconds, drafter stats)."""
    engine, config = model.method(spec, base_config)
    with engine:
        t0 = time.perf_counter()
        result = engine.generate(ids, config)
        wall = time.perf_counter() - t0
    return result.tokens, wall, result.stats


def run(args: argparse.Namespace) -> int:
    specs = [BASELINE] + [s.strip() for s in args.drafters.split(",") if s.strip() and s.strip() != BASELINE]
    for spec in specs:
        parse_spec(spec)  # bad specs are refused before the model loads
    if args.out:
        check_output_dir(args.out, "--out", writes=("independent.json",), force=args.force)
    resolved = model_settings(args).resolve()
    model = load_resolved(resolved)
    prompts = []
    for source in [s.strip() for s in args.data.split(",") if s.strip()]:
        chat = use_chat_template(task_name(source), tokenizer=model.tokenizer)
        prompts += [(f"{task_name(source)}/{it.id}", model.encode(it.prompt, chat))
                    for it in load_prompts(source, args.n, from_end=True)]
    base_config = DecodeConfig(max_new_tokens=args.max_new_tokens, stop_at_eos=False)
    decode_once(model, BASELINE, prompts[0][1], DecodeConfig(max_new_tokens=16, stop_at_eos=False))  # kernels
    runs = {spec: [] for spec in specs}  # spec -> [{prompt, repeat, tokens, wall, stats}]
    ref: dict[str, list[int]] = {}
    for repeat in range(args.repeats):
        for pid, ids in prompts:
            for spec in specs:
                out, wall, stats = decode_once(model, spec, ids, base_config)
                drafter = stats.to_dict()["drafter"]  # what this drafter reports, by name
                if spec == BASELINE and repeat == 0:
                    ref[pid] = out
                runs[spec].append({"prompt": pid, "repeat": repeat, "tokens": len(out), "wall": wall,
                                   "exact": out == ref.get(pid) if repeat == 0 else None,
                                   "plain_steps": drafter.get("plain_steps"), "mode": drafter.get("mode"),
                                   "predicted_speedup": drafter.get("predicted_speedup"),
                                   "verify_calls": stats.verify_calls, "drafted": stats.drafted,
                                   "accepted": stats.accepted})
            print(f"repeat {repeat + 1}/{args.repeats} {pid} done", file=sys.stderr)
    rows = summarise(specs, runs, [pid for pid, _ in prompts], args.repeats)
    print(markdown(rows, args, resolved.threads))
    if args.out:
        write_result(args.out / "independent.json", {"args": vars(args) | {"out": str(args.out)}, "rows": rows,
                                                     "runs": runs})
    return 0


def summarise(specs: list[str], runs: dict[str, list[dict]], prompt_ids: list[str], repeats: int) -> list[dict]:
    """Per method: tokens/s per repeat (all prompts), their median, the per-repeat ratio to autoregressive, and each
    prompt's ratio (the median over repeats of its tokens/s over autoregressive's on the same prompt and repeat)."""
    def cell(spec: str, pid: str, repeat: int) -> dict:
        return next(r for r in runs[spec] if r["prompt"] == pid and r["repeat"] == repeat)

    def tps(spec: str, repeat: int) -> float:
        rs = [r for r in runs[spec] if r["repeat"] == repeat]
        return sum(r["tokens"] for r in rs) / sum(r["wall"] for r in rs)

    rows = []
    for spec in specs:
        per_repeat = [tps(spec, k) for k in range(repeats)]
        ratios = [t / tps(BASELINE, k) for k, t in enumerate(per_repeat)]
        per_prompt = {}
        for pid in prompt_ids:
            r = [(cell(spec, pid, k)["tokens"] / cell(spec, pid, k)["wall"])
                 / (cell(BASELINE, pid, k)["tokens"] / cell(BASELINE, pid, k)["wall"]) for k in range(repeats)]
            per_prompt[pid] = statistics.median(r)
        first = [r for r in runs[spec] if r["repeat"] == 0]
        rows.append({"method": spec, "tok_s": statistics.median(per_repeat), "vs_ar": statistics.median(ratios),
                     "vs_ar_per_repeat": ratios, "vs_ar_per_prompt": per_prompt,
                     "exact": f"{sum(bool(r['exact']) for r in first)}/{len(first)}",
                     "plain_steps": sum(r["plain_steps"] or 0 for r in runs[spec]),
                     "verify_calls": sum(r["verify_calls"] for r in runs[spec]),
                     "drafted": sum(r["drafted"] for r in runs[spec]),
                     "predicted_speedup": [r["predicted_speedup"] for r in first]})
    return rows


def markdown(rows: list[dict], args: argparse.Namespace, threads: int) -> str:
    prompts = list(rows[0]["vs_ar_per_prompt"])
    lines = [f"{len(rows)} methods, {args.n} prompts per task of {args.data}, {args.max_new_tokens} tokens each, "
             f"{args.repeats} repeats, {threads} thread(s); a fresh drafter per prompt", "",
             "| method | tok/s | vs autoregressive (median) | per repeat | min / max per prompt | plain steps | "
             "drafted | greedy exact |", "|---|---:|---:|---|---|---:|---:|---:|"]
    for r in rows:
        per = ", ".join(f"{x:.2f}" for x in r["vs_ar_per_repeat"])
        pp = r["vs_ar_per_prompt"].values()
        lines.append(f"| `{r['method']}` | {r['tok_s']:.2f} | {r['vs_ar']:.3f}x | {per} | {min(pp):.2f} / "
                     f"{max(pp):.2f} | {r['plain_steps']}/{r['verify_calls']} | {r['drafted']} | {r['exact']} |")
    lines += ["", "Per prompt (tokens/s over autoregressive on the same prompt, median over repeats):", "",
              "| prompt | " + " | ".join(f"`{r['method']}`" for r in rows[1:]) + " |",
              "|---|" + "---:|" * (len(rows) - 1)]
    for pid in prompts:
        lines.append(f"| {pid} | " + " | ".join(f"{r['vs_ar_per_prompt'][pid]:.2f}x" for r in rows[1:]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p)
    p.add_argument("--drafters", default="swift,early_exit:E=8:k=4:adaptive=true",
                   help="drafter specs compared with autoregressive (comma-separated)")
    p.add_argument("--data", default="humaneval,gsm8k", help="prompt sources (held-out end of each)")
    p.add_argument("--n", type=int, default=4, help="prompts per source")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    add_output_flags(p, "folder for independent.json")
    return parse_and_run(p, argv, "bench_independent", run)


if __name__ == "__main__":
    sys.exit(main())
