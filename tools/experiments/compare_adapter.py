"""Three families of trained drafting at one token budget: the untrained early exit, an exit adapter on the
frozen model, and a LayerSkip checkpoint, at several exits E, on the same held-out text.

    python -m tools.experiments.compare_adapter --config recipes/cpu-demo-stdlib.yaml \\
        --checkpoint runs/cpu-demo/final \\
        --adapters runs/adapter-e4/adapter.safetensors,runs/adapter-e8/adapter.safetensors \\
        --bench-base runs/adapter_bench_base/results.json --bench-checkpoint runs/adapter_bench_ckpt/results.json \\
        --out runs/adapter_compare

Per E it reports (a) the base model's plain exit, (b) the adapter and (c) the checkpoint's exit:
- top-1 agreement with the verifying model, teacher-forced on the recipe's validation split (the per-token greedy
  acceptance of each drafter); the verifier is the base model for (a) and (b), the checkpoint for (c);
- the verifying model's own validation loss (unchanged for (a) and (b), the base model's weights being untouched);
- from `layerskip bench` runs (optional): acceptance while decoding, the draft cost c and the speed-up over
  plain decoding on this machine;
- a projection of the GPU speed-up from the cost model, speed-up = M / (k·c + v), with M the i.i.d. tokens per
  cycle at the teacher-forced agreement, the best k in 1..8, and the one H200's measured costs (``H200``).
It writes results.json, table.md and compare.png under --out.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from infer.model.plan import cycle_speedup, iid_tokens_per_cycle
from layerskip_cli.commands import eval_exits
from layerskip_core import jsonfile
from layerskip_core.adapter_spec import read_file
from layerskip_core.cli import Parser, check_output_dir, run_main
from layerskip_core.errors import UserError
from layerskip_core.models import resolve_model
from layerskip_core.settings import check_threads
from train.recipe import load_config

OUTPUTS = ("results.json", "table.md", "compare.png")
"""What a run writes in --out."""
FAMILIES = {"a": "untrained early exit (base model)", "b": "exit adapter (base model unchanged)",
            "c": "LayerSkip checkpoint's early exit"}


@dataclass(frozen=True)
class GpuCosts:
    """Decoding costs measured on one GPU, in units of one full one-token forward."""

    source: str
    """Where the numbers come from."""
    draft_exit: int
    """The exit E at which ``draft_cost`` was measured."""
    draft_cost: float
    """c(E) of a draft step through layers [0, E) and the LM head at ``draft_exit``."""
    verify_cost: float
    """v(T): verifying T tokens; the largest measured for T = 2..32 (a conservative single value)."""


H200 = GpuCosts("one H200, bf16, SmolLM2-135M, eager runner without graph capture (commit 002eeb9; "
                "docs/RESULTS.md, 'Where self-speculation pays')", draft_exit=8, draft_cost=0.27, verify_cost=1.26)


def gpu_projection(alpha: float, exit_layer: int, num_layers: int, extra_layers: int, gpu: GpuCosts = H200) -> dict:
    """Projected speed-up over plain decoding: the best k in 1..8 of M(α, k) / (k·c + v).

    Launch overhead dominates a small model's GPU step, so c scales with the layers a draft runs: c(E) =
    c(E0)·(E + extra)/E0, ``extra_layers`` = 1 for an adapter (one attention layer); the adapter's cache rows for
    the accepted tokens cost about one more layer over the verified rows, added to v as extra/L."""
    c = gpu.draft_cost * (exit_layer + extra_layers) / gpu.draft_exit
    v = gpu.verify_cost + extra_layers / num_layers
    speed, k = max((cycle_speedup(iid_tokens_per_cycle(alpha, k), k, c, v), k) for k in range(1, 9))
    return {"speedup": speed, "k": k, "c": c, "v": v}


def implied_per_token(tokens_per_verify: float | None, draft_forwards: float | None) -> float | None:
    """The i.i.d. per-token acceptance p that gives M tokens per verification with k̄ drafts a cycle: the decoding
    counterpart of the teacher-forced agreement (the bench's α = accepted/drafted also counts every draft after the
    first rejection, so it is far below p at k > 1)."""
    if not tokens_per_verify or not draft_forwards:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):  # bisection: M(p, k) rises with p
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if iid_tokens_per_cycle(mid, draft_forwards) < tokens_per_verify else (lo, mid)
    return (lo + hi) / 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="the recipe whose validation split is the held-out text")
    p.add_argument("--checkpoint", required=True, help="a LayerSkip training run's final folder (family c)")
    p.add_argument("--adapters", required=True, help="comma-separated adapter files, one per exit (family b)")
    p.add_argument("--n", type=int, default=32, help="validation examples (default 32)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bench-base", type=Path, default=None,
                   help="results.json of `layerskip bench` on the base model (early_exit at E and with the adapters)")
    p.add_argument("--bench-checkpoint", type=Path, default=None,
                   help="results.json of `layerskip bench` on the checkpoint (early_exit at E)")
    p.add_argument("--out", type=Path, required=True, help="folder for results.json, table.md and compare.png")
    p.add_argument("--force", action="store_true", help="write over an earlier run's results in --out")
    return p.parse_args(argv)


def exit_quality(model: str, config: str, exits: list[int], n: int, threads: int) -> dict:
    """``layerskip eval-exits`` on the recipe's validation split: per-exit agreement and the final loss."""

    p = Parser()
    eval_exits.add_arguments(p)
    args = p.parse_args(["--model", model, "--config", config, "--exits", ",".join(map(str, exits)),
                         "--n", str(n), "--threads", str(threads), "--dtype", "fp32", "--device", "cpu"])
    return eval_exits.evaluate(args)


def adapter_quality(paths: list[Path], cfg, n: int) -> dict[int, dict]:
    """Per adapter (keyed by its E): its and the plain exit's agreement with the recipe's base model
    (``train.adapter.adapter_eval``)."""
    from train.adapter import adapter_eval  # lazy: torch, after the inputs are checked
    from train.data import build_dataset  # lazy: torch, after the inputs are checked
    from train.model import load_model  # lazy: torch, after the inputs are checked

    model, tokenizer, path = load_model(cfg.model.name_or_path)
    val = build_dataset(cfg.data, tokenizer, path).val.take(n)
    out: dict[int, dict] = {}
    for adapter in paths:
        result = adapter_eval(model, adapter, val, tokenizer.pad_token_id)
        if result["exit_layer"] in out:
            raise UserError(f"two adapters at E={result['exit_layer']}: give one per exit")
        out[result["exit_layer"]] = result
    return out


BENCH_FIELDS = ("speedup_vs_autoregressive", "acceptance_rate", "tokens_per_verify", "mean_draft_forwards",
                "draft_cost_ratio", "exact_mismatches", "prompts")
"""The numbers this comparison reads from each summary row of a bench results.json (null allowed)."""


def read_bench(path: Path | None) -> list[dict]:
    """The summary rows of a bench results.json, every field this comparison reads checked (a bad file is one
    line before any model loads, not a KeyError at the end)."""
    if path is None:
        return []
    what, hint = "bench results.json", "written by layerskip bench --out"
    summary = jsonfile.read(path, what, hint=hint).get("summary", [])
    with jsonfile.checked(path, what, hint):
        if not isinstance(summary, list):
            raise ValueError("'summary' must be a list of rows")
        for i, row in enumerate(summary):
            jsonfile.text(jsonfile.obj(row, f"summary[{i}]")["method"], f"summary[{i}].method")
            for key in BENCH_FIELDS:
                if row[key] is not None:
                    jsonfile.number(row[key], f"summary[{i}].{key}")
    return summary


def bench_rows(summary: list[dict], adapters: dict[str, int], family: str) -> dict[tuple[str, int], dict]:
    """{(family, E): row} of a bench results.json's rows (``read_bench``): early_exit rows at E=..., and rows with an
    adapter file."""
    rows = {}
    for row in summary:
        method = row["method"]
        m = re.search(r"adapter=([^:]+)", method)
        if m:
            key = ("b", adapters.get(str(Path(m.group(1)))))
        elif (m := re.fullmatch(r"early_exit:E=(\d+)(:.*)?", method)):
            key = (family, int(m.group(1)))
        else:
            continue
        if key[1] is not None and key not in rows:
            rows[key] = {"method": method, "speedup": row["speedup_vs_autoregressive"],
                         "acceptance": row["acceptance_rate"], "tokens_per_verify": row["tokens_per_verify"],
                         "draft_forwards": row["mean_draft_forwards"], "c": row["draft_cost_ratio"],
                         "per_token": implied_per_token(row["tokens_per_verify"], row["mean_draft_forwards"]),
                         "exact": row["exact_mismatches"] == 0, "prompts": row["prompts"]}
    return rows


def adapter_paths(args: argparse.Namespace) -> list[Path]:
    paths = [Path(p.strip()).expanduser() for p in args.adapters.split(",") if p.strip()]
    if not paths:
        raise UserError("--adapters is empty: give one or more adapter files, comma-separated")
    return paths


def check_inputs(args: argparse.Namespace) -> tuple[list[Path], tuple[list[dict], list[dict]]]:
    """(adapter files, bench rows of --bench-base and --bench-checkpoint), every input read and checked before any
    evaluation: a bad file is refused in one line at once, not after minutes of work."""

    paths = adapter_paths(args)
    for path in paths:
        read_file(path)  # a missing, cut-off or damaged file; its model is checked when it is evaluated
    resolve_model(args.checkpoint)
    return paths, (read_bench(args.bench_base), read_bench(args.bench_checkpoint))


def compare(args: argparse.Namespace) -> dict:
    import torch


    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, [])
    paths, benches = check_inputs(args)
    adapters = adapter_quality(paths, cfg, args.n)
    exits = sorted(adapters)
    base = exit_quality(cfg.model.name_or_path, args.config, exits, args.n, args.threads)
    ckpt = exit_quality(args.checkpoint, args.config, exits, args.n, args.threads)
    L = base["num_layers"]
    by_path = {str(Path(r["adapter"])): E for E, r in adapters.items()}
    bench = bench_rows(benches[0], by_path, "a") | bench_rows(benches[1], by_path, "c")
    verifiers = {"a": verifier(base, base, L), "b": verifier(base, base, L), "c": verifier(ckpt, base, L)}
    rows = []
    for E in exits:
        agree = {"a": base["agreement"][E], "b": adapters[E]["adapter_agreement"], "c": ckpt["agreement"][E]}
        for fam, alpha in agree.items():
            rows.append({"E": E, "family": fam, "agreement": alpha, "tokens": adapters[E]["provenance"].get("tokens")
                         if fam == "b" else None, "cpu": bench.get((fam, E)), "verifier": verifiers[fam],
                         "gpu_projection": gpu_projection(alpha, E, L, 1 if fam == "b" else 0)})
    return {"config": args.config, "checkpoint": args.checkpoint, "examples": base["examples"],
            "tokens": base["tokens"][L], "num_layers": L, "gpu_costs": H200.__dict__,
            "validation_loss": {"base": base["loss"][L], "checkpoint": ckpt["loss"][L]},
            "task_accuracy": TASK_ACCURACY,
            "adapters": {str(E): r for E, r in adapters.items()}, "rows": rows}


TASK_ACCURACY = ("not scored here: the held-out text is a recipe's validation split, not a task (`layerskip bench "
                 "--data gsm8k` scores each verifier's GSM8K answers)")
"""What this comparison says of task accuracy (it scores none)."""


def verifier(result: dict, base: dict, num_layers: int) -> dict:
    """The verifying model's final-layer quality on the split (``eval_exits``' result), against the base model's:
    loss and perplexity, the change in nats, and the flag of a worse verifier (``infer.measure.quality``)."""
    from infer.measure.quality import flag, verdict  # lazy: torch, after the inputs are checked

    loss, delta = result["loss"][num_layers], result["loss"][num_layers] - base["loss"][num_layers]
    out = {"loss": loss, "perplexity": result["perplexity"][num_layers], "delta_nats": delta,
           "verdict": verdict(delta)}
    return out | {"flag": flag(out)}


def _verifier_cell(v: dict) -> str:
    change = "base" if v["delta_nats"] == 0 else (f"**{v['flag']}**" if v["flag"] else f"{v['delta_nats']:+.3f}")
    return f"{v['loss']:.3f} / {v['perplexity']:.2f} ({change})"


def _fmt(x, spec: str = ".3f") -> str:
    return "–" if x is None else format(x, spec)


def table(result: dict) -> str:
    """Markdown: one row per (E, family)."""
    loss = result["validation_loss"]
    lines = [f"Held-out: {result['examples']} blocks of {result['config']}'s validation split "
             f"({result['tokens']} tokens). Verifier's validation loss: base {loss['base']:.3f} (families a, b), "
             f"checkpoint {loss['checkpoint']:.3f} (family c), in nats per token. Task accuracy: {TASK_ACCURACY}.",
             "", "| E | drafter | verifier: loss / perplexity (Δ nats vs base) | agreement (teacher-forced) | "
             "CPU decoding: M / k̄ | implied p | α | c | speed-up | exact | GPU projection (k) |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in result["rows"]:
        cpu, gpu = r["cpu"] or {}, r["gpu_projection"]
        exact = "–" if not cpu else ("yes" if cpu["exact"] else "NO")
        lines.append(f"| {r['E']} | ({r['family']}) {FAMILIES[r['family']]} | {_verifier_cell(r['verifier'])} | "
                     f"{r['agreement']:.3f} | "
                     f"{_fmt(cpu.get('tokens_per_verify'), '.2f')} / {_fmt(cpu.get('draft_forwards'), '.2f')} | "
                     f"{_fmt(cpu.get('per_token'))} | {_fmt(cpu.get('acceptance'))} | {_fmt(cpu.get('c'), '.2f')} | "
                     f"{_fmt(cpu.get('speedup'), '.2f')}{'x' if cpu else ''} | {exact} | "
                     f"{gpu['speedup']:.2f}x ({gpu['k']}) |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Agreement and projected GPU speed-up against E, one line per family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for fam, label in FAMILIES.items():
        rows = [r for r in result["rows"] if r["family"] == fam]
        xs = [r["E"] for r in rows]
        left.plot(xs, [r["agreement"] for r in rows], marker="o", label=f"({fam}) {label}")
        right.plot(xs, [r["gpu_projection"]["speedup"] for r in rows], marker="o", label=f"({fam})")
    left.set(xlabel="exit layer E", ylabel="top-1 agreement with the verifier", title="held-out acceptance")
    right.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    right.set(xlabel="exit layer E", ylabel="speed-up over plain decoding",
              title="GPU projection (cost model, measured H200 costs)")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    if args.n < 1:
        raise UserError("--n must be >= 1")
    check_threads(args.threads)
    reads = [("--config", args.config), ("--checkpoint", args.checkpoint), ("--bench-base", args.bench_base),
             ("--bench-checkpoint", args.bench_checkpoint), *(("--adapters", p) for p in adapter_paths(args))]
    check_output_dir(args.out, "--out", writes=OUTPUTS, force=args.force, inputs=tuple(reads))
    result = compare(args)
    args.out.mkdir(parents=True, exist_ok=True)
    jsonfile.write((args.out / "results.json"), json.dumps(result, indent=1) + "\n")
    jsonfile.write((args.out / "table.md"), table(result) + "\n")
    plot(result, args.out / "compare.png")
    print(table(result))
    print(f"wrote {args.out}/results.json, table.md and compare.png", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_main("compare_adapter", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
