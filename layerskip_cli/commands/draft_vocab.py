"""``layerskip draft-vocab``: choose the N token ids a reduced-vocabulary draft head scores.

Counts token frequencies on calibration data from the front of each set (--mode generate: the model's own greedy
generations, generated tokens only, with the texts' counts breaking ties; --mode text: the texts' tokens), keeps
the special tokens plus the most frequent ids (--size in all) and writes them to --out, tied to the model. Coverage
(the share of held-out target tokens inside the subset) is measured on the model's greedy generations for the last
--heldout prompts of each set, which calibration leaves alone, and of each --heldout-data set, which it never reads
(a .jsonl of texts, as ``train.self_distill`` writes, is counted whole and holds nothing out).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from layerskip_cli.args import add_model_flags, model_settings
from layerskip_core.cli import check_distinct, check_output_file
from layerskip_core.device import dtype_name
from layerskip_core.draft_vocab import coverage_report, special_ids
from layerskip_core.errors import UserError
from layerskip_core.prompts import PromptItem, load_prompts, read_jsonl
from train.config import SourceConfig

STDLIB = "stdlib"
"""--data name of the Python standard library's source (path-hash order, as the CPU training recipe reads it)."""
TEXT_CHARS = 2000
"""Characters kept of each standard-library file (as ``layerskip_core.prompts`` keeps of each file of a text folder)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("draft-vocab", help="choose the token ids of a reduced-vocabulary draft head (lossless: "
                       "verification keeps the full head)",
                       description=__doc__.split("\n\n", 1)[1])
    add_model_flags(p)
    p.add_argument("--data", required=True,
                   help="comma-separated calibration sets: humaneval, gsm8k, stdlib (the Python standard library's "
                   "source, as the CPU training recipe reads it), .jsonl files with 'prompt' fields, .jsonl files of "
                   "texts ('text' fields, as train.self_distill writes the model's own answers; --mode text), or "
                   "folders of text files")
    p.add_argument("--size", type=int, required=True, help="token ids to keep (special tokens included), e.g. 8192")
    p.add_argument("--mode", default="generate", choices=["generate", "text"],
                   help="count the model's own greedy generations (default) or the calibration texts")
    p.add_argument("--n", type=int, default=32, help="calibration items per set, from its front (default 32)")
    p.add_argument("--text-n", type=int, default=None,
                   help="--mode generate: items per set whose text is counted to break ties (default --n)")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="tokens generated per prompt, for counting and for held-out coverage (default 128)")
    p.add_argument("--heldout", type=int, default=8,
                   help="prompts per set, from its end, whose generations measure coverage (default 8; 0 = none)")
    p.add_argument("--heldout-data", default="",
                   help="comma-separated prompt sets never counted: their last --heldout prompts only measure "
                        "coverage (kinds of text the calibration leaves out)")
    p.add_argument("--report-sizes", default="",
                   help="also report the held-out coverage of these sizes, e.g. 1024,4096,16384")
    p.add_argument("--chat", default="auto", choices=["auto", "always", "never"],
                   help="chat template: auto = for gsm8k only (as `layerskip bench` does)")
    p.add_argument("--out", type=Path, required=True, help="vocabulary file to write (.json)")
    p.add_argument("--counts-out", type=Path, default=None,
                   help="also write the token counts (.json; the format of the bundled counts)")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out or --counts-out")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def parse_sizes(text: str) -> list[int]:
    """'1024,4096' -> [1024, 4096] (blank = none)."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--report-sizes {text!r}: give comma-separated sizes, e.g. 1024,4096") from None
    if any(s < 1 for s in sizes):
        raise UserError(f"--report-sizes {text!r}: sizes must be >= 1")
    return sizes


def stdlib_items() -> list[PromptItem]:
    """The standard library's source files in the training data's order (its back is the training hold-out)."""
    from train.data import read_source  # lazy: torch and numpy, only when the stdlib is asked for

    docs = read_source(SourceConfig(type=STDLIB), "pretrain")
    return [PromptItem(d.id, d.text[:TEXT_CHARS], "", STDLIB) for d in docs]


def split_set(name: str, items: list[PromptItem], n: int, text_n: int,
              heldout: int) -> tuple[list[PromptItem], list[PromptItem], list[PromptItem]]:
    """(calibration prompts, calibration texts, held-out prompts): the front for calibration, the end held out."""
    front = items[:len(items) - heldout]
    if not front:
        raise UserError(f"{name} has {len(items)} items, all taken by --heldout {heldout}; lower --heldout")
    if max(n, text_n) > len(front):
        print(f"layerskip: note: {name} has {len(front)} items before its {heldout} held-out ones; "
              f"calibrating on those", file=sys.stderr)
    return front[:n], front[:text_n], items[len(items) - heldout:]


def text_items(name: str, mode: str) -> list[PromptItem] | None:
    """The texts of a .jsonl file whose first object has a 'text' field and no 'prompt' (training data, such as
    ``train.self_distill``'s output), or None for any other source. Texts are counted, never prompted: ``mode``
    must be text."""
    path = Path(name).expanduser()
    if path.suffix != ".jsonl" or not path.is_file():
        return None
    rows = read_jsonl(path, "texts file")
    if not rows or "text" not in rows[0][1] or "prompt" in rows[0][1]:
        return None
    if mode != "text":
        raise UserError(f"{name} holds texts ('text' fields), not prompts: count them with --mode text")
    items = []
    for lineno, row in rows:
        text = row.get("text")
        if not isinstance(text, str) or not text.strip():
            raise UserError(f"{path}:{lineno}: expected a non-empty string 'text' field, as on the file's first line")
        items.append(PromptItem(str(row.get("id", lineno)), text, "", path.stem))
    return items


def load_sets(names: list[str], n: int, text_n: int, heldout: int, mode: str = "generate",
              heldout_names: tuple[str, ...] = ()):
    """Calibration prompts, calibration texts and held-out prompts over all the sets, in order; ``heldout_names``
    give held-out prompts only (their last ``heldout``)."""
    calib, texts, held = [], [], []
    for name in heldout_names:
        if heldout < 1:
            raise UserError("--heldout-data measures coverage on each set's last --heldout prompts: give --heldout 1 "
                            "or more")
        held += load_prompts(name)[-heldout:]
    for name in names:
        texts_only = text_items(name, mode)
        if texts_only:  # texts are counted whole and are never prompts
            calib, texts = calib + texts_only, texts + texts_only
            continue
        items = stdlib_items() if name == STDLIB else load_prompts(name)
        c, t, h = split_set(name, items, n, text_n, heldout)
        calib, texts, held = calib + c, texts + t, held + h
    return calib, texts, held


def coverage_line(size: int, vocab_size: int, report: dict) -> str:
    parts = ", ".join(f"{task} {r['coverage']:.3f} ({r['tokens']} tokens)" for task, r in report.items())
    return f"  N={size} ({size / vocab_size:.1%} of the LM head): {parts}"


def run(args: argparse.Namespace) -> int:
    # torch and transformers load only once the arguments are known to be good
    from infer.loading import load_resolved  # lazy: transformers, when the command runs
    from infer.measure.vocab_counting import count_tokens, encode_prompts, heldout_tokens  # lazy: torch, at run

    # Everything that can be checked without the model is checked first.
    names = [d.strip() for d in args.data.split(",") if d.strip()]
    if not names:
        raise UserError("--data is empty: give one or more sets, e.g. humaneval,gsm8k")
    heldout_names = tuple(d.strip() for d in args.heldout_data.split(",") if d.strip())
    if args.n < 1 or args.max_new_tokens < 1 or args.heldout < 0 or args.size < 1:
        raise UserError("--size, --n and --max-new-tokens must be >= 1, --heldout >= 0")
    if args.text_n is not None and (args.mode == "text" or args.text_n < 1):
        raise UserError("--text-n applies to --mode generate only and must be >= 1")
    sizes = parse_sizes(args.report_sizes)
    for flag, path in (("--out", args.out), ("--counts-out", args.counts_out)):
        if path is not None:
            if path.suffix != ".json":
                raise UserError(f"{flag} {path} should be a .json file")
            check_output_file(path, flag, force=args.force, inputs=tuple(("--data", d) for d in args.data.split(",")))
    check_distinct(("--out", args.out), ("--counts-out", args.counts_out))
    text_n = args.n if args.text_n is None else args.text_n
    calib, texts, held = load_sets(names, args.n, text_n, args.heldout, args.mode, heldout_names)
    resolved = model_settings(args).resolve()

    model = load_resolved(resolved)
    vocab_size, special = model.runner.spec.vocab_size, special_ids(model.tokenizer, model.eos_token_ids)
    for s in [args.size, *sizes]:
        if not len(special) < s <= vocab_size:
            raise UserError(f"size {s} is out of range: {args.model or 'the default model'} has {vocab_size} "
                            f"token ids, {len(special)} of them special tokens that every subset keeps; "
                            f"give {len(special) + 1}..{vocab_size}")
    if args.mode == "generate" or held:
        encode_prompts(model, (calib if args.mode == "generate" else []) + held, args.max_new_tokens, args.chat)
    source = {"data": names, "calibration": "front", "dtype": dtype_name(model.runner.dtype)}
    counts = count_tokens(model, calib, args.mode, max_new_tokens=args.max_new_tokens, chat=args.chat,
                          text_items=texts, progress=not args.quiet, source=source)
    vocab = counts.top(args.size)
    what = "generated" if args.mode == "generate" else "text"
    print(f"draft vocabulary: {vocab.size} of {vocab_size} ids ({vocab.head_share:.1%} of the LM head), from "
          f"{counts.tokens} {what} tokens of {len(calib)} calibration items ({', '.join(names)}); counting took "
          f"{counts.source['wall_time_s']}s", file=sys.stderr)
    if held:
        tokens = heldout_tokens(model, held, args.max_new_tokens, args.chat, progress=not args.quiet)
        vocab = replace(vocab, source=vocab.source | {"heldout": len(held)}, coverage=coverage_report(vocab, tokens))
        print(f"held-out coverage (the model's greedy generations on the last {args.heldout} prompts of each set"
              f"{' and of ' + ', '.join(heldout_names) if heldout_names else ''}):", file=sys.stderr)
        for size in sorted({args.size, *sizes}):
            report = vocab.coverage if size == args.size else coverage_report(counts.top(size), tokens)
            print(coverage_line(size, vocab_size, report), file=sys.stderr)
    if args.counts_out is not None:
        counts.save(args.counts_out)
    vocab.save(args.out)
    print(args.out)
    return 0
