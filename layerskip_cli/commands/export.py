"""``layerskip export CHECKPOINT --out DIR``: a plain Hugging Face folder from any training checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from layerskip_core.cli import check_output_dir


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a training checkpoint's model as a plain Hugging Face folder",
                       description="Export the model of a training checkpoint (checkpoints/step-N, or a run folder: "
                       "its newest checkpoint) as config + safetensors + tokenizer, LoRA merged, loadable by "
                       "transformers and `layerskip generate --model`.")
    p.add_argument("checkpoint", type=Path, help="a checkpoints/step-N folder, or a run folder (its newest checkpoint)")
    p.add_argument("--out", type=Path, required=True, help="the new model folder (must not exist)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from train.checkpoint_export import describe, export_checkpoint, find_checkpoint  # lazy: when it runs

    check_output_dir(args.out, "--out", writes=(), inputs=(("CHECKPOINT", args.checkpoint),))
    ckpt = find_checkpoint(args.checkpoint)
    out = export_checkpoint(ckpt, args.out)
    print(f"layerskip: exported {describe(ckpt)}; generate with: layerskip generate --model {out}", file=sys.stderr)
    print(out)
    return 0
