"""Per-exit validation loss and top-1 agreement with the final layer, on a recipe's held-out text.

Run it on the base model and on a trained checkpoint with the same recipe (same held-out split):

    python scripts/eval_exits.py --model default --config recipes/cpu-demo-stdlib.yaml --threads 2
    python scripts/eval_exits.py --model runs/cpu-demo/final --config recipes/cpu-demo-stdlib.yaml --threads 2

Agreement at exit E is the per-token acceptance rate of a greedy exit-E draft (``layerskip generate
--drafter early_exit --exit-layer E``), so it says directly which exits can pay off as drafters.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import json

from core.errors import UserError


def parse_exits(text: str | None, num_layers: int) -> list[int]:
    if not text:
        step = 4 if num_layers >= 8 else 1
        return sorted(set(range(step, num_layers, step)) | {num_layers})
    try:
        exits = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"--exits {text!r}: give comma-separated layer counts, e.g. 8,16,24") from None
    bad = [e for e in exits if not 1 <= e <= num_layers]
    if bad:
        raise UserError(f"--exits {bad} out of range 1..{num_layers}")
    return exits


def run(args) -> dict:
    import torch

    from train.config import EarlyExitConfig, LayerDropoutConfig, load_config
    from train.data import build_dataset
    from train.exit_eval import exit_metrics, format_table
    from train.model import LayerSkipLM, load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)  # the recipe's data section defines the held-out split
    model, tokenizer, path = load_model(args.model)
    lm = LayerSkipLM(model, LayerDropoutConfig(), EarlyExitConfig(), max_steps=1).eval()
    exits = parse_exits(args.exits, lm.num_layers)
    data = build_dataset(cfg.data, tokenizer, path)
    n = min(len(data.val), args.max_examples)
    if n == 0:
        raise UserError("the recipe's data has no validation examples (data.val_fraction is 0?)")
    metrics = exit_metrics(lm, data.val, exits, args.batch_size, tokenizer.pad_token_id, indices=list(range(n)))
    print(format_table(metrics, f"{path} on {n} held-out examples ({metrics['tokens'][lm.num_layers]} tokens)"))
    result = {"model": str(path), "config": args.config, "examples": n, **metrics}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="HF folder or 'default'")
    parser.add_argument("--config", required=True, help="recipe whose data section gives the held-out text")
    parser.add_argument("--exits", help="comma-separated exits (layer counts); default every 4th layer + the last")
    parser.add_argument("--max-examples", type=int, default=32, help="held-out blocks/examples to evaluate")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", help="also write the metrics to this JSON file")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="overrides of the recipe")
    args = parser.parse_args(argv)
    try:
        run(args)
        return 0
    except UserError as e:
        print(f"eval_exits: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
