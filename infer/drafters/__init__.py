"""Drafters behind one protocol, looked up by name.

Each drafter class has a ``name``, a ``Config`` dataclass (one docstring per field) and an
optional ``aliases`` map of short option names used in compact specs such as
``early_exit:E=8:k=6``.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

from infer.drafters.autoregressive import AutoregressiveDrafter
from infer.drafters.base import DecodeState, Draft, Drafter, VerifyOutcome
from infer.drafters.early_exit import EarlyExitDrafter
from infer.drafters.self_sd import SelfSDDrafter
from infer.drafters.swift import SwiftDrafter
from layerskip_core.errors import UserError
from layerskip_core.options import field_docs, from_text, hints

DRAFTERS: dict[str, type] = {
    AutoregressiveDrafter.name: AutoregressiveDrafter,
    EarlyExitDrafter.name: EarlyExitDrafter,
    SelfSDDrafter.name: SelfSDDrafter,
    SwiftDrafter.name: SwiftDrafter,
}


def drafter_class(name: str) -> type:
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
    deprecated_for: str | None = None
    """For an old name kept one release: the field it now maps to."""

    @property
    def owners(self) -> list[str]:
        return list(self.docs)

    def help(self) -> str:
        """The doc (once when every drafter words it alike) and each drafter's default."""
        if self.deprecated_for:
            return f"deprecated: use --{self.deprecated_for.replace('_', '-')}"
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
    aliases = {a for c in DRAFTERS.values() for a in getattr(c, "aliases", {})}
    for name, cls in DRAFTERS.items():  # old names, still accepted for one release
        for old, new in getattr(cls, "deprecated", {}).items():
            if old not in found and old not in aliases:
                found[old] = Option(old, found[new].type, {name: ""}, {name: None}, deprecated_for=new)
    return found


def build_config(name: str, options: dict) -> object:
    """A drafter's Config from ``options`` (field names or aliases; None values ignored)."""
    cls = drafter_class(name)
    aliases = dict(getattr(cls, "aliases", {}))
    for old, new in getattr(cls, "deprecated", {}).items():
        if old in options and options[old] is not None:
            warnings.warn(f"option {old!r} of drafter {name!r} is deprecated and will be removed in the next "
                          f"release; use {new!r}", FutureWarning, stacklevel=2)
            aliases[old] = new
    types = hints(cls.Config)
    fields = set(types)
    kwargs = {}
    for key, value in options.items():
        if value is None:
            continue
        if name == "autoregressive" and key in LEGACY_TARGET_EXIT:
            raise UserError("lossy early exit is a generation setting now: GenerationConfig(target_exit=E), "
                            "`--target-exit E` or the spec autoregressive:target_exit=E")
        field = aliases.get(key, key)
        if field not in fields:
            valid = ", ".join(sorted(fields | set(aliases))) or "none"
            raise UserError(f"option {key!r} does not apply to drafter {name!r} (its options: {valid})")
        if isinstance(value, str):
            value = from_text(value, types[field], f"option {key} of drafter {name!r}")
        kwargs[field] = value
    return cls.Config(**kwargs)


def build_drafter(name: str, runner, options: dict | None = None):
    """Instantiate drafter ``name`` on ``runner`` with ``options`` (see ``build_config``)."""
    config = build_config(name, options or {})
    return drafter_class(name)(runner, config)


LEGACY_TARGET_EXIT = ("E", "exit_layer")
"""Options of ``autoregressive`` that meant its lossy target exit before ``target_exit`` (accepted with a warning)."""


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

    ``target_exit=E`` goes to the generation; ``autoregressive:E=8`` (its old spelling) too, with a warning.
    """
    name, *parts = spec.strip().split(":")
    drafter_class(name)
    options, target = {}, None
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise UserError(f"bad drafter spec {spec!r}: options look like name:key=value:key=value")
        if key == "target_exit" or (name == "autoregressive" and key in LEGACY_TARGET_EXIT):
            if key != "target_exit":
                warnings.warn(f"{spec!r}: the lossy exit of plain decoding is now spelled "
                              f"{name}:target_exit={value} (the old {key}= is accepted for one release)",
                              FutureWarning, stacklevel=2)
            target = from_text(value, int, f"{spec!r}: target_exit")
            continue
        options[key] = value
    if validate:
        build_config(name, options)  # before any model is loaded
    return Spec(name, options, target)


__all__ = ["DRAFTERS", "DecodeState", "Draft", "Drafter", "Option", "Spec", "VerifyOutcome", "all_options",
           "build_config", "build_drafter", "drafter_class", "parse_spec"]
