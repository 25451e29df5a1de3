"""Top-1 agreement with the full model of an exit adapter and of the plain early exit at its E, on held-out text.

    python scripts/eval_adapter.py --adapter runs/cpu-adapter/adapter.safetensors \
        --config recipes/cpu-demo-stdlib.yaml --n 32 --threads 1 --json runs/adapter_eval.json

The text is a training recipe's validation split (the CPU demo recipe's: the same 32 held-out stdlib blocks
that `layerskip eval-exits --config recipes/cpu-demo-stdlib.yaml` scores, so the numbers sit beside a
LayerSkip checkpoint's). Agreement is the per-token acceptance of greedy drafts; the adapter's loss is its
cross-entropy against the data. The base model is the adapter's own (checked against the file's header).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from layerskip_core import jsonfile
from layerskip_core.cli import Parser, check_output_file, run_main
from layerskip_core.errors import UserError
from layerskip_core.settings import check_threads
from train.recipe import load_config


def run(args: argparse.Namespace) -> int:
    import torch

    from train.adapter import adapter_eval  # lazy: torch, after the flags are checked
    from train.data import build_dataset  # lazy: torch, after the flags are checked
    from train.model import load_model  # lazy: torch, after the flags are checked

    if args.json is not None:
        check_output_file(args.json, "--json", force=args.force,
                          inputs=(("--adapter", args.adapter), ("--config", args.config)))
    if args.n < 1:
        raise UserError("--n must be >= 1")
    check_threads(args.threads)
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, [])
    model, tokenizer, path = load_model(cfg.model.name_or_path)
    val = build_dataset(cfg.data, tokenizer, path).val.take(args.n)
    out = adapter_eval(model, args.adapter, val, tokenizer.pad_token_id)
    text = json.dumps(out, indent=1, allow_nan=False)  # strict JSON: a NaN never reaches the file
    print(text)
    if args.json is not None:
        jsonfile.write(args.json, text + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapter", type=Path, required=True, help="an adapter file (train/layerskip.py adapter: runs)")
    p.add_argument("--config", required=True, help="the recipe whose validation split is the held-out text")
    p.add_argument("--n", type=int, default=32, help="validation examples (default 32)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    p.add_argument("--force", action="store_true", help="overwrite an existing --json")
    args = p.parse_args(argv)
    return run_main("eval_adapter", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
