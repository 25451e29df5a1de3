"""Drafters (subclasses of ``base.Drafter``), looked up by name.

Each drafter class has a ``name``, a ``Config`` dataclass (one docstring per field) and an
``aliases`` map of short option names used in compact specs such as ``early_exit:E=8:k=6``.
One spelling per option: any other name is refused with the options the drafter takes.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass

from infer.draft_vocab import DraftVocab, resolve_draft_vocab_option
from infer.drafters.autoregressive import AutoregressiveDrafter
from infer.drafters.base import DecodeState, Draft, Drafter, DraftVocabOption, VerifyOutcome
from infer.drafters.early_exit import EarlyExitDrafter
from infer.drafters.self_sd import SelfSDDrafter
from infer.drafters.swift import SwiftDrafter
from infer.plan import check_save_plan_option
from layerskip_core.errors import UserError
from layerskip_core.options import field_docs, from_text, hints

DRAFTERS: dict[str, type[Drafter]] = {
    AutoregressiveDrafter.name: AutoregressiveDrafter,
    EarlyExitDrafter.name: EarlyExitDrafter,
    SelfSDDrafter.name: SelfSDDrafter,
    SwiftDrafter.name: SwiftDrafter,
}


def drafter_class(name: str) -> type[Drafter]:
    if name not in DRAFTERS:
        raise UserError(f"unknown drafter {name!r}; choose one of: {', '.join(DRAFTERS)}")
    return DRAFTERS[name]


@dataclass(frozen=True)
class Option:
    """One settable drafter option as the CLI shows it."""

    field: str
    """Config field name (the flag is ``--field-name``)."""
    type: object
    """Declared field type."""
    docs: dict[str, str]
    """Docstring of the field per drafter that takes it."""
    defaults: dict[str, object]
    """Default of the field per drafter that takes it."""

    @property
    def owners(self) -> list[str]:
        return list(self.docs)

    def help(self) -> str:
        """The doc (once when every drafter words it alike) and each drafter's default."""
        texts = set(self.docs.values())
        doc = texts.pop() if len(texts) == 1 else " ".join(f"{d}: {t}" for d, t in self.docs.items())
        shown = {d: v for d, v in self.defaults.items() if v is not None}  # None: the doc says what applies
        if not shown:
            return doc
        defaults = ", ".join(f"{d} {v!r}" for d, v in shown.items()) if len(self.defaults) > 1 \
            else f"{next(iter(shown.values()))!r}"
        return f"{doc} (default {defaults})"


def all_options() -> dict[str, Option]:
    """Every drafter option by field name (a field several drafters share means the same in each)."""
    found: dict[str, Option] = {}
    for name, cls in DRAFTERS.items():
        types, docs = hints(cls.Config), field_docs(cls.Config)
        for f in dataclasses.fields(cls.Config):
            opt = found.setdefault(f.name, Option(f.name, types[f.name], {}, {}))
            opt.docs[name] = docs.get(f.name, "")
            opt.defaults[name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return found


def build_config(name: str, options: dict | object) -> object:
    """A drafter's Config from ``options`` (field names or aliases -> values or text; None values ignored); a
    Config already built is returned as it is (so it is built and checked once)."""
    cls = drafter_class(name)
    config = options if isinstance(options, cls.Config) else _build(name, cls, options)
    check_save_plan_option(getattr(config, "save_plan", None))  # a folder or unwritable place: before decoding
    return config


def _build(name: str, cls, options) -> object:
    if not isinstance(options, dict):
        raise UserError(f"drafter {name!r} takes a dict of options or its {cls.Config.__name__}, "
                        f"not {type(options).__name__}")
    types = hints(cls.Config)
    kwargs = {}
    for key, value in options.items():
        if value is None:
            continue
        field = cls.aliases.get(key, key)
        if field not in types:
            raise UserError(_not_an_option(name, key, sorted(set(types) | set(cls.aliases))))
        if isinstance(value, os.PathLike):  # a file option (plan, save_plan, adapter, draft_vocab) given as a Path
            value = os.fspath(value)
        if isinstance(value, str):
            value = from_text(value, types[field], f"option {key} of drafter {name!r}")
        kwargs[field] = value
    return cls.Config(**kwargs)


def _not_an_option(name: str, key: str, valid: list[str]) -> str:
    message = f"option {key!r} does not apply to drafter {name!r} (its options: {', '.join(valid) or 'none'})"
    if name == "autoregressive":  # its one knob is the generation's, not the drafter's
        message += ("; lossy early exit is spelled target_exit, a generation setting: GenerationConfig(target_exit=E), "
                    "`--target-exit E` or the spec autoregressive:target_exit=E")
    return message


def resolve_config(name: str, options: dict | object, runner, tokenizer=None) -> object:
    """``build_config``, with a ``draft_vocab`` size, file or 'auto' resolved into a ``DraftVocab`` or None for
    ``runner``'s model (``tokenizer``: lets a finetuned checkpoint use its base model's counts); a Config passed in
    is left as it was."""
    config = build_config(name, options)
    if isinstance(config, DraftVocabOption) and not isinstance(config.draft_vocab, DraftVocab | None):
        config = copy.copy(config)
        config.draft_vocab = resolve_draft_vocab_option(config.draft_vocab, runner, tokenizer)
    return config


def build_drafter(name: str, runner, options: dict | object | None = None) -> Drafter:
    """Instantiate drafter ``name`` on ``runner`` with ``options`` (a dict or its Config; see ``build_config``)."""
    return drafter_class(name)(runner, build_config(name, options or {}))


@dataclass(frozen=True)
class Spec:
    """A method as users write it, ``drafter:key=value:...``: the drafter with its options, and ``target_exit=E``
    (plain decoding of a lossy early-exit target), which belongs to the generation, not the drafter."""

    drafter: str
    """Drafter name."""
    options: dict
    """The drafter's options as typed (field names or aliases -> text)."""
    target_exit: int | None = None
    """``GenerationConfig.target_exit`` for this method (None: the full model)."""


def parse_spec(spec: str, validate: bool = True) -> Spec:
    """``'early_exit:E=8:k=6'`` -> ``Spec('early_exit', {'E': '8', 'k': '6'})``; ``validate`` builds the config now.

    ``target_exit=E`` goes to the generation.
    """
    name, *parts = spec.strip().split(":")
    drafter_class(name)
    options, target = {}, None
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise UserError(f"bad drafter spec {spec!r}: options look like name:key=value:key=value")
        if key == "target_exit":
            target = from_text(value, int, f"{spec!r}: target_exit")
            continue
        options[key] = value
    if validate:
        build_config(name, options)  # before any model is loaded
    return Spec(name, options, target)


__all__ = ["DRAFTERS", "DecodeState", "Draft", "DraftVocabOption", "Drafter", "Option", "Spec",
           "VerifyOutcome", "all_options", "build_config", "build_drafter", "drafter_class", "parse_spec",
           "resolve_config"]
