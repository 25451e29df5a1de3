"""An exit adapter decoding by kind of text: in-distribution validation prompts and whole kinds held out of training.

    python -m tools.experiments.adapter_kinds --adapter default --group heldout --n 6 --max-new-tokens 64 \\
        --settings k=4:confidence=0.5 --out runs/adapter_kinds_heldout

writes the prompt files (``<out>/prompts/<kind>.jsonl``: the user's turn in the chat template for chat kinds, raw
text for manual pages), runs ``layerskip bench`` on them (greedy, 1 thread, plain decoding and the adapter at each
``--settings``; output checked identical to plain decoding) and writes ``<out>/kinds.md``: per kind and setting
the acceptance, tokens per verification M, the tokens drafted, the measured speed-up over plain decoding, and the
cost model's speed-up M / (f·c + v(T)) at the measured draft cost c and the row's mean tokens per verification T
(a token tree verifies more), with v(T) as cheap as ``--verify-costs`` (the decoding-speed issue's targets, linear
between them), beside the one measured on this machine. ``--group validation``
takes each training kind's last prompts (never generated for training, ``train.distill_prompts``);
``--group heldout`` the kinds kept out of training (stories, Rust code, manual pages).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

from infer.model.plan import cycle_speedup
from layerskip_core.cli import Parser, check_output_dir, run_main
from layerskip_core.errors import UserError
from layerskip_core.models import resolve_model
from layerskip_core.settings import check_threads
from train.distill_prompts import (
    HELDOUT_KINDS,
    TRAIN_KINDS,
    KindPrompt,
    heldout_manpages,
    prompts_of,
    validation_prompts,
)
from train.self_distill import prompt_text


def group_prompts(group: str) -> dict[str, list[KindPrompt]]:
    """Kind -> prompts of a group: 'validation' (training kinds' held-back prompts) or 'heldout' (whole kinds)."""
    if group == "validation":
        return {k: validation_prompts(k) for k in TRAIN_KINDS}
    kinds = {k: prompts_of(k) for k in HELDOUT_KINDS if k != "manpages"}
    pages = heldout_manpages()
    if pages:
        kinds["manpages"] = pages
    else:
        print("adapter_kinds: no `man` pages on this machine; the manpages kind is left out", file=sys.stderr)
    return kinds


def write_prompt_files(folder: Path, kinds: dict[str, list[KindPrompt]], tokenizer) -> list[Path]:
    """One ``<kind>.jsonl`` per kind (``prompt``: the text the model sees, template applied), in kind order."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for kind, prompts in kinds.items():
        path = folder / f"{kind}.jsonl"
        path.write_text("".join(json.dumps({"id": p.id, "prompt": prompt_text(tokenizer, p)}) + "\n"
                                for p in prompts))
        paths.append(path)
    return paths


def bench_command(args: argparse.Namespace, files: list[Path]) -> list[str]:
    """The ``layerskip bench`` call: plain decoding and the adapter at each setting, greedy, no peers."""
    drafters = ["autoregressive"] + [f"early_exit:{s}" if s.startswith("adapter=") else
                                     f"early_exit:adapter={args.adapter}:{s}" for s in args.settings.split(",")]
    return [sys.executable, "-m", "layerskip_cli", "bench", "--model", args.model, "--drafters", ",".join(drafters),
            "--peers", "none", "--data", ",".join(map(str, files)), "--chat", "never", "--n", str(args.n),
            "--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats), "--threads",
            str(args.threads), "--quality-data", "none", "--out", str(Path(args.out) / "bench"), "--force"]


TARGET_VERIFY_COSTS = "1:1,4:1.15,8:1.4,16:2"
"""v(T) at a few T: the decoding-speed issue's targets (v(4) <= 1.15, v(8) <= 1.40, v(16) <= 2.0)."""


def verify_costs(text: str) -> list[tuple[float, float]]:
    """``T:v,T:v,...`` -> sorted (T, v) points (at least two, T >= 1, v > 0), or a one-line error."""
    try:
        points = sorted((float(t), float(v)) for t, v in (item.split(":") for item in text.split(",")))
    except ValueError:
        raise UserError(f"--verify-costs takes T:v pairs separated by commas (e.g. {TARGET_VERIFY_COSTS}), got "
                        f"{text!r}") from None
    if len(points) < 2 or any(t < 1 or v <= 0 for t, v in points) or len({t for t, _ in points}) < len(points):
        raise UserError(f"--verify-costs needs two or more distinct T >= 1 with v > 0, got {text!r}")
    return points


def verify_cost_at(points: list[tuple[float, float]], tokens: float) -> float:
    """v at ``tokens`` verified tokens: linear between the points, the end segments extended beyond them."""
    i = next((j for j in range(1, len(points) - 1) if tokens <= points[j][0]), len(points) - 1)
    (t0, v0), (t1, v1) = points[i - 1], points[i]
    return v0 + (v1 - v0) * (tokens - t0) / (t1 - t0)


def kind_rows(summaries: list[dict], points: list[tuple[float, float]]) -> list[str]:
    """Markdown rows of the adapter's summaries: measured numbers and the cost model at ``points``' v(T)."""
    rows = []
    for s in summaries:
        if not s["method"].startswith("early_exit"):
            continue
        adapter, _, setting = s["method"].split("adapter=", 1)[1].partition(":")
        setting = f"{Path(adapter).stem}: {setting}"
        projected = tokens = None
        m = s["tokens_per_verify"]
        if m and s["new_tokens"]:
            tokens = 1 + s["drafted"] * m / s["new_tokens"]  # per verification: the pending token and the drafted
        if tokens and s["draft_cost_ratio"] is not None and s["mean_draft_forwards"] is not None:
            projected = cycle_speedup(m, s["mean_draft_forwards"], s["draft_cost_ratio"],
                                      verify_cost_at(points, tokens))
        cells = [s["task"], setting, _f(s["acceptance_rate"]), _f(m), str(s.get("drafted")), _f(tokens),
                 _f(s["speedup_vs_autoregressive"], "x"), _f(s["draft_cost_ratio"]), _f(s["verify_cost_ratio"]),
                 _f(projected, "x"), str(s["exact_mismatches"]), s.get("note") or ""]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _f(x: float | None, suffix: str = "") -> str:
    return "–" if x is None else f"{x:.2f}{suffix}"


def write_table(out: Path, command: list[str], costs: str) -> str:
    results = json.loads((out / "bench" / "results.json").read_text())
    head = ["kind", "setting", "acceptance", "M", "drafted", "T", "speed-up (measured)", "c", "v (measured)",
            f"speed-up at v(T) {costs}", "mismatches", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += kind_rows(results["summary"], verify_costs(costs))
    text = "\n".join(lines) + "\n\nCommand: `layerskip " + " ".join(command[3:]) + "`\n"
    (out / "kinds.md").write_text(text)
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = Parser(prog="python -m tools.experiments.adapter_kinds", description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", default="default", help="adapter file or 'default' (the shipped one)")
    ap.add_argument("--model", default="default", help="the adapter's base model")
    ap.add_argument("--group", choices=("validation", "heldout"), required=True)
    ap.add_argument("--settings", default="k=4:confidence=0.5",
                    help="comma-separated early_exit options for the adapter, e.g. k=4:confidence=0.5,k=6; one that "
                         "starts with adapter=FILE drafts with that file instead (a before/after comparison)")
    ap.add_argument("--n", type=int, default=6, help="prompts per kind")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--verify-costs", default=TARGET_VERIFY_COSTS,
                    help="T:v points of the cost model's v(T), linear between them (default: the decoding-speed "
                         "issue's targets; 1:1,16:1 for verification that costs one step at any T)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--force", action="store_true", help="replace an earlier run's folder")
    args = ap.parse_args(argv)
    if args.n < 1 or args.max_new_tokens < 1 or args.repeats < 1:
        raise UserError("--n, --max-new-tokens and --repeats must be >= 1")
    check_threads(args.threads)  # here, not only in the bench it starts after writing the prompt files
    verify_costs(args.verify_costs)  # refused before the bench runs
    return args


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    check_output_dir(out, "--out", writes=("kinds.md", "bench"), force=args.force)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    files = write_prompt_files(out / "prompts", group_prompts(args.group), tokenizer)
    command = bench_command(args, files)
    if subprocess.run(command).returncode != 0:
        raise UserError(f"layerskip bench failed (its output is above); command: {' '.join(command[2:])}")
    print(write_table(out, command, args.verify_costs))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main("tools/experiments/adapter_kinds.py", lambda: _main(argv))


if __name__ == "__main__":
    sys.exit(main())
