"""Print the fastest fixed early-exit setting of a tuning bench (``layerskip bench --skip N``): the ``early_exit``
method with the highest geometric mean over tasks of its speed-up against plain decoding, for each model alike.

    python scripts/best_fixed.py runs/compare/tune_fixed/results.json     # -> early_exit:E=24:k=8:confidence=0.7

The held-out bench then times that setting on prompts it was not chosen on (tools/results/compare_trained_vs_free.sh).

``--write-adapter FILE`` tunes an exit adapter: the fastest of the bench's ``early_exit`` methods with an adapter
becomes the setting in FILE's header (``layerskip_core.adapter_spec.TunedDecoding``: its options, its speed-up,
what it was measured on and where), which early exit with that adapter and ``--drafter best`` then use for every
option not given. The shipped adapter's setting is updated so, in one command:

    python scripts/best_fixed.py runs/demo/results.json \\
        --write-adapter infer/data/adapters/smollm2-135m-instruct-e4.safetensors
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from layerskip_core.cli import Parser, parse_and_run
from layerskip_core.errors import UserError
from layerskip_core.inputs import read_text


def best_fixed(summary: list[dict], adapter: bool = False) -> tuple[str, float]:
    """The early_exit method (with an exit adapter, when ``adapter``) with the best geometric-mean speed-up over
    every (model, task) it ran on, and that mean."""
    ratios: dict[str, list[float]] = {}
    for row in summary:
        if row["method"].startswith("early_exit") and row.get("speedup_vs_autoregressive") \
                and (not adapter or ":adapter=" in row["method"]):
            ratios.setdefault(row["method"], []).append(row["speedup_vs_autoregressive"])
    if not ratios:
        raise UserError(f"the bench has no early_exit rows{' with an adapter' if adapter else ''} with a speed-up: "
                        "run the tuning grid first")
    means = {m: math.exp(sum(map(math.log, r)) / len(r)) for m, r in ratios.items()}
    best = max(means, key=means.get)
    return best, means[best]


def tuned_decoding(method: str, mean: float, payload: dict, results: Path):
    """The ``TunedDecoding`` of a bench's ``method``: the decoding options it names, its ``mean`` speed-up, what the
    bench timed and where its results lie."""
    from infer.drafters.early_exit import EarlyExitDrafter  # lazy: torch, only when an adapter is written
    from infer.drafters.spec import parse_spec, split_spec
    from layerskip_core.adapter_spec import DECODING_KEYS, TunedDecoding

    named = {EarlyExitDrafter.aliases.get(k, k) for k in split_spec(method)[1]}
    config = parse_spec(method).config
    cfg, meta = payload.get("config", {}), payload.get("meta", {})
    measured = (f"{', '.join(cfg.get('data', []))}: {cfg.get('n')} prompts each, {cfg.get('max_new_tokens')} tokens, "
                f"{meta.get('dtype', '?')}, {(cfg.get('run') or {}).get('threads', '?')} thread(s)"
                f"{', a tuning span (--skip)' if cfg.get('skip') else ''}")
    return TunedDecoding({k: getattr(config, k) for k in DECODING_KEYS if k in named}, speedup=round(mean, 3),
                         measured=measured, source=f"{results} ({meta.get('command', 'layerskip bench')})")


def run(results: Path, adapter: Path | None = None) -> int:
    try:
        payload = json.loads(read_text(results, "bench results"))
    except json.JSONDecodeError as e:
        raise UserError(f"{results} is not a bench's results.json ({e}); run the tuning bench again") from None
    if payload.get("config", {}).get("skip", 0) == 0:
        print(f"note: {results} timed the held-out end (no --skip): a setting chosen there is not held out",
              file=sys.stderr)
    method, mean = best_fixed(payload["summary"], adapter=adapter is not None)
    print(f"best fixed setting: {method} ({mean:.3f}x plain decoding, geometric mean over tasks)", file=sys.stderr)
    print(method)
    if adapter is not None:
        from layerskip_core.adapter_spec import write_decoding  # lazy: safetensors

        decoding = tuned_decoding(method, mean, payload, results)
        write_decoding(adapter, decoding)
        print(f"wrote the tuned setting {decoding.spec_text()} ({mean:.3f}x) into {adapter}'s header", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__)
    p.add_argument("results", type=Path, help="results.json of the tuning bench")
    p.add_argument("--write-adapter", type=Path, default=None, metavar="FILE",
                   help="record the fastest setting with an adapter in this adapter file's header (its tuned setting)")
    return parse_and_run(p, argv, "best_fixed", lambda args: run(args.results, args.write_adapter))


if __name__ == "__main__":
    sys.exit(main())
