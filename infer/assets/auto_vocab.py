"""A reduced draft vocabulary for a model that ships none, built once from its own generations.

The drafters' ``draft_vocab=auto`` scores only the ``AUTO_SIZE`` most frequent token ids of counts that fit the model
(``layerskip_core.draft_vocab``). Counts ship for the default model; for any other model with a large vocabulary
(``AUTO_MIN_VOCAB`` ids or more: Gemma 3's 262144-token head is 63% of a step's bytes) they are built here the first
time a drafter asks: the model's own greedy continuations (plain decoding, the runner's exact forward) of a small
built-in prompt set of several kinds (code, arithmetic, prose, questions, lists, JSON, chat turns, two other
languages) are counted, as VocabTrim counts the target's own output; ties, and the ids never generated, are ranked by
their count in the Python standard library's source text (local, no download: comments, docstrings, code), then by
id. The last ``HELD_OUT`` prompts are never counted: their continuations measure the subset's coverage, printed and
recorded in the file. The counts are kept in the toolkit cache, tied to the model (architecture, weight fingerprint,
tokenizer), so the next command reads them (and ``--draft-vocab N`` takes its top N from them).
"""

from __future__ import annotations

import sys
import sysconfig
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from infer.model.runner import Runner
from layerskip_core.draft_vocab import (
    AUTO_MIN_VOCAB,
    AUTO_SIZE,
    TokenCounts,
    auto_counts_path,
    bundled_counts,
    coverage_report,
    model_record,
    special_ids,
)
from layerskip_core.errors import UserError
from layerskip_core.locks import FileLock

PROMPTS = (
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "import json\n\n\ndef load_config(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "// JavaScript: debounce a function\nfunction debounce(fn, ms) {\n",
    "SELECT name, COUNT(*) AS orders\nFROM customers\n",
    "#!/bin/bash\n# back up every .txt file in the current folder\n",
    "Question: A shop sells pencils at 3 for $1. How much do 18 pencils cost?\nAnswer:",
    "Question: Tom is 4 years older than Anna. In 6 years their ages will add up to 40. How old is Anna now?\nAnswer:",
    "Once upon a time, in a small village at the edge of a forest,",
    "The main causes of the French Revolution were",
    "Photosynthesis is the process by which",
    "Dear Ms. Patel,\n\nThank you for your letter of 3 March. I am writing to",
    "Here is a list of ten tips for staying productive while working from home:\n1.",
    '{"name": "Ada Lovelace", "born": 1815, "fields": [',
    "User: What is the difference between a list and a tuple in Python?\nAssistant:",
    "La ciudad de Barcelona es conocida por",
    # held out (``HELD_OUT``): their continuations measure coverage, never counted
    "def binary_search(items, target):\n",
    "Question: A train travels 60 miles in 1.5 hours. What is its average speed?\nAnswer:",
    "The history of the printing press begins",
    "User: Can you explain what a neural network is?\nAssistant:",
)
HELD_OUT = 4
"""The last prompts of ``PROMPTS``, whose continuations only measure coverage."""
NEW_TOKENS = 48
"""Tokens generated per prompt."""
BACKOFF_CHARS = 1_000_000
"""Characters of the standard library's source counted for the back-off ranking."""
LOCK_WAIT = 1800.0
"""Seconds a process waits for another building the same model's counts."""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@torch.no_grad()
def greedy(runner: Runner, ids: list[int], new_tokens: int, eos: set[int]) -> list[int]:
    """Plain greedy decoding of ``ids`` with the runner's full forward (what the engine's plain decoding emits)."""
    cache = runner.new_cache(len(ids) + new_tokens + 1)
    logits = runner.forward(cache, torch.tensor(ids, device=runner.device))[-1]  # (V,)
    out: list[int] = []
    while len(out) < new_tokens:
        token = int(logits.argmax())
        out.append(token)
        if token in eos:
            break
        logits = runner.forward(cache, torch.tensor([token], device=runner.device))[-1]  # (V,)
    return out


def stdlib_text(limit: int = BACKOFF_CHARS) -> str:
    """The first ``limit`` characters of the Python standard library's source (sorted paths; tests left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if any(part.startswith("test") for part in path.relative_to(root).parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text[:20_000])
        size += len(parts[-1])
        if size >= limit:
            break
    return "\n".join(parts)[:limit]


def _eos_ids(runner: Runner, tokenizer) -> set[int]:
    eos = getattr(runner.config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, list | tuple) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def build_counts(runner: Runner, tokenizer, log: Callable[[str], None] = _stderr) -> TokenCounts:
    """Count the model's own greedy continuations of ``PROMPTS`` (the held-out ones measure coverage)."""
    t0 = time.perf_counter()
    eos = _eos_ids(runner, tokenizer)
    outputs = [greedy(runner, [int(t) for t in tokenizer(p)["input_ids"]], NEW_TOKENS, eos) for p in PROMPTS]
    counted, held = outputs[:-HELD_OUT], outputs[-HELD_OUT:]
    backoff = Counter(int(t) for t in tokenizer(stdlib_text(), add_special_tokens=False)["input_ids"])
    record = model_record(runner.identity(), tokenizer)
    source = {"mode": "generate", "data": "infer.assets.auto_vocab.PROMPTS", "items": len(counted),
              "max_new_tokens": NEW_TOKENS, "generated_tokens": sum(map(len, counted)),
              "backoff": f"Python standard library source, first {BACKOFF_CHARS} characters",
              "dtype": str(runner.dtype).removeprefix("torch."), "wall_time_s": 0.0}
    counts = TokenCounts(dict(Counter(t for out in counted for t in out)), dict(backoff),
                         special_ids(tokenizer, eos), record, source)
    report = coverage_report(counts.top(min(AUTO_SIZE, runner.spec.vocab_size)), {"held-out": [t for o in held
                                                                                               for t in o]})
    counts.source |= {"coverage": {"size": AUTO_SIZE, "prompts": HELD_OUT, **report["held-out"]},
                      "wall_time_s": round(time.perf_counter() - t0, 1)}
    return counts


def auto_counts(runner: Runner, tokenizer, log: Callable[[str], None] = _stderr) -> TokenCounts | None:
    """The counts ``draft_vocab=auto`` uses: shipped ones that fit the model, else ones kept in the toolkit cache,
    else built now and kept (said in two lines: what is built, then its coverage and where it is kept); None for a
    model whose vocabulary is under ``AUTO_MIN_VOCAB`` (the full head) or without a tokenizer to write the prompts
    with."""
    if tokenizer is None or runner.spec.vocab_size < AUTO_MIN_VOCAB:
        return None
    try:
        return bundled_counts(runner, tokenizer)  # shipped for it, or built by an earlier command
    except UserError:
        pass
    path = auto_counts_path(model_record(runner.identity(), tokenizer))
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path.with_name(path.name + ".lock"))
    if lock.wait(LOCK_WAIT, "building a draft vocabulary for this model") is not None:
        return None  # another process has been building it for too long: the full head this time
    try:
        if path.is_file():
            return TokenCounts.load(path)
        log(f"layerskip: no draft vocabulary ships for this model (a {runner.spec.vocab_size}-token head); building "
            f"one once from its own greedy continuations of {len(PROMPTS) - HELD_OUT} built-in prompts "
            f"({NEW_TOKENS} tokens each; about {len(PROMPTS) * NEW_TOKENS} plain steps) ...")
        counts = build_counts(runner, tokenizer, log)
        counts.save(path)
    finally:
        lock.release()
    cov = counts.source["coverage"]
    log(f"layerskip: draft vocabulary built in {counts.source['wall_time_s']} s: the top {AUTO_SIZE} of "
        f"{runner.spec.vocab_size} ids ({AUTO_SIZE / runner.spec.vocab_size:.1%} of the LM head) cover "
        f"{cov['coverage']:.1%} of the model's tokens on {cov['prompts']} held-out prompts ({cov['tokens']} tokens); "
        f"kept in {path}")
    return counts
