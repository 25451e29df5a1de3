"""Write a set of long held-out prompts: source files nobody tuned for, cut to 300-400 tokens each.

    python -m tools.bench.long_prompts --out runs/long_prompts.jsonl            # 8 prompts for the default model
    python -m tools.bench.long_prompts --n 16 --min-tokens 300 --max-tokens 400 --out P.jsonl

The prompts are the last files of the Python standard library in the training data's order (path-hash
order: the CPU demo recipe's 5 % validation hold-out, so a model trained with it has not seen them), each
cut at a line boundary to between --min-tokens and --max-tokens tokens of the model's tokenizer (files too
short are skipped). The JSONL (id, prompt) feeds `layerskip bench --data`, `tools/bench/bench_independent.py
--data` and the other commands that take prompt files.
"""

from __future__ import annotations

import argparse
import sys

from layerskip_core.cli import Parser, add_output_flags, check_output_file, parse_and_run, write_result
from layerskip_core.errors import UserError
from layerskip_core.models import resolve_model
from train.config import SourceConfig


def cut(text: str, tokenizer, low: int, high: int) -> str | None:
    """The longest whole-line prefix of ``text`` with at most ``high`` tokens, if it has at least ``low``."""
    best, prefix = None, ""
    for line in text.splitlines(keepends=True):
        candidate = prefix + line
        if len(tokenizer(candidate)["input_ids"]) > high:
            break
        prefix = candidate
        if len(tokenizer(prefix)["input_ids"]) >= low:
            best = prefix
    return best


def run(args: argparse.Namespace) -> int:
    check_output_file(args.out, "--out", force=args.force)
    if not 1 <= args.min_tokens <= args.max_tokens or args.n < 1:
        raise UserError("give --n >= 1 and 1 <= --min-tokens <= --max-tokens")
    # the training data reader and the tokenizer are torch/transformers-heavy: loaded after the argument checks
    from transformers import AutoTokenizer

    from train.data import read_source  # lazy: torch, after the flags are checked

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    docs = read_source(SourceConfig(type="stdlib"), "pretrain")  # path-hash order: the back is held out
    items = []
    for doc in reversed(docs):
        prompt = cut(doc.text, tokenizer, args.min_tokens, args.max_tokens)
        if prompt is not None and prompt.strip():
            items.append({"id": doc.id, "prompt": prompt, "tokens": len(tokenizer(prompt)["input_ids"])})
        if len(items) == args.n:
            break
    write_result(args.out, items, lines=True)
    print(f"wrote {len(items)} prompts of {min(i['tokens'] for i in items)}-{max(i['tokens'] for i in items)} "
          f"tokens to {args.out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="whose tokenizer counts the tokens (default: the default model)")
    p.add_argument("--n", type=int, default=8, help="prompts to write (default 8)")
    p.add_argument("--min-tokens", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=400)
    add_output_flags(p, "the .jsonl file to write", required=True)
    return parse_and_run(p, argv, "long_prompts", run)


if __name__ == "__main__":
    sys.exit(main())
