"""``layerskip train ...``: LayerSkip training, the same code as ``train/layerskip.py`` (its options follow)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="LayerSkip training from a recipe (same as python train/layerskip.py)",
                       description="Continual pretraining / finetuning with layer dropout and early-exit loss. "
                       "Every argument is passed to train/layerskip.py (see `layerskip train --help`); "
                       "use `accelerate launch train/layerskip.py ...` for several GPUs.", add_help=False)
    p.add_argument("argv", nargs=argparse.REMAINDER, help="train/layerskip.py arguments")


def main(argv: list[str]) -> int:
    """``layerskip train ARGS`` = ``python train/layerskip.py ARGS``."""
    # Lazy: the training stack (peft, accelerate, datasets readers) is needed only by this command.
    from train.layerskip import main as train_main  # lazy: keeps `layerskip --help` light

    return train_main(argv, prog="layerskip train")
