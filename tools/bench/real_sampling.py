"""The sampling matrix on a real checkpoint: each drafter's sampled tokens against the exact target distribution.

    python -m tools.bench.real_sampling --model gemma3-270m --samples 600 --threads 1 --out runs/real_sampling.json

The test suite's sampling matrix (tests/test_sampling_matrix.py) enumerates the exact joint of the first tokens on a
5-token model; a real vocabulary (Gemma 3's 262144 tokens) cannot be enumerated whole, but under top-k sampling the
target's support is small: the joint of the first ``--steps`` generated tokens is enumerated over the tokens the
warped target can draw (top-k 3: 27 sequences), each position's distribution made by transformers' own forward and
warpers (``lossless_stats.transformers_probs``: a reference independent of the code under test). Each case (a drafter
with options that make it draft here) decodes ``--samples`` rows of one short prompt as batches, each row with its
own seeded generator, and a chi-square test (``lossless_stats.chi2_pvalue``) asks whether the sample fits the joint;
the drafted and accepted totals show that drafting was exercised. A p-value under 1e-3 is a failure (exit 1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the matrix's helpers live with the tests
from lossless_stats import P_THRESHOLD, chi2_pvalue, transformers_probs  # noqa: E402

from infer.decode.engine import DecodeConfig  # noqa: E402
from infer.drafters.examples import ExampleModel  # noqa: E402
from infer.drafters.registry import example_cases  # noqa: E402
from infer.loading import load_resolved  # noqa: E402
from infer.model.sampling import SamplingConfig  # noqa: E402
from layerskip_cli.args import add_model_flags, model_settings  # noqa: E402
from layerskip_core.cli import Parser, parse_and_run, write_result  # noqa: E402

PROMPT = "def add(a, b):\n    return"
SAMPLINGS = {"t1-topk3": SamplingConfig(temperature=1.0, top_k=3),
             "t13-topk5-topp095": SamplingConfig(temperature=1.3, top_k=5, top_p=0.95)}
"""Warped so that the target's support spans several sequences on ``PROMPT`` (at temperature 0.7 with top-p 0.8 this
model's support there is one sequence: nothing to test)."""


def cases(layers: int) -> dict[str, tuple[str, dict]]:
    """Every registered drafter's examples (``infer.drafters.registry.example_cases``) at an exit near the top (where
    an untrained exit's drafts are accepted often enough to exercise acceptance and rejection), with the full draft
    head (nothing is built), and early exit with a confidence stop that keeps its last token; no plain decoding."""
    examples = example_cases(ExampleModel(layers, exit_layer=layers - 2))
    out = {case: (name, options | {"draft_vocab": "off"}) for case, (name, options) in examples.items()
           if name != "autoregressive"}
    stop = {"exit_layer": layers - 2, "num_draft": 3, "confidence": 0.3, "keep_last": True, "draft_vocab": "off"}
    return out | {"early_exit_stop_keep": ("early_exit", stop)}


@torch.no_grad()
def support_joint(hf, prompt: list[int], cfg: SamplingConfig, steps: int) -> dict[tuple[int, ...], float]:
    """The exact probability of every sequence of the first ``steps`` tokens the warped target can draw."""
    joint: dict[tuple[int, ...], float] = {}

    def walk(seq: tuple[int, ...], prob: float) -> None:
        if len(seq) == steps:
            joint[seq] = prob
            return
        logits = hf(torch.tensor([prompt + list(seq)])).logits[0, -1]  # (V,)
        probs = transformers_probs(logits, cfg)  # (V,)
        for token in torch.nonzero(probs > 0)[:, 0].tolist():
            walk((*seq, token), prob * probs[token].item())

    walk((), 1.0)
    return joint


def run_case(model, name: str, options: dict, prompt: list[int], cfg: SamplingConfig, joint: dict, args) -> dict:
    """``args.samples`` rows of ``prompt`` decoded in batches; the p-value of their first tokens against ``joint``."""
    config = DecodeConfig(max_new_tokens=args.new_tokens, sampling=cfg, stop_at_eos=False)
    results, t0 = [], time.perf_counter()
    with model.batch_engine(name, options, batch_size=args.batch_size) as batch:
        for start in range(0, args.samples, args.batch_size):
            rows = range(start, min(start + args.batch_size, args.samples))
            generators = [torch.Generator().manual_seed(args.seed + i) for i in rows]
            results += batch.generate([prompt] * len(rows), config, generators)
    cells = sorted(joint)
    index = {c: i for i, c in enumerate(cells)}
    counts, outside = np.zeros(len(cells)), 0
    for result in results:
        key = tuple(result.tokens[:args.steps])
        if key in index:
            counts[index[key]] += 1
        else:
            outside += 1  # a sequence the target cannot draw
    pvalue = 0.0 if outside else chi2_pvalue(counts, np.array([joint[c] for c in cells]))
    return {"pvalue": pvalue, "samples": len(results), "cells": len(cells), "outside_support": outside,
            "drafted": sum(r.stats.drafted for r in results), "accepted": sum(r.stats.accepted for r in results),
            "seconds": round(time.perf_counter() - t0, 1)}


def run(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM

    model = load_resolved(model_settings(args).resolve())
    hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32)
    prompt = model.encode(PROMPT)
    table = cases(model.runner.num_layers)
    chosen = [c.strip() for c in args.cases.split(",") if c.strip()] or list(table)
    rows, failed = [], False
    for sampling, cfg in SAMPLINGS.items():
        joint = support_joint(hf, prompt, cfg, args.steps)
        if len(joint) < 2:
            print(f"sampling {sampling}: the target's support is one sequence on this prompt: nothing to test",
                  file=sys.stderr)
            continue
        for case in chosen:
            name, options = table[case]
            row = {"case": case, "sampling": sampling} | run_case(model, name, options, prompt, cfg, joint, args)
            failed |= row["pvalue"] < P_THRESHOLD
            rows.append(row)
            print(json.dumps(row), flush=True)
    head = ["| case | sampling | p-value | samples | cells | drafted | accepted | seconds |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    lines = head + [f"| `{r['case']}` | {r['sampling']} | {r['pvalue']:.3f} | {r['samples']} | {r['cells']} | "
                    f"{r['drafted']} | {r['accepted']} | {r['seconds']} |" for r in rows]
    print("\n".join(lines))
    if args.out:
        write_result(args.out, {"args": vars(args) | {"out": str(args.out)}, "prompt": PROMPT, "rows": rows})
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p)
    p.add_argument("--samples", type=int, default=600, help="sampled rows per case and sampling setting")
    p.add_argument("--batch-size", type=int, default=100, help="rows decoded together")
    p.add_argument("--steps", type=int, default=3, help="first generated tokens whose joint is tested")
    p.add_argument("--new-tokens", type=int, default=4, help="tokens generated per row (more drafts longer chains)")
    p.add_argument("--cases", default="", help="comma-separated cases (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="results JSON file")
    return parse_and_run(p, argv, "real_sampling", run)


if __name__ == "__main__":
    sys.exit(main())
