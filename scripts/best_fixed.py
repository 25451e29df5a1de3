"""Print the fastest fixed early-exit setting of a tuning bench (``layerskip bench --skip N``): the ``early_exit``
method with the highest geometric mean over tasks of its speed-up against plain decoding, for each model alike.

    python scripts/best_fixed.py runs/compare/tune_fixed/results.json     # -> early_exit:E=24:k=8:confidence=0.7

The held-out bench then times that setting on prompts it was not chosen on (scripts/compare_trained_vs_free.sh).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from layerskip_core.cli import Parser, parse_and_run
from layerskip_core.errors import UserError
from layerskip_core.inputs import read_text


def best_fixed(summary: list[dict]) -> tuple[str, float]:
    """The early_exit method with the best geometric-mean speed-up over every (model, task) it ran on, and that
    mean."""
    ratios: dict[str, list[float]] = {}
    for row in summary:
        if row["method"].startswith("early_exit") and row.get("speedup_vs_autoregressive"):
            ratios.setdefault(row["method"], []).append(row["speedup_vs_autoregressive"])
    if not ratios:
        raise UserError("the bench has no early_exit rows with a speed-up: run the tuning grid first")
    means = {m: math.exp(sum(map(math.log, r)) / len(r)) for m, r in ratios.items()}
    best = max(means, key=means.get)
    return best, means[best]


def run(results: Path) -> int:
    try:
        payload = json.loads(read_text(results, "bench results"))
    except json.JSONDecodeError as e:
        raise UserError(f"{results} is not a bench's results.json ({e}); run the tuning bench again") from None
    if payload.get("config", {}).get("skip", 0) == 0:
        print(f"note: {results} timed the held-out end (no --skip): a setting chosen there is not held out",
              file=sys.stderr)
    method, mean = best_fixed(payload["summary"])
    print(f"best fixed setting: {method} ({mean:.3f}x plain decoding, geometric mean over tasks)", file=sys.stderr)
    print(method)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__)
    p.add_argument("results", type=Path, help="results.json of the tuning bench")
    return parse_and_run(p, argv, "best_fixed", lambda args: run(args.results))


if __name__ == "__main__":
    sys.exit(main())
