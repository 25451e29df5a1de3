"""Drafters behind one protocol, looked up by name.

Each drafter class has a ``name``, a ``Config`` dataclass (one docstring per field) and an
optional ``aliases`` map of short option names used in compact specs such as
``early_exit:E=8:k=6``.
"""

from __future__ import annotations

import typing
import warnings

from core.errors import UserError
from infer.drafters.autoregressive import AutoregressiveDrafter
from infer.drafters.base import DecodeState, Draft, Drafter, VerifyOutcome
from infer.drafters.early_exit import EarlyExitDrafter
from infer.drafters.self_sd import SelfSDDrafter
from infer.drafters.swift import SwiftDrafter

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


def field_docs(config_cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass (the string literal under each field), for --help."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(config_cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def all_options() -> dict[str, tuple[object, str, list[str]]]:
    """Every drafter option: field -> (type, help, drafters that take it)."""
    types: dict[str, object] = {}
    docs: dict[str, dict[str, str]] = {}
    for name, cls in DRAFTERS.items():
        hints = typing.get_type_hints(cls.Config)
        field_doc = field_docs(cls.Config)
        for field in hints:
            types.setdefault(field, hints[field])
            docs.setdefault(field, {})[name] = field_doc.get(field, "")
    out = {}
    for field, per_drafter in docs.items():
        texts = set(per_drafter.values())
        doc = texts.pop() if len(texts) == 1 else " ".join(f"{d}: {t}" for d, t in per_drafter.items())
        out[field] = (types[field], doc, list(per_drafter))
    for name, cls in DRAFTERS.items():  # old names, still accepted for one release
        for old, new in getattr(cls, "deprecated", {}).items():
            if old not in out and old not in {a for c in DRAFTERS.values() for a in getattr(c, "aliases", {})}:
                out[old] = (types[new], f"deprecated: use --{new.replace('_', '-')}", [name])
    return out


def _convert(value: str, annotation) -> object:
    """Turn a spec string into the field's declared type (int, float, bool, str, or Optional)."""
    kind = annotation if isinstance(annotation, type) else None
    text = str(annotation)
    if kind is None:
        kind = next((t for t in (bool, int, float) if t.__name__ in text.split(" | ")), str)
    if kind is bool:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(value)
    return kind(value)


def build_config(name: str, options: dict) -> object:
    """A drafter's Config from ``options`` (field names or aliases; None values ignored)."""
    cls = drafter_class(name)
    aliases = dict(getattr(cls, "aliases", {}))
    for old, new in getattr(cls, "deprecated", {}).items():
        if old in options and options[old] is not None:
            warnings.warn(f"option {old!r} of drafter {name!r} is deprecated and will be removed in the next "
                          f"release; use {new!r}", FutureWarning, stacklevel=2)
            aliases[old] = new
    hints = typing.get_type_hints(cls.Config)
    fields = set(hints)
    kwargs = {}
    for key, value in options.items():
        if value is None:
            continue
        field = aliases.get(key, key)
        if field not in fields:
            valid = ", ".join(sorted(fields | set(aliases))) or "none"
            raise UserError(f"option {key!r} does not apply to drafter {name!r} (its options: {valid})")
        if isinstance(value, str) and hints[field] is not str:
            try:
                value = _convert(value, hints[field])
            except ValueError:
                kind = next((w for t, w in (("bool", "true or false"), ("int", "an integer"), ("float", "a number"))
                             if t in str(hints[field])), str(hints[field]))
                raise UserError(f"option {key}={value!r} of drafter {name!r}: expected {kind}") from None
        kwargs[field] = value
    return cls.Config(**kwargs)


def build_drafter(name: str, runner, options: dict | None = None):
    """Instantiate drafter ``name`` on ``runner`` with ``options`` (see ``build_config``)."""
    config = build_config(name, options or {})
    return drafter_class(name)(runner, config)


def parse_spec(spec: str, validate: bool = True) -> tuple[str, dict[str, str]]:
    """``'early_exit:E=8:k=6'`` -> ``('early_exit', {'E': '8', 'k': '6'})``; ``validate`` builds the config now."""
    name, *parts = spec.strip().split(":")
    drafter_class(name)
    options = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise UserError(f"bad drafter spec {spec!r}: options look like name:key=value:key=value")
        options[key] = value
    if validate:
        build_config(name, options)  # before any model is loaded
    return name, options


__all__ = ["DRAFTERS", "DecodeState", "Draft", "Drafter", "VerifyOutcome", "all_options", "build_config",
           "build_drafter", "drafter_class", "field_docs", "parse_spec"]
