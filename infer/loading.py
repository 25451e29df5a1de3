"""Load a model folder as (runner, tokenizer) and turn prompts into token ids."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig

from core.device import parse_dtype, resolve_device
from core.errors import UserError
from core.models import resolve_model
from infer.draft_vocab import DraftVocab, resolve_draft_vocab
from infer.drafters import build_config, build_drafter
from infer.engine import Engine
from infer.runner import Runner


@dataclass
class LoadedModel:
    path: Path
    runner: Runner
    tokenizer: object
    eos_token_ids: tuple[int, ...]

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of ``prompt``; with ``chat`` it is wrapped as one user turn of the chat template."""
        if not prompt.strip():
            raise UserError("the prompt is empty; give some text")
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise UserError(f"{self.path} has no chat template; drop --chat")
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                     add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            return [int(t) for t in ids]
        return [int(t) for t in self.tokenizer(prompt)["input_ids"]]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def engine(self, drafter: str, options: dict | None = None) -> Engine:
        """An Engine with drafter ``drafter``; ``autoregressive`` with ``exit_layer=E < L`` is lossy early
        exit (the target is layers [0, E) + final norm + LM head). A ``draft_vocab`` size or file is resolved
        with this model's tokenizer (so a finetuned checkpoint uses its base model's counts)."""
        options = dict(options or {})
        spec = options.get("draft_vocab")
        if spec is not None and not isinstance(spec, DraftVocab):
            build_config(drafter, options)  # a bad option is reported as such before the vocabulary is read
            options["draft_vocab"] = resolve_draft_vocab(spec, self.runner, self.tokenizer)
        built = build_drafter(drafter, self.runner, options)
        exit_layer = getattr(built.config, "exit_layer", None) if built.name == "autoregressive" else None
        if exit_layer == self.runner.num_layers:
            exit_layer = None  # E = L is the full model
        return Engine(self.runner, built, self.eos_token_ids, self.decode, exit_layer=exit_layer)


def set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise UserError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


def eos_ids(path: Path, tokenizer) -> tuple[int, ...]:
    """End-of-sequence ids from the generation config and the tokenizer."""
    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
    except OSError:
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def load_model(model: str, dtype: str = "fp32", device: str = "cpu", executor: str = "auto") -> LoadedModel:
    """Resolve ``model`` (folder or 'default'), load the runner and tokenizer.

    ``device`` and ``dtype`` take the CLI names (``auto`` = CUDA + bf16 when available, else CPU + fp32).
    """
    path = resolve_model(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a malformed tokenizer.json
        raise UserError(f"could not load a tokenizer from {path}: {type(e).__name__}: {e}") from None
    dev = resolve_device(device)
    runner = Runner.from_pretrained(path, dtype=parse_dtype(dtype, dev), device=dev, executor=executor)
    return LoadedModel(path, runner, tokenizer, eos_ids(path, tokenizer))
