"""Load a model as (runner, tokenizer), build engines on it, turn text into token ids and back.

The public entry point of the Python API (see the README's "Python API"):

    model = load_model("default")                          # a folder, a hub id, "default" ...
    model = load_model(hf_model, tokenizer=hf_tokenizer)   # ... or a transformers model already in memory
    result = model.generate("def fib(n):", "early_exit", DecodeConfig(max_new_tokens=32), exit_layer=24)
    with model.engine("swift") as engine: ...              # one drafter over many prompts; finish() on exit

``load_model`` is the Python API's edge: it resolves device, dtype, executor and threads once
(``layerskip_core.settings``); the commands resolve their flags themselves and call ``load_resolved``.
``LoadedModel.engine`` builds a drafter's options into its Config once and resolves ``draft_vocab``
there, with this model's tokenizer; ``method`` splits ``target_exit`` off a spec into the generation.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig, PreTrainedModel

from infer.decode.batch import BatchEngine
from infer.decode.engine import DecodeConfig, Engine, GenerationResult
from infer.drafters import ResolvedSpec, Spec, build_drafter, drafter_spec, parse_spec
from infer.model.runner import Runner
from layerskip_core.errors import UserError
from layerskip_core.prompts import check_text
from layerskip_core.settings import ModelSettings, Resolved, RunSettings


@dataclass
class LoadedModel:
    """A model ready to decode: the runner over its weights, its tokenizer and end-of-sequence ids."""

    path: Path | None
    """The model folder (None for a model given as an object)."""
    runner: Runner
    """The lean forward over the model's weights (``infer.model.runner``)."""
    tokenizer: object
    """The Hugging Face tokenizer."""
    eos_token_ids: tuple[int, ...]
    """Token ids that end a generation."""

    @property
    def name(self) -> str:
        return str(self.path) if self.path is not None else getattr(self.runner.config, "name_or_path", "") or "model"

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of ``prompt``; with ``chat`` it is wrapped as one user turn of the chat template."""
        if not prompt.strip():
            raise UserError("the prompt is empty; give some text")
        check_text(prompt, "the prompt")  # a lone surrogate: one line, not the tokenizer's TypeError
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise UserError(f"{self.name} has no chat template; drop --chat")
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                     add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            return [int(t) for t in ids]
        return [int(t) for t in self.tokenizer(prompt)["input_ids"]]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def engine(self, drafter: str = "autoregressive", options: dict | object | None = None, **more) -> Engine:
        """An Engine with drafter ``drafter`` and its ``options`` (a dict and/or keywords: ``exit_layer=24``, or the
        drafter's Config, its Spec, or a spec resolved on this model).

        A ``draft_vocab`` size, file or 'auto' is resolved here, once, with this model's tokenizer (so a finetuned
        checkpoint uses its base model's counts). Use the engine as a context manager, or call ``close()``, when
        done: that runs the drafter's ``finish`` (saves a plan or the adaptive gate's memory)."""
        options = self.resolve(drafter, options, more)
        return Engine(self.runner, build_drafter(drafter, self.runner, options), self.eos_token_ids, self.decode)

    def batch_engine(self, drafter: str = "autoregressive", options: dict | object | None = None, *,
                     batch_size: int = 8, carry_state: bool = False, **more) -> BatchEngine:
        """A ``BatchEngine`` decoding ``batch_size`` prompts at a time, a fresh ``drafter`` for every prompt built from
        the options (given as to ``engine``, resolved once; ``carry_state``: one per row slot, kept over the prompts
        the slot takes); close it (or use ``with``) when done, as an engine."""
        options = self.resolve(drafter, options, more)
        return BatchEngine(self.runner, lambda: build_drafter(drafter, self.runner, options), batch_size,
                           self.eos_token_ids, self.decode, carry_state=carry_state)

    def resolve(self, drafter: str, options: dict | object | None, more: dict) -> ResolvedSpec:
        """A drafter's options (a dict and/or keywords, its Config, Spec or resolved spec) resolved on this model."""
        if more:
            if options is not None and not isinstance(options, dict):
                raise UserError("give a drafter's options as a dict and/or keywords, or as its Config, not both")
            options = dict(options or {}) | more
        if isinstance(options, ResolvedSpec):  # a spec resolved already builds its drafter as it is
            return options
        return drafter_spec(drafter, options or {}).resolve(self.runner, self.tokenizer)

    def method(self, spec: str | Spec, config: DecodeConfig | None = None) -> tuple[Engine, DecodeConfig]:
        """The engine and generation config of a method spec (``'early_exit:E=24:k=4'``,
        ``'autoregressive:target_exit=8'``): the drafter's options build the drafter, ``target_exit`` goes to
        ``config`` (default: ``DecodeConfig()``)."""
        spec = parse_spec(spec) if isinstance(spec, str) else spec
        config = dataclasses.replace(config or DecodeConfig(), target_exit=spec.target_exit)
        return self.engine(spec.drafter, spec), config

    def generate(self, prompt: str | list[str], drafter: str = "autoregressive", config: DecodeConfig | None = None,
                 *, chat: bool = False, batch_size: int | None = None,
                 **options) -> GenerationResult | list[GenerationResult]:
        """Generate from text with a fresh drafter (``options`` are its options); ``.text``, ``.tokens``, ``.stats``.

        A list of prompts is decoded as a batch (``batch_engine``; ``batch_size`` rows at a time, default all of
        them, one result per prompt in order). For several prompts with one drafter in turn (e.g. SWIFT keeps its
        plan), use ``engine()``."""
        if isinstance(prompt, list | tuple) and prompt and all(isinstance(p, str) for p in prompt):
            ids = [self.encode(p, chat) for p in prompt]
            size = len(ids) if batch_size is None else batch_size  # 0 is refused below, not read as "all"
            if isinstance(size, int) and size > len(ids):
                size = len(ids)  # one row slot (engine and drafter) per row is built up front: never more than prompts
            with self.batch_engine(drafter, options, batch_size=size) as engine:
                return engine.generate(ids, config)
        if not isinstance(prompt, str):
            raise UserError(f"prompt must be text (a str) or a non-empty list of texts, not {type(prompt).__name__}; "
                            "for token ids use engine().generate(ids)")
        if batch_size not in (None, 1):
            raise UserError("batch_size needs a list of prompts")
        if not isinstance(drafter, str):
            raise UserError(f"drafter must be a drafter name (a str, e.g. 'early_exit'), not {type(drafter).__name__}"
                            f"; put a DecodeConfig in config=")
        with self.engine(drafter, options) as engine:
            return engine.generate(self.encode(prompt, chat), config)


def eos_ids(path: Path | None, tokenizer, model_config=None) -> tuple[int, ...]:
    """End-of-sequence ids from the generation config (of the folder, or of the model object) and the tokenizer."""
    ids: set[int] = set()
    try:
        eos = (GenerationConfig.from_pretrained(path) if path is not None else model_config).eos_token_id
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
    except (OSError, AttributeError):
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def load_model(model: str | os.PathLike | PreTrainedModel = "default", tokenizer=None, *,
               device: str | torch.device = "auto", dtype: str | torch.dtype = "auto", executor: str = "auto",
               threads: int = 1, compile: bool | None = None) -> LoadedModel:
    """Load a model to decode with (the Python API's edge: the names are resolved here, once).

    ``model``: a local Hugging Face folder, a hub id (org/name), ``"gemma3-270m"`` (Gemma 3 270M, Gemma Terms of
    Use), ``"default"`` (SmolLM2-135M-Instruct, fetched
    once), or a ``transformers`` model object already in memory (then ``tokenizer`` is required; its weights
    are copied into the runner's fused layout). ``device`` / ``dtype`` take names (``auto`` = CUDA + bf16 when
    available, else CPU + fp32) or torch objects; ``executor``, ``threads`` (default 1) and ``compile`` as in
    ``layerskip_core.settings``.
    """
    device, dtype = str(device), str(dtype).removeprefix("torch.")
    if isinstance(model, PreTrainedModel):
        return load_resolved(RunSettings(device, dtype, executor, threads, compile).resolve(), model, tokenizer)
    settings = ModelSettings(device, dtype, executor, threads, compile, model=str(model))
    return load_resolved(settings.resolve(), None, tokenizer)


def load_resolved(run: Resolved, model: PreTrainedModel | None = None, tokenizer=None) -> LoadedModel:
    """Load ``run.model`` (a folder), or wrap ``model`` (a transformers model object, with its ``tokenizer``), with
    settings already resolved (``layerskip_core.settings``): nothing is resolved again here."""
    run.apply_threads()
    if model is not None:
        if tokenizer is None:
            raise UserError("a model given as an object needs its tokenizer: load_model(model, tokenizer)")
        runner = Runner.from_model(model, dtype=run.dtype, device=run.device, kernel=run.kernel,
                                   executor=run.executor, compile=run.compile)
        return LoadedModel(None, runner, tokenizer, eos_ids(None, tokenizer, model.generation_config))
    path = run.model
    if path is None:
        raise UserError("no model to load: resolve a ModelSettings (it names the folder) or pass a model object")
    if tokenizer is None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a malformed tokenizer.json
            raise UserError(f"could not load a tokenizer from {path}: {type(e).__name__}: {e}") from None
    runner = Runner.from_pretrained(path, dtype=run.dtype, device=run.device, kernel=run.kernel, executor=run.executor,
                                    compile=run.compile)
    return LoadedModel(path, runner, tokenizer, eos_ids(path, tokenizer))
