"""Self-distillation data: the model's own continuations of varied prompts, one JSON-lines file per kind.

A drafter is scored at decode time against the text the model itself writes, so the most faithful training
text for a drafter (an exit adapter, a LayerSkip finetune) is the model's own output on varied prompts (as
Medusa-2 and EAGLE train their heads). The loss still targets the frozen model's full next-token distribution
(``adapter.target: distill``), so the sampled tokens only choose which contexts are seen.

    python -m train.self_distill --model default --out data/self-distill --per-kind 200

writes ``<out>/<kind>.jsonl`` (fields ``id``, ``kind``, ``text``: the prompt in the chat template, or raw, plus
the model's continuation; ``new_tokens``; ``sampled``) and ``<out>/provenance.json`` (model, commit, settings,
prompts and tokens per kind). Prompts alternate greedy decoding and sampling (``--temperature``), so the data
holds both the greedy text a drafter meets most often and varied contexts; ``--decoding sampled --seed 1`` into
another folder adds a second, sampled continuation of every prompt. ``--prompts FILE`` takes your own prompts
instead (JSON lines: ``prompt``, optionally ``kind`` and ``chat``), for an adapter that drafts your kind of text: it
drafts little on kinds unlike its data (docs/RESULTS.md, "The shipped exit adapter by kind of text"). A recipe reads
the files as ``type: jsonl`` sources, one per kind, its ``max_documents`` setting each kind's share.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerskip_core.cli import Parser, check_output_dir, finite_float, run_main
from layerskip_core.errors import UserError
from layerskip_core.options import add_dataclass_flags, from_args
from layerskip_core.prompts import check_text, read_jsonl
from layerskip_core.settings import ModelSettings
from train.adapter import code_commit
from train.distill_prompts import TRAIN_KINDS, KindPrompt, training_prompts


def prompt_text(tokenizer, p: KindPrompt) -> str:
    """The text the model sees: the user's turn in the chat template (when it has one), else the raw prompt."""
    if p.chat and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                             tokenize=False)
    return p.text


def _generate_batch(model, tokenizer, texts: list[str], sampled: bool, args) -> list[tuple[str, int]]:
    """(full text, new-token count) for each prompt text, one left-padded ``generate`` call."""
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    kw = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p} if sampled else \
        {"do_sample": False}
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             **kw)  # (B, P + N)
    rows = []
    for text, seq in zip(texts, out[:, enc["input_ids"].shape[1]:], strict=True):
        keep = seq[seq != tokenizer.pad_token_id]  # (n,) the continuation without right padding
        rows.append((text + tokenizer.decode(keep, skip_special_tokens=False), int(keep.numel())))
    return rows


def is_sampled(index: int, decoding: str) -> bool:
    """Whether the prompt at ``index`` of its kind is sampled (else decoded greedily) under ``--decoding``."""
    return decoding == "sampled" or (decoding == "alternate" and index % 2 == 1)


def generate_kind(model, tokenizer, prompts: list[KindPrompt], args, bar) -> list[dict]:
    """Records of one kind, in batches: with ``--decoding alternate`` even-numbered prompts decoded greedily and odd
    ones sampled; ``greedy`` / ``sampled``: all of them so."""
    records = []
    for sampled in (False, True):
        group = [p for i, p in enumerate(prompts) if is_sampled(i, args.decoding) == sampled]
        for start in range(0, len(group), args.batch_size):
            chunk = group[start:start + args.batch_size]
            rows = _generate_batch(model, tokenizer, [prompt_text(tokenizer, p) for p in chunk], sampled, args)
            for p, (text, n) in zip(chunk, rows, strict=True):
                records.append({"id": p.id, "kind": p.kind, "text": text, "new_tokens": n, "sampled": sampled})
            bar.update(len(chunk))
    return sorted(records, key=lambda r: int(r["id"].rsplit("-", 1)[1]))


def _write_jsonl(path: Path, records: list[dict]) -> None:
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)


SEED_LIMIT = 2**63
"""Seeds are in [0, 2**63), as a training recipe's ``seed`` (torch's generator takes no more)."""
MODEL_DEFAULTS = ModelSettings(dtype="fp32")
"""This command's defaults of the shared model flags: fp32 (the data's tokens as the fp32 model writes them), one
thread, the device ``auto`` picks (``--dtype bf16`` on a GPU halves the time)."""
MODEL_FLAGS_SKIPPED = ("executor", "compile")
"""Shared model flags this command has no use for (transformers' ``generate`` decodes, not the runner)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags, checked: the shared model flags (``layerskip_core.settings.ModelSettings``: --model, --device,
    --dtype, --threads, as every command checks them) and this command's own; a bad value is one line."""
    ap = Parser(prog="python -m train.self_distill", description=__doc__.split("\n\n")[0])
    add_dataclass_flags(ap.add_argument_group("model and device"), ModelSettings, skip=MODEL_FLAGS_SKIPPED,
                        defaults=MODEL_DEFAULTS)
    ap.add_argument("--out", type=Path, required=True,
                    help="output folder (refused when it holds data, unless --force)")
    ap.add_argument("--kinds", default=None, help=f"comma-separated kinds (of {TRAIN_KINDS}; default: all)")
    ap.add_argument("--prompts", type=Path, default=None,
                    help="your own prompts instead of the built-in kinds: a JSON-lines file, one object a line with "
                         "'prompt' (the text), optionally 'kind' (a name: one output file per kind; default 'own') "
                         "and 'chat' (false: continue the text as raw, not as the user's turn; default true)")
    ap.add_argument("--per-kind", type=int, default=None, help="at most this many prompts per kind (all: default)")
    ap.add_argument("--max-new-tokens", type=int, default=160, help="tokens generated per prompt")
    ap.add_argument("--decoding", choices=("alternate", "greedy", "sampled"), default="alternate",
                    help="how continuations are decoded: greedy and sampled by turns, or all one way ('sampled' with "
                         "another --seed adds different continuations of the same prompts to an earlier run's)")
    ap.add_argument("--temperature", type=finite_float, default=0.8, help="temperature of the sampled half")
    ap.add_argument("--top-p", type=finite_float, default=0.95, help="top-p of the sampled half")
    ap.add_argument("--batch-size", type=int, default=16, help="prompts per generate call")
    ap.add_argument("--seed", type=int, default=0, help="seed of torch's generator, for the sampled half (default 0)")
    ap.add_argument("--force", action="store_true", help="replace an output folder that already holds data")
    args = ap.parse_args(argv)
    settings = model_settings(args)  # checked (threads in range); the defaults filled in, as the provenance says
    for name in ("model", "device", "dtype", "threads"):
        setattr(args, name, getattr(settings, name))
    _check_options(args)
    return args


def model_settings(args: argparse.Namespace) -> ModelSettings:
    """The shared model settings of the flags given, over this command's defaults (threads checked here)."""
    return from_args(ModelSettings, args, MODEL_DEFAULTS, skip=MODEL_FLAGS_SKIPPED)


def _check_options(args: argparse.Namespace) -> None:
    """This command's own flags, each refused in one line when out of range."""
    if args.prompts is not None and args.kinds is not None:
        raise UserError("--prompts and --kinds exclude each other: give your own prompts or the built-in kinds")
    if args.prompts is None:
        args.kinds = args.kinds or ",".join(TRAIN_KINDS)
        unknown = [k for k in args.kinds.split(",") if k not in TRAIN_KINDS]
        if unknown:
            raise UserError(f"--kinds: unknown kind(s) {unknown}; choose from {', '.join(TRAIN_KINDS)}")
    for name in ("per_kind", "max_new_tokens", "batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1 (got {value})")
    if args.temperature <= 0 or not 0 < args.top_p <= 1:
        raise UserError("--temperature must be > 0 and --top-p in (0, 1]")
    if not 0 <= args.seed < SEED_LIMIT:
        raise UserError(f"--seed must be in [0, 2**63), got {args.seed}")


def _prompt_line(row: dict, where: str) -> tuple[str, str, bool]:
    """(kind, text, chat) of one ``--prompts`` line; refused in one line naming ``where`` when malformed."""
    text, kind, chat = row.get("prompt"), row.get("kind", "own"), row.get("chat", True)
    if not isinstance(text, str) or not text.strip():
        raise UserError(f"{where}: each line needs an object with a non-empty 'prompt' string")
    if not isinstance(kind, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", kind):
        raise UserError(f"{where}: 'kind' names an output file: letters, digits, '_' or '-' (got {kind!r})")
    if not isinstance(chat, bool):
        raise UserError(f"{where}: 'chat' must be true or false (got {chat!r})")
    return kind, check_text(text, f"{where}: the prompt"), chat


def read_prompts(path: Path) -> dict[str, list[KindPrompt]]:
    """Kind -> prompts of a ``--prompts`` file (the project's JSON-lines reader; kinds in the order they first
    appear; ids ``kind-index``)."""
    kinds: dict[str, list[KindPrompt]] = {}
    for n, row in read_jsonl(path):
        kind, text, chat = _prompt_line(row, f"--prompts {path}, line {n}")
        same = kinds.setdefault(kind, [])
        same.append(KindPrompt(kind, f"{kind}-{len(same)}", text, chat))
    if not kinds:
        raise UserError(f"--prompts {path} holds no prompt")
    return kinds


def _prepare_out(out: Path, force: bool, kinds: list[str], prompts: Path | None) -> None:
    """Create ``out`` under the output policy (``layerskip_core.cli.check_output_dir``: not a file, creatable,
    never the ``--prompts`` file); one holding files is refused unless ``force``, which removes an earlier run's data
    files (``*.jsonl``, ``provenance.json``) so no kind of an older run is left beside the new ones."""
    doomed = {p.name for p in out.glob("*.jsonl")} if out.is_dir() else set()
    writes = tuple(sorted(doomed | {f"{kind}.jsonl" for kind in kinds} | {"provenance.json"}))
    check_output_dir(out, "--out", writes=writes, force=True, inputs=(("--prompts", prompts),))
    if out.exists() and any(out.iterdir()):
        if not force:
            raise UserError(f"{out} already holds files; choose another --out or pass --force to replace them")
        for name in writes:
            (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)


def load(args, path: Path, device, dtype):
    """(model in eval mode, tokenizer with left padding) from the folder ``path`` (``--model`` resolved)."""
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, tokenizer


def run(args: argparse.Namespace) -> dict:
    """Generate every kind's file and the provenance; returns the provenance."""
    if args.prompts is not None:  # read before anything is created or loaded: a bad file is refused at once
        kinds = {k: v[:args.per_kind] for k, v in read_prompts(args.prompts).items()}
    else:
        kinds = {k: training_prompts(k, args.per_kind) for k in args.kinds.split(",")}
    out = Path(args.out)
    resolved = model_settings(args).resolve()  # a device this machine lacks is refused before anything is written
    _prepare_out(out, args.force, list(kinds), args.prompts)
    commit = code_commit()  # the code that runs: taken now, not when the files are written
    resolved.apply_threads()
    torch.manual_seed(args.seed)
    path = resolved.model
    model, tokenizer = load(args, path, resolved.device, resolved.dtype)
    started, counts = time.time(), {}
    with tqdm(total=sum(map(len, kinds.values())), desc="self-distill", unit="prompt",
              mininterval=0 if sys.stderr.isatty() else 60) as bar:
        for kind, prompts in kinds.items():
            records = generate_kind(model, tokenizer, prompts, args, bar)
            _write_jsonl(out / f"{kind}.jsonl", records)
            counts[kind] = {"prompts": len(records), "new_tokens": sum(r["new_tokens"] for r in records)}
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("out", "force")}
    if args.prompts is not None:  # which prompts, not only where they were
        settings["prompts_sha256"] = hashlib.sha256(args.prompts.read_bytes()).hexdigest()
    provenance = {"model": args.model, "model_path": path.name, "commit": commit, "kinds": counts, "settings": settings,
                  "seconds": round(time.time() - started, 1)}
    (out / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    return provenance


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    prov = run(args)
    total = sum(c["new_tokens"] for c in prov["kinds"].values())
    print(f"wrote {len(prov['kinds'])} kinds, {total} generated tokens in {prov['seconds']} s to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Generate self-distillation data from the command line ``argv``."""
    return run_main("python -m train.self_distill", lambda: _main(argv))


if __name__ == "__main__":
    sys.exit(main())
