"""Training data: documents from local sources, tokenised once (cached), cut into examples.

Pretraining packs documents (each followed by EOS) into ``block_size`` blocks, loss on every token; finetuning
takes prompt/response pairs in the chat template, loss on the response only. Each source's document order is
deterministic and its back ``val_fraction`` (or its ``holdout_packages``) is held out, after duplicates are
dropped (``train.dedup``). The cache key covers the tokenizer files, the source files (names, sizes, mtimes) and
the data config. The batch order is a pure function of (seed, step, micro-batch, rank), so a resumed run sees
the examples an uninterrupted one would have.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import json
import os
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from layerskip_core.errors import UserError
from layerskip_core.heldout import IGNORE
from layerskip_core.packages import cache_root
from layerskip_core.prompts import BUILTIN_SETS, load_prompts
from train.config import DataConfig, SourceConfig
from train.dedup import duplicates

CACHE_VERSION = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt")


@dataclass
class Document:
    """One unit of training text: ``text`` for pretraining, ``prompt``/``response`` for finetuning."""

    id: str
    text: str = ""
    prompt: str = ""
    response: str = ""


# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------


def stdlib_dir() -> Path:
    """The running interpreter's standard-library folder (never a hard-coded path)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _path_key(rel: str) -> str:
    return hashlib.sha1(rel.encode()).hexdigest()


def _walk_files(root: Path, include: list[str], exclude: list[str]) -> list[Path]:
    """Files under ``root`` matching ``include``, not inside an ``exclude`` directory; ordered by path hash."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in exclude)
        for name in filenames:
            if any(fnmatch.fnmatch(name, pat) for pat in include):
                found.append(Path(dirpath) / name)
    return sorted(found, key=lambda p: _path_key(str(p.relative_to(root))))


def _glob_files(pattern: str) -> list[Path]:
    path = Path(pattern).expanduser()
    if path.is_file():
        return [path]
    return sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())


def source_files(src: SourceConfig) -> list[Path]:
    """The files a file-backed source reads (empty for ``prompt_set``)."""
    if src.type == "stdlib":
        return _walk_files(stdlib_dir(), src.include, src.exclude)
    if src.type == "files":
        root = Path(src.path).expanduser()
        if root.is_dir():
            return _walk_files(root, src.include, src.exclude)
        files = _glob_files(src.path)
        if not files:
            raise UserError(f"data source {src.path!r}: no such file, folder or glob match")
        return files
    if src.type in ("text", "jsonl"):
        root = Path(src.path).expanduser()
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else _glob_files(src.path)
        if not files:
            raise UserError(f"data source {src.path!r}: no files found")
        return files
    return []


def _read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _load_with_datasets(builder: str, files: list[Path], **kwargs):
    from datasets import load_dataset  # lazy: importing datasets costs ~1 s

    return load_dataset(builder, data_files=[str(f) for f in files], split="train",
                        cache_dir=str(cache_root() / "datasets"), **kwargs)


def read_source(src: SourceConfig, task: str) -> list[Document]:
    """All documents of one source, in its deterministic order."""
    docs: list[Document] = []
    if src.type in ("stdlib", "files"):
        files = source_files(src)
        root = stdlib_dir() if src.type == "stdlib" else Path(src.path).expanduser()
        if task == "sft":
            raise UserError(f"data source type {src.type!r} holds raw text; finetuning needs prompt/response "
                            "pairs (type: jsonl with prompt/response fields, or type: prompt_set)")
        for f in files:
            rel = str(f.relative_to(root)) if root.is_dir() else f.name
            text = _read_text(f)
            if text.strip():
                docs.append(Document(rel, text=text))
    elif src.type == "text":
        if task == "sft":
            raise UserError("data source type 'text' holds raw text; finetuning needs prompt/response pairs")
        ds = _load_with_datasets("text", source_files(src), sample_by=src.sample_by)
        docs = [Document(str(i), text=t) for i, t in enumerate(ds["text"]) if t.strip()]
    elif src.type == "jsonl":
        ds = _load_with_datasets("json", source_files(src))
        fields = [src.text_field] if task == "pretrain" else [src.prompt_field, src.response_field]
        for name in fields:
            if name not in ds.column_names:
                raise UserError(f"data source {src.path!r} has no field {name!r} "
                                f"(fields: {', '.join(ds.column_names)}); "
                                "set text_field / prompt_field / response_field")
        if task == "pretrain":
            docs = [Document(str(i), text=str(t)) for i, t in enumerate(ds[src.text_field]) if str(t).strip()]
        else:
            docs = [Document(str(i), prompt=str(p), response=str(r))
                    for i, (p, r) in enumerate(zip(ds[src.prompt_field], ds[src.response_field], strict=True))]
    elif src.type == "prompt_set":
        items = load_prompts(src.path)
        docs = [Document(it.id, prompt=it.prompt, response=it.reference) for it in items]
        if any(not d.response for d in docs):
            raise UserError(f"prompt set {src.path!r} has items without a reference answer; it cannot be used "
                            "for finetuning")
    if src.max_documents is not None:
        docs = docs[: src.max_documents]
    if not docs:
        raise UserError(f"data source {src.type}:{src.path or stdlib_dir()} has no documents")
    return docs


def split_documents(docs: list[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """Front for training, back ``val_fraction`` (at least one document when > 0) for validation."""
    if val_fraction <= 0 or len(docs) < 2:
        return docs, []
    n_val = min(len(docs) - 1, max(1, round(val_fraction * len(docs))))
    return docs[:-n_val], docs[-n_val:]


# --------------------------------------------------------------------------------------------
# Duplicates and package hold-out
# --------------------------------------------------------------------------------------------

def package_of(doc_id: str) -> str:
    """Top-level package or module of a document id (a relative path): ``email/mime/text.py`` -> ``email``,
    ``json.py`` -> ``json``."""
    first = Path(doc_id).parts[0] if Path(doc_id).parts else doc_id
    return first[:-3] if first.endswith(".py") else first


def deduplicate(docs: list[Document], mode: str, threshold: float,
                priority: list[bool] | None = None) -> tuple[list[Document], list[tuple[str, str]]]:
    """Documents without duplicates (order kept) and the (dropped id, kept id) pairs, as ``train.dedup`` finds them.
    Documents whose ``priority`` is True are visited first (held-out ones: a pair across the split loses its
    training copy)."""
    if mode == "off":
        return docs, []
    order = sorted(range(len(docs)), key=lambda i: (not priority[i]) if priority else 0)
    found = duplicates([d.text or d.prompt + "\n" + d.response for d in docs], mode, threshold, order)
    return [d for i, d in enumerate(docs) if i not in found], [(docs[i].id, docs[j].id) for i, j in found.items()]


def split_source(docs: list[Document], src: SourceConfig,
                 val_fraction: float) -> tuple[list[Document], list[Document], list[tuple[str, str]]]:
    """(train, validation, dropped duplicates) of one source: dedup, then package hold-out or the back fraction."""
    held = set(src.holdout_packages)
    is_held = [package_of(d.id) in held for d in docs] if held else None
    docs, dropped = deduplicate(docs, src.dedup, src.dedup_threshold, is_held)
    if not held:
        train, val = split_documents(docs, val_fraction)
        return train, val, dropped
    val = [d for d in docs if package_of(d.id) in held]
    train = [d for d in docs if package_of(d.id) not in held]
    if not val:
        raise UserError(f"holdout_packages {sorted(held)} match no document of source {src.type}:"
                        f"{src.path or stdlib_dir()}; give top-level names such as 'email' or 'json'")
    if not train:
        raise UserError(f"holdout_packages {sorted(held)} hold out every document; nothing is left to train on")
    return train, val, dropped


def split_sources(cfg: DataConfig) -> tuple[list[Document], list[Document], list[tuple[str, str]]]:
    """Training and validation documents of every source (in order) and the duplicates dropped."""
    train_docs, val_docs, dropped = [], [], []
    for src in cfg.sources:
        tr, va, dr = split_source(read_source(src, cfg.task), src, cfg.val_fraction)
        train_docs += tr
        val_docs += va
        dropped += dr
    return train_docs, val_docs, dropped


# --------------------------------------------------------------------------------------------
# Tokenised examples
# --------------------------------------------------------------------------------------------


@dataclass
class Examples:
    """Tokenised examples stored flat: example i is ``ids[offsets[i]:offsets[i+1]]`` (and its labels)."""

    ids: np.ndarray  # (total,) int32
    labels: np.ndarray  # (total,) int32, -100 where there is no loss
    offsets: np.ndarray  # (N + 1,) int64

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @classmethod
    def from_lists(cls, seqs: list[list[int]], labels: list[list[int]]) -> Examples:
        lengths = np.array([len(s) for s in seqs], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        flat = lambda xs: np.array([t for x in xs for t in x], dtype=np.int32)
        return cls(flat(seqs), flat(labels), offsets)

    def take(self, n: int) -> Examples:
        n = min(n, len(self))
        end = int(self.offsets[n])
        return Examples(self.ids[:end], self.labels[:end], self.offsets[: n + 1])

    def batch(self, indices: list[int] | np.ndarray, pad_id: int) -> dict[str, torch.Tensor]:
        """Right-padded (B, T_max) ``input_ids`` and ``labels`` (-100 on padding)."""
        spans = [(int(self.offsets[i]), int(self.offsets[i + 1])) for i in indices]
        T = max(e - s for s, e in spans)
        input_ids = np.full((len(spans), T), pad_id, dtype=np.int64)  # (B, T)
        labels = np.full((len(spans), T), IGNORE, dtype=np.int64)  # (B, T)
        for row, (s, e) in enumerate(spans):
            input_ids[row, : e - s] = self.ids[s:e]
            labels[row, : e - s] = self.labels[s:e]
        return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels)}


def pack_blocks(token_lists: list[list[int]], block_size: int, eos_id: int | None) -> Examples:
    """Concatenate documents (each followed by EOS) and cut into full blocks of ``block_size``."""
    stream = []
    for toks in token_lists:
        stream.extend(toks)
        if eos_id is not None:
            stream.append(eos_id)
    n = len(stream) // block_size
    ids = np.array(stream[: n * block_size], dtype=np.int32)
    return Examples(ids, ids.copy(), np.arange(n + 1, dtype=np.int64) * block_size)


def use_chat_template(tokenizer, mode: str) -> bool:
    has = bool(getattr(tokenizer, "chat_template", None))
    if mode == "on" and not has:
        raise UserError("data.chat_template is 'on' but the tokenizer has no chat template; use 'auto' or 'off'")
    return has and mode != "off"


def encode_pair(tokenizer, prompt: str, response: str, chat: bool, add_eos: bool,
                max_len: int) -> tuple[list[int], list[int]]:
    """Token ids of prompt + response and labels that are -100 on the prompt part."""
    if chat:
        user = [{"role": "user", "content": prompt}]
        p_text = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
        full_text = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": response}], tokenize=False)
        p_ids = tokenizer(p_text, add_special_tokens=False)["input_ids"]
        full = tokenizer(full_text, add_special_tokens=False)["input_ids"]
        if full[: len(p_ids)] != p_ids:  # template tokenises differently across the boundary: build it by parts
            tail = tokenizer(full_text[len(p_text):], add_special_tokens=False)["input_ids"]
            full = p_ids + tail
    else:
        p_ids = tokenizer(prompt)["input_ids"]
        r_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
        if add_eos and tokenizer.eos_token_id is not None:
            r_ids = r_ids + [tokenizer.eos_token_id]
        full = p_ids + r_ids
    labels = [IGNORE] * len(p_ids) + full[len(p_ids):]
    return full[:max_len], labels[:max_len]


def tokenize_documents(docs: list[Document], tokenizer, cfg: DataConfig) -> Examples:
    if cfg.task == "pretrain":
        texts = [d.text for d in docs]
        token_lists: list[list[int]] = []
        for i in range(0, len(texts), 256):
            token_lists.extend(tokenizer(texts[i:i + 256], add_special_tokens=False)["input_ids"])
        return pack_blocks(token_lists, cfg.block_size, tokenizer.eos_token_id if cfg.add_eos else None)
    chat = use_chat_template(tokenizer, cfg.chat_template)
    pairs = [encode_pair(tokenizer, d.prompt, d.response, chat, cfg.add_eos, cfg.block_size) for d in docs]
    pairs = [(ids, lab) for ids, lab in pairs if any(t != IGNORE for t in lab[1:])]  # drop fully-cut responses
    return Examples.from_lists([p[0] for p in pairs], [p[1] for p in pairs])


# --------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------


def _tokenizer_fingerprint(tokenizer_dir: Path) -> list:
    out = []
    for name in TOKENIZER_FILES:
        p = Path(tokenizer_dir) / name
        if p.is_file():
            out.append([name, hashlib.sha256(p.read_bytes()).hexdigest()])
    return out


def _source_fingerprint(src: SourceConfig) -> dict:
    spec = dict(vars(src))
    if src.type == "stdlib":
        spec["root"] = str(stdlib_dir())
    files = source_files(src)
    stats = [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    spec["files"] = hashlib.sha256(json.dumps(stats).encode()).hexdigest()
    if src.type == "prompt_set":
        spec["package"] = repr(BUILTIN_SETS.get(src.path)) if src.path in BUILTIN_SETS else repr(stats)
    return spec


def cache_key(cfg: DataConfig, tokenizer_dir: Path) -> str:
    payload = {
        "version": CACHE_VERSION,
        "tokenizer": _tokenizer_fingerprint(tokenizer_dir),
        "sources": [_source_fingerprint(s) for s in cfg.sources],
        "task": cfg.task, "block_size": cfg.block_size, "val_fraction": cfg.val_fraction,
        "chat_template": cfg.chat_template, "add_eos": cfg.add_eos,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _save(path: Path, train: Examples, val: Examples, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".npz")
    os.close(fd)
    try:
        np.savez(tmp, train_ids=train.ids, train_labels=train.labels, train_offsets=train.offsets,
                 val_ids=val.ids, val_labels=val.labels, val_offsets=val.offsets, meta=json.dumps(meta))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _load(path: Path) -> tuple[Examples, Examples, dict]:
    z = np.load(path)
    train = Examples(z["train_ids"], z["train_labels"], z["train_offsets"])
    val = Examples(z["val_ids"], z["val_labels"], z["val_offsets"])
    return train, val, json.loads(str(z["meta"]))


@dataclass
class Dataset:
    """Training and validation examples plus the counts worth logging."""

    train: Examples
    val: Examples
    meta: dict


def build_dataset(cfg: DataConfig, tokenizer, tokenizer_dir: Path, log=None) -> Dataset:
    """Read, split, tokenise and pack the configured sources (or load them from the cache)."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    cache_dir = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else cache_root() / "tokens"
    path = cache_dir / f"{cache_key(cfg, tokenizer_dir)}.npz"
    if path.is_file():
        train, val, meta = _load(path)
        return Dataset(train, val, meta)
    train_docs, val_docs, dropped = split_sources(cfg)
    if dropped:
        log(f"dropped {len(dropped)} duplicate or near-duplicate documents")
    log(f"tokenising {len(train_docs)} training + {len(val_docs)} validation documents (cached in {path}) ...")
    train = tokenize_documents(train_docs, tokenizer, cfg)
    val = tokenize_documents(val_docs, tokenizer, cfg) if val_docs else Examples.from_lists([], [])
    if len(train) == 0:
        raise UserError(f"the data gives no training examples (block_size {cfg.block_size} is longer than the "
                        "whole training text?)")
    meta = {"train_documents": len(train_docs), "val_documents": len(val_docs),
            "train_examples": len(train), "val_examples": len(val),
            "train_tokens": train.num_tokens, "val_tokens": val.num_tokens,
            "val_ids": [d.id for d in val_docs][:1000], "duplicates_dropped": len(dropped)}
    _save(path, train, val, meta)
    return Dataset(train, val, meta)


# --------------------------------------------------------------------------------------------
# Batch order
# --------------------------------------------------------------------------------------------


class BatchOrder:
    """Which examples form micro-batch ``micro`` of step ``step`` on ``rank``: a pure function.

    Example positions run through epochs; each epoch is a fresh permutation seeded by
    (seed, epoch). Position of row j: ((step * accum + micro) * world + rank) * micro_batch + j.
    """

    def __init__(self, num_examples: int, micro_batch: int, accum: int, world: int, seed: int):
        self.n, self.b, self.g, self.w, self.seed = num_examples, micro_batch, accum, world, seed
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # batches straddle at most two epochs
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return self._perms[epoch]

    def indices(self, step: int, micro: int, rank: int) -> list[int]:
        start = ((step * self.g + micro) * self.w + rank) * self.b
        return [int(self._perm(p // self.n)[p % self.n]) for p in range(start, start + self.b)]

    def epoch(self, step: int) -> float:
        return step * self.g * self.w * self.b / self.n
