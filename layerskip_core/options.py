"""Dataclass configs <-> YAML, ``key=value`` text and argparse flags: one implementation.

Every config in the toolkit (the training recipe, each drafter's options, the bench settings) is a
dataclass whose fields carry a docstring (the string literal right under the field). This module
reads those docstrings for ``--help``, converts user values to the declared field types strictly
(unknown keys and wrong types are a one-line :class:`UserError` naming the nearest valid key), and
turns a dataclass into a group of argparse flags.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import math
import textwrap
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal

import yaml

from layerskip_core.errors import UserError


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass and of the dataclasses it extends (a subclass's doc wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(own_field_docs(klass))
    return docs


def own_field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of the fields ``cls`` itself declares: the string literal right after each field
    (whitespace folded). They are read from the source, so an install without it (only .pyc files) is refused
    loudly rather than showing help with every text gone."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError) as e:
        raise RuntimeError(f"cannot read the field docs of {cls.__module__}.{cls.__qualname__}: its source is not "
                           f"available ({e}); install the toolkit with its .py files") from None
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def hints(cls: type) -> dict[str, Any]:
    """Resolved field annotations of a dataclass (``from __future__ import annotations`` safe)."""
    return typing.get_type_hints(cls)


def strip_optional(tp: Any) -> Any:
    """``X | None`` -> ``X``; anything else unchanged."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def type_name(tp: Any) -> str:
    """How a field type reads in messages and ``--help`` (int, float | None, list of int, ...)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def nearest(key: str, valid: list[str], prefix: str = "", aliases: Mapping[str, str] | None = None) -> str:
    """The ``; did you mean 'optim.lr'?`` tail of an unknown-key message (aliases: other tools' names)."""
    known = {a: t for a, t in (aliases or {}).items() if t in valid}
    close = difflib.get_close_matches(key, valid + list(known), n=1, cutoff=0.5)
    pre = f"{prefix}." if prefix else ""
    if close:
        return f"; did you mean '{pre}{known.get(close[0], close[0])}'?"
    return f"; valid keys under '{prefix or 'top level'}': " + ", ".join(valid)


Suggest = Callable[[str, list[str], str], str]
"""``suggest(unknown_key, valid_keys, section) -> message tail``, e.g. :func:`nearest`."""


def convert(value: Any, tp: Any, where: str, suggest: Suggest | None = None) -> Any:
    """Check ``value`` (a YAML scalar, list or mapping) against annotation ``tp``; convert where unambiguous.

    ``suggest`` words the hint of an unknown key in a nested section (default: :func:`nearest`).
    """
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return convert(value, arg, where, suggest)
            except UserError as e:
                errors.append(str(e))
        raise UserError(errors[0] if errors else f"{where}: expected {type_name(tp)}, got {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UserError(f"{where}: {value!r} is not one of {', '.join(map(repr, choices))}{hint}")
        return value
    if origin in (list, tuple):
        item = typing.get_args(tp)[0]
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{where}: expected a list ({type_name(tp)}), got {value!r}")
        items = [convert(v, item, f"{where}[{i}]", suggest) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, where, suggest)
    return _scalar(value, tp, where)


def _scalar(value: Any, tp: Any, where: str) -> Any:
    if tp is bool:
        if not isinstance(value, bool):
            raise UserError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool):
            raise UserError(f"{where}: expected a number, got {value!r}")
        number = None
        if isinstance(value, (int, float)):
            number = float(value) if abs(value) < 2**1024 else math.inf
        elif isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise UserError(f"{where}: expected a number, got {value!r}")
        return finite(number, where)
    if tp is str:
        if isinstance(value, (dict, list)) or value is None:
            raise UserError(f"{where}: expected a string, got {value!r}")
        return str(value)
    if tp is Any:
        return value
    raise TypeError(f"unsupported annotation {tp!r} at {where}")  # a bug in a config class, not user input


def finite(value: float, where: str) -> float:
    """``value`` when it is a finite number; NaN, infinity and text that overflows to it (``1e400``) are refused."""
    if not math.isfinite(value):
        raise UserError(f"{where}: must be a finite number, got {value} (infinity and NaN are not settings)")
    return value


def check_fields(obj: Any, label: str) -> None:
    """Refuse (a UserError naming ``label`` and the field) a dataclass instance built in Python whose fields do not
    hold their declared types: a boolean or fraction for an integer, a string or NaN/infinity for a number, a dict
    for a string. Converts nothing (``convert`` does, for text); fields of a class type take its instances."""
    types_ = hints(type(obj))
    for f in dataclasses.fields(obj):
        tp, value = types_[f.name], getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"{label}: {f.name} must be a finite number, got {value}")
        if isinstance(value, (list, tuple)) and any(isinstance(x, float) and not math.isfinite(x) for x in value):
            raise UserError(f"{label}: {f.name} must hold finite numbers, got {value}")
        if not _holds(value, tp):
            raise UserError(f"{label}: {f.name} must be {type_name(tp)}, got {value!r} ({type(value).__name__})")


def _holds(value: Any, tp: Any) -> bool:
    """Whether ``value`` is a value of annotation ``tp`` (strictly: bool is not int, float must be finite)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_holds(value, arg) for arg in typing.get_args(tp))
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin in (list, tuple):
        item = typing.get_args(tp)[0]
        return isinstance(value, (list, tuple)) and all(_holds(v, item) for v in value)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if tp is Any:
        return True
    return isinstance(value, origin or tp)


class StrictLoader(yaml.SafeLoader):
    """YAML's safe loader with a key written twice in one mapping refused (a section or key given twice would
    otherwise silently take the last one), as the project's JSON reader refuses it."""

    def construct_mapping(self, node, deep=False):  # noqa: ANN001 (PyYAML's signature)
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # an unhashable key: the base loader words that error
                break
            if first is not key_node:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice (lines {first.start_mark.line + 1} and "
                    f"{key_node.start_mark.line + 1}); keep one", key_node.start_mark)
        return super().construct_mapping(node, deep)


def load_yaml(text: str) -> Any:
    """``text`` read as YAML strictly (``StrictLoader``: no key twice in a mapping); a nesting too deep for the
    parser is a ``yaml.YAMLError`` too, never a RecursionError."""
    try:
        return yaml.load(text, Loader=StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except RecursionError:
        raise yaml.YAMLError("nested too deeply") from None


def parse_text(text: str) -> Any:
    """A value typed by a user (``8``, ``3e-4``, ``true``, ``[8, 16]``, ``null``), read as YAML; else the string."""
    if not text.strip():
        return ""
    try:
        return load_yaml(text)
    except yaml.YAMLError as e:
        if isinstance(e, yaml.constructor.ConstructorError) and "given twice" in str(e.problem):
            raise UserError(f"{text!r}: {e.problem}") from None
        return text


def from_text(text: str, tp: Any, where: str) -> Any:
    """Convert a user-typed string to field type ``tp`` (strings stay strings even if they look like YAML)."""
    if strip_optional(tp) is str:
        return text
    return convert(parse_text(text), tp, where)


def build(cls: type, raw: Any, where: str = "", suggest: Suggest | None = None):
    """Build dataclass ``cls`` from a mapping, refusing unknown keys (``suggest`` names the nearest valid one)."""
    label = where or "config"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"{label}: expected a mapping of keys, got {raw!r}")
    field_types = hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            hint = (suggest or nearest)(str(key), names, where)
            raise UserError(f"unknown config key '{path}'{hint}")
        kwargs[key] = convert(value, field_types[key], path, suggest)
    return cls(**kwargs)  # __post_init__ checks the section's invariants


def add_flag(group: argparse._ActionsContainer, name: str, tp: Any, help: str) -> None:
    """A ``--name`` flag (underscores become dashes) parsed to field type ``tp``; default None (= not given)."""
    tp = strip_optional(tp)
    flag = "--" + name.replace("_", "-")
    help = help.replace("%", "%%")  # a docstring's "1%" is text, not an argparse format
    if tp is bool:
        group.add_argument(flag, dest=name, default=None, action=argparse.BooleanOptionalAction, help=help)
    elif typing.get_origin(tp) is Literal:
        group.add_argument(flag, dest=name, default=None, choices=list(typing.get_args(tp)), help=help)
    else:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        shown = "str" if str in args else type_name(tp)  # a union given on the command line is text
        group.add_argument(flag, dest=name, default=None, metavar=shown.upper().replace(" ", "_"),
                           type=_flag_parser(tp, flag), help=help)


def add_dataclass_flags(group: argparse._ActionsContainer, cls: type, skip: tuple[str, ...] = (),
                        seen: set[str] | None = None, suffix: str = "", defaults: Any = None) -> list[str]:
    """One ``--field-name`` flag per field of ``cls`` (default None = the dataclass default applies).

    Fields in ``skip`` and flags already in ``seen`` (a flag shared by several configs is added once)
    are left out; ``suffix`` is appended to each help text; ``defaults`` (an instance of ``cls``) gives the
    defaults a command uses instead of the class's (shown in the help; ``from_args`` applies them). Returns
    the destinations added.
    """
    docs, field_types, added = field_docs(cls), hints(cls), []
    for f in dataclasses.fields(cls):
        if f.name in skip or (seen is not None and f.name in seen):
            continue
        if defaults is not None:
            default = getattr(defaults, f.name)
        else:
            default = f.default if f.default is not dataclasses.MISSING else None
        shown = "" if default is None and "None" in docs.get(f.name, "") else f" (default {default!r})"
        add_flag(group, f.name, field_types[f.name], f"{docs.get(f.name, '')}{shown}{suffix}")
        added.append(f.name)
        if seen is not None:
            seen.add(f.name)
    return added


def from_args(cls: type, args: argparse.Namespace, defaults: Any = None, skip: tuple[str, ...] = ()):
    """An instance of dataclass ``cls`` from flags made by ``add_dataclass_flags``: the flags given on the command
    line over ``defaults`` (an instance; default: the class defaults). ``__post_init__`` checks the result."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
             if f.name not in skip and getattr(args, f.name, None) is not None}
    return dataclasses.replace(defaults, **given) if defaults is not None else cls(**given)


def _flag_parser(tp: Any, flag: str):
    def parse(text: str) -> Any:
        try:
            return from_text(text, tp, flag)
        except UserError as e:  # argparse prints "argument --x: <message>" and exits 2
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{flag}: ")) from None

    return parse
