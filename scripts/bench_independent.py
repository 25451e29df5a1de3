"""Drafters on independent prompts: each prompt decoded by a fresh drafter, as `layerskip generate` does.

    python scripts/bench_independent.py --data humaneval,gsm8k --n 4 --max-new-tokens 96 --repeats 3 --threads 1

`layerskip bench` keeps one drafter per method across a task's prompts (a stream). A user who runs
`layerskip generate` once per prompt gets a fresh drafter each time; what carries over is what a
drafter keeps in the toolkit cache through ``finish()`` (the fallback gate's measurements of
`swift` and `early_exit --adaptive`). This script measures that case: per prompt, every method in
turn (interleaved, so machine drift hits all alike) with a fresh engine, ``finish()`` after each
prompt; one untimed warm-up prompt per method first (kernels, and the gate memory a previous
command would have left). Reported per method: tokens/s over all prompts (median over repeats),
the ratio to `autoregressive` measured in the same run, and greedy exactness.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from core.cli import check_output_dir, run_main
from core.prompts import load_prompts, task_name, use_chat_template
from core.settings import ModelSettings
from infer.bench import BASELINE
from infer.drafters import parse_spec
from infer.engine import GenerationConfig
from infer.loading import load_from_settings
from layerskip_cli.args import add_model_flags, model_settings

SETTINGS = ModelSettings(threads=1)
"""This script's defaults: one thread."""


def decode_once(model, spec: str, ids: list[int], gen: GenerationConfig) -> tuple[list[int], float]:
    """One prompt with a fresh drafter, then its finish() hook (what a `layerskip generate` call does)."""
    engine, config = model.method(spec, gen)
    with engine:
        t0 = time.perf_counter()
        result = engine.generate(ids, config)
        wall = time.perf_counter() - t0
    return result.tokens, wall


def run(args: argparse.Namespace) -> int:
    specs = [BASELINE] + [s.strip() for s in args.drafters.split(",") if s.strip() and s.strip() != BASELINE]
    for spec in specs:
        parse_spec(spec)  # bad specs are refused before the model loads
    if args.out:
        check_output_dir(args.out, "--out")
    settings = model_settings(args, SETTINGS)
    model = load_from_settings(settings)
    prompts = []
    for source in [s.strip() for s in args.data.split(",") if s.strip()]:
        chat = use_chat_template(task_name(source))
        prompts += [(f"{task_name(source)}/{it.id}", model.encode(it.prompt, chat))
                    for it in load_prompts(source, args.n, from_end=True)]
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_at_eos=False)
    for spec in specs:  # warm-up: kernels, caches, and the gate memory an earlier command leaves
        decode_once(model, spec, prompts[0][1], GenerationConfig(max_new_tokens=16, stop_at_eos=False))
    walls = {spec: [0.0] * args.repeats for spec in specs}
    tokens = {spec: 0 for spec in specs}
    exact = {spec: 0 for spec in specs}
    for repeat in range(args.repeats):
        for pid, ids in prompts:
            ref = None
            for spec in specs:
                out, wall = decode_once(model, spec, ids, gen)
                walls[spec][repeat] += wall
                if repeat == 0:
                    tokens[spec] += len(out)
                    ref = out if spec == BASELINE else ref
                    exact[spec] += out == ref
            print(f"repeat {repeat + 1}/{args.repeats} {pid} done", file=sys.stderr)
    rows = summarise(specs, walls, tokens, exact, len(prompts))
    print(markdown(rows, args))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "independent.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                                "rows": rows}, indent=1) + "\n")
    return 0


def summarise(specs, walls, tokens, exact, n_prompts) -> list[dict]:
    """tokens/s per repeat (all prompts), their median, and the per-repeat ratio to autoregressive."""
    base = [tokens[BASELINE] / w for w in walls[BASELINE]]
    rows = []
    for spec in specs:
        tps = [tokens[spec] / w for w in walls[spec]]
        ratios = [t / b for t, b in zip(tps, base, strict=True)]
        rows.append({"method": spec, "tok_s": statistics.median(tps), "vs_ar": statistics.median(ratios),
                     "vs_ar_per_repeat": ratios, "exact": f"{exact[spec]}/{n_prompts}"})
    return rows


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [f"{len(rows)} methods, {args.n} prompts per task of {args.data}, {args.max_new_tokens} tokens each, "
             f"{args.repeats} repeats, {args.threads or SETTINGS.threads} thread(s); a fresh drafter per prompt", "",
             "| method | tok/s | vs autoregressive (median) | per repeat | greedy exact |", "|---|---:|---:|---|---:|"]
    for r in rows:
        per = ", ".join(f"{x:.2f}" for x in r["vs_ar_per_repeat"])
        lines.append(f"| `{r['method']}` | {r['tok_s']:.2f} | {r['vs_ar']:.3f}x | {per} | {r['exact']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p, SETTINGS)
    p.add_argument("--drafters", default="swift,early_exit:E=8:k=4:adaptive=true",
                   help="drafter specs compared with autoregressive (comma-separated)")
    p.add_argument("--data", default="humaneval,gsm8k", help="prompt sources (held-out end of each)")
    p.add_argument("--n", type=int, default=4, help="prompts per source")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="folder for independent.json")
    args = p.parse_args(argv)
    return run_main("bench_independent", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
