"""``layerskip eval-exits``: per-exit loss/perplexity and top-1 agreement with the final layer on held-out text.

For every exit E (layers [0, E) -> final norm -> LM head) and every labelled position:
- ``loss`` / ``perplexity``: cross-entropy of the exit's prediction against the true next token;
- ``agreement``: how often the exit's argmax equals the final layer's. For greedy self-speculative
  decoding this is the per-token acceptance probability of an exit-E draft, so it says directly
  which exits can pay off as drafters (``--drafter early_exit --exit-layer E``);
- ``accuracy``: how often the exit's argmax equals the true next token.

The held-out text is either a prompt source (``--data``: the back of a built-in set, each prompt
with its reference, a .jsonl file or a folder of text files) or a training recipe's validation
split (``--config``), so a base model and a trained checkpoint are compared on the same text.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from infer.measure.plots import exit_quality
from layerskip_cli.args import add_model_flags, model_settings
from layerskip_core import jsonfile
from layerskip_core.cli import Parser, check_output_dir, check_output_file, run_main
from layerskip_core.device import dtype_name
from layerskip_core.errors import UserError
from layerskip_core.heldout import perplexity
from layerskip_core.prompts import load_prompts
from train.config import EarlyExitConfig, LayerDropoutConfig
from train.recipe import load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval-exits", help="per-exit loss/perplexity and agreement with the final layer",
                       description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_flags(p, skip=("executor",))  # the exits are evaluated with transformers' layers, not the runner
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="held-out text: humaneval, gsm8k (prompt + reference, from the end of the set), "
                     "a .jsonl file with 'prompt' (and optional 'reference') fields, or a folder of text files")
    src.add_argument("--config", help="a training recipe: evaluate on its validation split")
    p.add_argument("--exits", default=None, help="comma-separated exits (layer counts); default every 4th layer "
                   "and the last")
    p.add_argument("--n", "--max-examples", dest="n", type=int, default=32,
                   help="held-out examples to evaluate (default 32)")
    p.add_argument("--max-tokens", type=int, default=512, help="--data: cut each text to this many tokens")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="folder for exits.json and exits.png")
    p.add_argument("--json", type=Path, default=None, help="also write the metrics to this JSON file")
    p.add_argument("--force", action="store_true", help="overwrite an existing --json file or --out results")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="--config: overrides of the recipe")


def parse_exits(text: str | None, num_layers: int) -> list[int]:
    """``'8,16'`` -> [8, 16]; None -> every 4th layer (every layer below 8 layers) and the last."""
    if not text:
        step = 4 if num_layers >= 8 else 1
        return sorted(set(range(step, num_layers, step)) | {num_layers})
    try:
        exits = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"--exits {text!r}: expected comma-separated integers (layer counts), e.g. 8,16,24") from None
    bad = [e for e in exits if not 1 <= e <= num_layers]
    if bad or not exits:
        raise UserError(f"--exits {text!r}: each exit must lie in 1..{num_layers} (the model's layers)")
    return exits


def _check_args(args: argparse.Namespace) -> None:
    if args.n < 1 or args.batch_size < 1 or args.max_tokens < 2:
        raise UserError("--n and --batch-size must be >= 1, --max-tokens >= 2")
    if args.overrides and not args.config:
        raise UserError(f"recipe overrides {args.overrides} need --config")
    reads = (("--config", args.config), ("--data", args.data))
    if args.out is not None:
        check_output_dir(args.out, "--out", writes=("exits.json", "exits.png"), force=args.force, inputs=reads)
    if args.json is not None:
        check_output_file(args.json, "--json", force=args.force, inputs=reads)


def held_out_examples(source: str, tokenizer, n: int, max_tokens: int):
    """Examples (loss on every token) from the back of a prompt source: prompt + reference, cut to max_tokens."""
    from train.data import Examples  # torch-heavy (as every train.* and transformers import here)

    seqs = []
    for item in load_prompts(source, n, from_end=True):
        ids = [int(t) for t in tokenizer(item.prompt + item.reference)["input_ids"]][:max_tokens]
        if len(ids) >= 2:
            seqs.append(ids)
    if not seqs:
        raise UserError(f"{source} gives no text of at least 2 tokens")
    return Examples.from_lists(seqs, seqs)


def _recipe_examples(args: argparse.Namespace, tokenizer, path: Path):
    from train.data import build_dataset  # lazy: torch, when the command runs

    cfg = load_config(args.config, args.overrides)
    val = build_dataset(cfg.data, tokenizer, path).val
    if len(val) == 0:
        raise UserError(f"{args.config}: the recipe's data has no validation examples (data.val_fraction is 0?)")
    return val.take(args.n)


def evaluate(args: argparse.Namespace) -> dict:
    """Load the model on the chosen device, evaluate every exit, return the JSON-ready result."""
    import torch
    from transformers import AutoConfig, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from train.exit_eval import exit_metrics  # lazy: torch, when the command runs
    from train.model import LayerSkipLM, load_model  # lazy: torch, when the command runs

    # Everything that can be checked without the weights is checked first.
    _check_args(args)
    resolved = model_settings(args).resolve()
    resolved.apply_threads()
    device, dtype, path = resolved.device, resolved.dtype, resolved.model
    exits = parse_exits(args.exits, AutoConfig.from_pretrained(path).num_hidden_layers)
    tokenizer = AutoTokenizer.from_pretrained(path)
    examples = (held_out_examples(args.data, tokenizer, args.n, args.max_tokens) if args.data
                else _recipe_examples(args, tokenizer, path))
    hf_logging.disable_progress_bar()
    model, tokenizer, path = load_model(str(path), dtype)
    lm = LayerSkipLM(model.to(device), LayerDropoutConfig(), EarlyExitConfig(), max_steps=1).eval()
    with torch.inference_mode():
        metrics = exit_metrics(lm, examples, exits, args.batch_size, tokenizer.pad_token_id, device=device)
    metrics["perplexity"] = {e: perplexity(loss) for e, loss in metrics["loss"].items()}
    return {"model": str(path), "data": args.data, "config": args.config, "examples": len(examples),
            "num_layers": lm.num_layers, "device": str(device), "dtype": dtype_name(dtype), **metrics}


def format_table(result: dict) -> str:
    """One Markdown row per exit."""
    lines = [f"{result['model']} on {result['examples']} held-out examples "
             f"({result['tokens'][result['num_layers']]} tokens), {result['device']} {result['dtype']}",
             "| exit | loss | perplexity | top-1 agreement with final | top-1 accuracy |", "|---:|---:|---:|---:|---:|"]
    for e in result["loss"]:
        lines.append(f"| {e} | {result['loss'][e]:.3f} | {result['perplexity'][e]:.1f} | "
                     f"{result['agreement'][e]:.3f} | {result['accuracy'][e]:.3f} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    result = evaluate(args)
    print(format_table(result))
    text = json.dumps(result, indent=2) + "\n"
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        jsonfile.write(args.json, text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        jsonfile.write((args.out / "exits.json"), text)
        exit_quality({Path(result["model"]).name: result}, args.out / "exits.png")
        print(f"wrote {args.out}/exits.json and exits.png", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python scripts/eval_exits.py ...``: the same command outside the ``layerskip`` entry point."""
    parser = Parser(prog="eval_exits", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_main("eval_exits", lambda: run(args))
