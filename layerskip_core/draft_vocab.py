"""Reduced-vocabulary draft heads: which N token ids a drafter's LM head scores, chosen by token frequency.

A draft step that scores only N of the V token ids reads N/V of the LM head (on the default model the
head is 21% of the weights). Verification always uses the full head, so greedy output is unchanged and
sampling stays exact: the draft distribution is zero outside the subset and the residual at a rejection
covers the rest. Following VocabTrim (Goel et al. 2025), the subset is the N most frequent tokens of
calibration data, best counted on the target model's own greedy generations; counts ship for the default model.
For a model with a large vocabulary and no shipped counts (Gemma 3's 262144 tokens: 63% of a step's bytes) the
drafters' ``auto`` builds counts once from the model's own generations on a small built-in prompt set
(``infer.assets.auto_vocab``) and keeps them in the toolkit cache (``auto_counts_path``), where ``auto`` and a size N
find them again.

Which model a file fits: its architecture numbers and vocabulary size, and the tokenizer's fingerprint
(a digest of its id -> token table); the weight fingerprint is checked instead when no tokenizer is at
hand. A LayerSkip-finetuned checkpoint of a model thus keeps using that model's counts.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from layerskip_core import jsonfile
from layerskip_core.errors import UserError
from layerskip_core.packages import cache_root

COUNTS_FORMAT = "layerskip-token-counts/1"
VOCAB_FORMAT = "layerskip-draft-vocab/1"
MODES = ("text", "generate")
"""What is counted: ``text`` = the calibration texts' tokens; ``generate`` = the model's own greedy output."""
ARCH_KEYS = ("model_type", "num_layers", "hidden_size", "vocab_size")
"""Identity keys (``Runner.identity()``) a counts or vocabulary file must match, besides the tokenizer."""
BUNDLED_DIR = Path(__file__).parent / "data" / "draft_vocab"
"""Counts files shipped with the package (package data), one per model; read by ``--draft-vocab N``."""
MAKE_ONE = "make one for this model with `layerskip draft-vocab`"
AUTO = "auto"
"""The drafters' default ``draft_vocab``: the top ``AUTO_SIZE`` ids of the counts shipped for the model when some fit
it, else the full head (measured: docs/LOG.md, "Reduced draft vocabulary: cost and acceptance, base and trained")."""
AUTO_SIZE = 8192
"""Size of the ``auto`` draft vocabulary: draft cost c 0.85 -> 0.70 at exit 24 of 30 on the default model (4096:
c 0.68); with the shipped counts (the model's own answers of nine kinds) it covers 0.91-1.00 of the model's tokens on
those kinds and on held-out stories and Rust, 0.95 / 0.93 on HumanEval / GSM8K (docs/RESULTS.md, "The draft
vocabulary recounted")."""
AUTO_MIN_VOCAB = 4 * AUTO_SIZE
"""A model without shipped counts whose vocabulary has at least this many ids gets its ``auto`` counts built from its
own generations (``infer.assets.auto_vocab``); below it the head is a small share of a step, and ``auto`` is the full
head."""
OFF = ("off", "none", "false")
"""``draft_vocab`` values for the full head ('false': how a YAML-minded option parser reads 'off')."""


# --------------------------------------------------------------------------- model identity
def tokenizer_fingerprint(tokenizer) -> str:
    """A short digest of the tokenizer's id -> token table: two tokenizers agree on every id iff it matches."""
    table = sorted((int(i), str(t)) for t, i in tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(table, ensure_ascii=False).encode()).hexdigest()[:16]


def model_record(identity: dict, tokenizer) -> dict:
    """What a file records about its model: ``Runner.identity()`` plus the tokenizer fingerprint."""
    return dict(identity) | {"tokenizer": tokenizer_fingerprint(tokenizer)}


def identity_of(model) -> dict:
    """``Runner.identity()`` of a runner, or the identity dict itself."""
    return model.identity() if hasattr(model, "identity") else dict(model)


def check_model(recorded: dict, model, tokenizer=None, path: str = "the file") -> None:
    """Refuse a file made for another model: the architecture numbers and the tokenizer must match (the
    weight fingerprint instead of the tokenizer when ``tokenizer`` is None)."""
    mine = identity_of(model)
    keys = list(ARCH_KEYS)
    if tokenizer is not None:
        mine = mine | {"tokenizer": tokenizer_fingerprint(tokenizer)}
        keys.append("tokenizer")
    else:
        keys.append("weight_fingerprint")
    diff = [f"{k}: file has {recorded.get(k)}, model has {mine.get(k)}" for k in keys if recorded.get(k) != mine.get(k)]
    if diff:
        raise UserError(f"{path} was made for another model ({', '.join(diff)}); {MAKE_ONE}")


def special_ids(tokenizer, eos_ids: Iterable[int] = ()) -> tuple[int, ...]:
    """Ids every subset keeps: the tokenizer's special tokens (BOS, EOS, chat markers) and the model's EOS ids."""
    ids = {int(i) for i in tokenizer.all_special_ids} | {int(i) for i in eos_ids}
    for name in ("bos_token_id", "eos_token_id"):
        if getattr(tokenizer, name, None) is not None:
            ids.add(int(getattr(tokenizer, name)))
    return tuple(sorted(ids))


# --------------------------------------------------------------------------- files
def _write_json(path, text: str) -> None:
    """Write atomically through the project's one JSON writer (``jsonfile.write``), creating the folder."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    jsonfile.write(path, text)


def _token_ids(values, vocab_size: int, what: str) -> list[int]:
    """Check a JSON list of token ids: integers in [0, vocab_size), no repeats."""
    if not isinstance(values, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ValueError(f"{what} must be a list of integer token ids")
    bad = [v for v in values if not 0 <= v < vocab_size]
    if bad:
        raise ValueError(f"{what} has ids {bad[:3]} outside [0, {vocab_size})")
    if len(set(values)) != len(values):
        raise ValueError(f"{what} repeats ids")
    return values


def _vocab_size(d: dict) -> int:
    model = d.get("model")
    if not isinstance(model, dict):
        raise ValueError(f"'model' must be an object, got {type(model).__name__}")
    v = model.get("vocab_size")
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"model.vocab_size must be a positive integer, got {v!r}")
    return v


# --------------------------------------------------------------------------- the subset
@dataclass(frozen=True)
class DraftVocab:
    """The token ids a draft head scores (sorted, unique), with where they came from and the model they fit."""

    ids: tuple[int, ...]
    """Sorted unique token ids: row i of the subset head is row ``ids[i]`` of the full head."""
    model: dict
    """The model the ids were chosen for (``model_record``: identity and tokenizer fingerprint)."""
    source: dict = field(default_factory=dict)
    """Provenance of the counts: data, mode, token count, selection rule."""
    coverage: dict = field(default_factory=dict)
    """Held-out coverage measured when the file was made: task -> {'coverage', 'tokens'} (may be empty)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", tuple(sorted({int(i) for i in self.ids})))

    @property
    def size(self) -> int:
        return len(self.ids)

    @property
    def vocab_size(self) -> int:
        return int(self.model["vocab_size"])

    @property
    def head_share(self) -> float:
        """Share of the LM head's rows (and weight) the subset keeps: N / V."""
        return self.size / self.vocab_size

    def to_dict(self) -> dict:
        return {"format": VOCAB_FORMAT, "size": self.size, "head_share": round(self.head_share, 4),
                "model": self.model, "source": self.source, "coverage": self.coverage, "ids": list(self.ids)}

    def save(self, path) -> None:
        """Write atomically; the id list stays on one line."""
        d = self.to_dict()
        ids = d.pop("ids")
        text = json.dumps(d, indent=2)
        _write_json(path, text[:-2] + f',\n  "ids": {json.dumps(ids, separators=(",", ":"))}\n}}\n')

    @classmethod
    def load(cls, path) -> DraftVocab:
        """Read and validate a vocabulary file; anything wrong is one UserError naming the file."""
        d = jsonfile.read(path, "draft vocabulary file", VOCAB_FORMAT, MAKE_ONE)
        try:
            ids = _token_ids(d.get("ids"), _vocab_size(d), "'ids'")
            if not ids:
                raise ValueError("'ids' is empty")
            for key in ("source", "coverage"):
                if not isinstance(d.get(key, {}), dict):
                    raise ValueError(f"{key!r} must be an object")
            return cls(tuple(ids), d["model"], d.get("source", {}), d.get("coverage", {}))
        except ValueError as e:
            raise UserError(f"{Path(path).expanduser()} is not a valid draft vocabulary file: {e}") from None


# --------------------------------------------------------------------------- counts
@dataclass
class TokenCounts:
    """How often each token id occurred in calibration data; the ranking that ``top`` cuts."""

    counts: dict[int, int]
    """Token id -> occurrences in what ``source['mode']`` counts (generated tokens, or text tokens)."""
    backoff: dict[int, int]
    """Token id -> occurrences in calibration text: breaks ties of ``counts`` (empty in text mode)."""
    special: tuple[int, ...]
    """Ids every subset keeps whatever their counts (BOS, EOS, the tokenizer's special tokens)."""
    model: dict
    """The model counted (``model_record``: identity and tokenizer fingerprint)."""
    source: dict = field(default_factory=dict)
    """Provenance: data sets and items, mode, tokens counted, generation length, chat, dtype, wall time."""

    @property
    def vocab_size(self) -> int:
        return int(self.model["vocab_size"])

    @property
    def tokens(self) -> int:
        """Tokens counted (the primary counts)."""
        return sum(self.counts.values())

    def ranking(self) -> list[int]:
        """Every id of the vocabulary, most frequent first: by count, then back-off count, then smaller id."""
        seen = set(self.counts) | set(self.backoff)
        listed = sorted(seen, key=lambda i: (-self.counts.get(i, 0), -self.backoff.get(i, 0), i))
        return listed + [i for i in range(self.vocab_size) if i not in seen]

    def top(self, n: int) -> DraftVocab:
        """The special ids plus the most frequent other ids, ``n`` in all."""
        if isinstance(n, bool) or not isinstance(n, int) or not len(self.special) < n <= self.vocab_size:
            raise UserError(f"draft vocabulary size {n!r} must be an integer in ({len(self.special)}, "
                            f"{self.vocab_size}]: more than the model's {len(self.special)} special tokens, "
                            "at most its vocabulary")
        chosen = set(self.special)
        for i in self.ranking():
            if len(chosen) == n:
                break
            chosen.add(i)
        source = self.source | {"counted_tokens": self.tokens,
                                "selection": f"special ids + top {n - len(self.special)} by count "
                                             "(ties: back-off count, then smaller id)"}
        return DraftVocab(tuple(chosen), self.model, source)

    def to_dict(self) -> dict:
        rows = [[i, self.counts.get(i, 0), self.backoff.get(i, 0)] for i in self.ranking()
                if i in self.counts or i in self.backoff]
        return {"format": COUNTS_FORMAT, "model": self.model, "source": self.source,
                "special_ids": list(self.special), "tokens": self.tokens,
                "columns": ["id", "count", "backoff"], "counts": rows}

    def save(self, path) -> None:
        """Write atomically, one [id, count, backoff] row per line, most frequent first."""
        d = self.to_dict()
        rows = d.pop("counts")
        head = json.dumps(d, indent=2)[:-2]
        body = ",\n".join(json.dumps(r, separators=(",", ":")) for r in rows)
        _write_json(path, f'{head},\n  "counts": [\n{body}\n]\n}}\n')

    @classmethod
    def load(cls, path) -> TokenCounts:
        """Read and validate a counts file; anything wrong is one UserError naming the file."""
        d = jsonfile.read(path, "token counts file", COUNTS_FORMAT, MAKE_ONE)
        try:
            vocab = _vocab_size(d)
            rows = d.get("counts")
            if not isinstance(rows, list) or any(not isinstance(r, list) or len(r) != 3 for r in rows):
                raise ValueError("'counts' must be a list of [id, count, backoff] rows")
            _token_ids([r[0] for r in rows], vocab, "'counts' ids")
            if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for r in rows for c in r[1:]):
                raise ValueError("counts must be non-negative integers")
            special = _token_ids(d.get("special_ids"), vocab, "'special_ids'")
            if not isinstance(d.get("source", {}), dict):
                raise ValueError("'source' must be an object")
            return cls({r[0]: r[1] for r in rows if r[1]}, {r[0]: r[2] for r in rows if r[2]}, tuple(special),
                       d["model"], d.get("source", {}))
        except ValueError as e:
            raise UserError(f"{Path(path).expanduser()} is not a valid token counts file: {e}") from None


# --------------------------------------------------------------------------- coverage
def coverage(vocab: DraftVocab | Iterable[int], token_ids: Iterable[int]) -> float:
    """Share of ``token_ids`` (the tokens a drafter must predict) that lie inside the subset."""
    inside = set(vocab.ids if isinstance(vocab, DraftVocab) else vocab)
    tokens = list(token_ids)
    if not tokens:
        raise ValueError("coverage of no tokens is undefined")
    return sum(t in inside for t in tokens) / len(tokens)


def coverage_report(vocab: DraftVocab | Iterable[int], tokens_by_task: dict[str, list[int]]) -> dict:
    """task -> {'coverage', 'tokens'} for each task with tokens, plus 'all' over them together."""
    groups = {task: toks for task, toks in tokens_by_task.items() if toks}
    if len(groups) > 1:
        groups["all"] = [t for toks in groups.values() for t in toks]
    return {task: {"coverage": round(coverage(vocab, toks), 4), "tokens": len(toks)} for task, toks in groups.items()}


# --------------------------------------------------------------------------- resolving --draft-vocab
def auto_counts_dir() -> Path:
    """Where counts built from a model's own generations are kept: the toolkit cache's ``draft_vocab/``."""
    return cache_root() / "draft_vocab"


def auto_counts_path(record: dict) -> Path:
    """The file of the built counts of the model ``record`` describes (``model_record``: identity and tokenizer)."""
    digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]
    return auto_counts_dir() / f"{record.get('model_type', 'model')}-{digest}.json"


def _fitting(paths: Iterable[Path], model, tokenizer) -> TokenCounts | None:
    for path in paths:
        try:
            counts = TokenCounts.load(path)
            check_model(counts.model, model, tokenizer, str(path))
        except UserError:  # another model's, or a damaged built file (built again): not this model's counts
            continue
        return counts
    return None


def bundled_counts(model, tokenizer=None, directory: Path = BUNDLED_DIR) -> TokenCounts:
    """The counts that fit ``model`` (a runner or its identity; see ``check_model``): a shipped file, else counts built
    for it from its own generations in the toolkit cache (``auto_counts_dir``)."""
    shipped = sorted(Path(directory).glob("*.json"))
    built = sorted(auto_counts_dir().glob("*.json")) if auto_counts_dir().is_dir() else []
    counts = _fitting(shipped, model, tokenizer) or _fitting(built, model, tokenizer)
    if counts is not None:
        return counts
    identity = identity_of(model)
    raise UserError(f"no token counts ship for this model ({identity.get('model_type')}, "
                    f"{identity.get('num_layers')} layers, vocabulary {identity.get('vocab_size')}) and none were "
                    f"built for it (a drafter's draft-vocab auto builds them for a vocabulary of {AUTO_MIN_VOCAB} or "
                    "more); "
                    f"give a vocabulary file instead: {MAKE_ONE}")


def resolve_draft_vocab(spec: int | str | os.PathLike, model, tokenizer=None,
                        directory: Path = BUNDLED_DIR) -> DraftVocab:
    """``--draft-vocab`` / ``draft_vocab=``: an integer N (the top N of the bundled counts for this model) or
    the path of a vocabulary file made by `layerskip draft-vocab`; either is checked against ``model``."""
    text = str(spec).strip() if not isinstance(spec, int) else ""
    if isinstance(spec, int) or is_size(text):
        return bundled_counts(model, tokenizer, directory).top(int(spec))
    if not text:
        raise UserError("--draft-vocab is empty: give a size such as 8192 or a file made by `layerskip draft-vocab`")
    vocab = DraftVocab.load(text)
    check_model(vocab.model, model, tokenizer, text)
    return vocab


def is_size(text: str) -> bool:
    """True for a size written in ASCII digits ('8192'); other digits ('²', '٣') are not sizes."""
    return text.isascii() and text.isdigit()


def names_shipped_top(option) -> bool:
    """Whether a ``draft_vocab`` option names the top of the counts shipped for the model ('auto' or a size N), as an
    exit adapter's provenance records it: the same ids resolve again from the option alone."""
    text = str(option if option is not None else "").strip().lower()
    return text == AUTO or is_size(text)


def check_draft_vocab_option(spec) -> None:
    """Refuse a ``draft_vocab`` option that is neither a size, a file, 'auto', 'off' nor a vocabulary, before any
    model loads."""
    if spec is None or isinstance(spec, DraftVocab):
        return
    text = str(spec).strip()
    if text.lower() in (AUTO, *OFF):
        return
    if is_size(text):
        if int(text) < 1:
            raise UserError(f"draft-vocab must be a size >= 1 or a file, got {text!r}")
    elif text and Path(text).expanduser().is_dir():
        raise UserError(f"draft-vocab {text!r} is a folder; give a file made by `layerskip draft-vocab` (or a size)")
    elif text and ("/" in text or text.endswith(".json")) and not Path(text).expanduser().exists():
        raise UserError(f"draft-vocab file {text!r} does not exist; give a file made by `layerskip draft-vocab`, "
                        "a size (e.g. 8192), 'auto' or 'off'")
    elif not text or not Path(text).expanduser().is_file():
        raise UserError(f"draft-vocab {text!r} is neither a size (e.g. 8192), 'auto', 'off' nor an existing file; "
                        "make a file with `layerskip draft-vocab`")


def ids_digest(ids: Iterable[int]) -> str:
    """A short digest of a set of token ids (order ignored): what an exit adapter's head was trained on, recorded in
    its provenance so a drafter can tell when the vocabulary it resolves now is another one."""
    return hashlib.sha256(",".join(map(str, sorted(int(i) for i in ids))).encode()).hexdigest()[:16]


def resolve_draft_vocab_option(spec, model, tokenizer=None, directory: Path = BUNDLED_DIR) -> DraftVocab | None:
    """A drafter's ``draft_vocab`` option: None or 'off'/'none' (the full head), 'auto' (the top ``AUTO_SIZE`` of
    the shipped or built counts when some fit ``model``, else the full head: ``infer.drafters.inputs.draft_head``
    builds them first where ``AUTO_MIN_VOCAB`` says), a ``DraftVocab``, a size or a file."""
    if spec is None or isinstance(spec, DraftVocab):
        return spec
    text = str(spec).strip().lower()
    if text in OFF or spec is False:
        return None
    if text == AUTO:
        try:
            counts = bundled_counts(model, tokenizer, directory)
        except UserError:  # no counts for this model: the full head
            return None
        return counts.top(AUTO_SIZE) if counts.vocab_size > AUTO_SIZE else None
    return resolve_draft_vocab(spec, model, tokenizer, directory)
