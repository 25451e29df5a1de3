"""Recipes: a YAML file read strictly into :class:`train.config.TrainConfig`, dotted ``key=value`` overrides, the
resolved config written back, and every key's documentation for ``--help-config``.

An unknown or misspelled key is refused with the nearest valid key named (also across sections, and for the
names other trainers use), before any model or data is touched.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml

from layerskip_core import inputs, options
from layerskip_core.errors import UserError
from layerskip_core.options import field_docs, hints, strip_optional, type_name
from train.config import TrainConfig

# Common names from other trainers, so a key spelt the HF/torchtune way still finds its match here.
ALIASES = {"learning_rate": "lr", "steps": "max_steps", "num_steps": "max_steps", "train_steps": "max_steps",
           "batch_size": "micro_batch_size", "per_device_train_batch_size": "micro_batch_size",
           "gradient_accumulation_steps": "grad_accum_steps", "seq_len": "block_size", "max_seq_len": "block_size",
           "max_length": "block_size", "warmup": "warmup_steps", "lr_scheduler": "schedule", "clip": "max_grad_norm",
           "model_name_or_path": "name_or_path", "exit_layers": "exits", "prob": "p_max", "rank": "r",
           "output": "output_dir", "save_steps": "save_every", "eval_steps": "eval_every", "logging_steps": "log_every"}


def _dotted_keys(cls=None, prefix: str = "") -> list[str]:
    """Every key of the config as ``section.key`` (sections of dataclasses, not list items)."""
    cls = cls or TrainConfig
    keys = []
    for name, tp in hints(cls).items():
        keys.append(f"{prefix}{name}")
        if dataclasses.is_dataclass(tp):
            keys.extend(_dotted_keys(tp, f"{prefix}{name}."))
    return keys


def _nearest(key: str, valid: list[str], prefix: str = "") -> str:
    """The ``; did you mean 'optim.lr'?`` tail of an unknown-key message."""
    leaf = ALIASES.get(key, key)
    elsewhere = [k for k in _dotted_keys() if k.rsplit(".", 1)[-1] == leaf and k != f"{prefix}.{leaf}".lstrip(".")]
    if elsewhere:  # the right name in the wrong section: output_dir -> checkpoint.output_dir
        return f"; did you mean '{elsewhere[0]}'?" if len(elsewhere) == 1 else \
            "; did you mean one of " + ", ".join(f"'{k}'" for k in elsewhere) + "?"
    return options.nearest(key, valid, prefix, ALIASES)


def build(cls, raw: Any, where: str = ""):
    """Build dataclass ``cls`` from a mapping, refusing unknown keys (nearest valid key named)."""
    return options.build(cls, raw, where, _nearest)


def _default_at(parts: list[str]) -> Any:
    obj: Any = TrainConfig()
    for part in parts:
        obj = obj[int(part)] if isinstance(obj, list) else getattr(obj, part)
    if isinstance(obj, list):
        return [to_dict(o) if dataclasses.is_dataclass(o) else o for o in obj]
    return to_dict(obj) if dataclasses.is_dataclass(obj) else obj


def _set_dotted(raw: dict, dotted: str, value: Any) -> None:
    """Apply ``a.b.c=value`` to the raw recipe dict; list items are addressed by index (``data.sources.0.path``)."""
    parts = dotted.split(".")
    node: Any = raw
    tp: Any = TrainConfig
    for i, part in enumerate(parts):
        here = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not (part.isascii() and part.isdigit() and int(part) < len(node)):
                raise UserError(f"override {dotted}: '{'.'.join(parts[:i])}' is a list of {len(node)} items; "
                                f"address them by index 0..{len(node) - 1}")
            key: Any = int(part)
            child_tp = typing.get_args(tp)[0]
        else:
            if not dataclasses.is_dataclass(tp):
                raise UserError(f"override {dotted}: '{'.'.join(parts[:i])}' has no sub-keys")
            names = [f.name for f in dataclasses.fields(tp)]
            if part not in names:
                raise UserError(f"unknown config key '{here}' in override {dotted}"
                                f"{_nearest(part, names, '.'.join(parts[:i]))}")
            key = part
            child_tp = strip_optional(hints(tp)[part])
        if i == len(parts) - 1:
            leaf_tp = child_tp if isinstance(node, list) else hints(tp)[part]
            try:
                # type errors are blamed on the override, not the recipe
                options.convert(value, leaf_tp, here, _nearest)
            except UserError as e:
                raise UserError(f"command-line override {dotted}={_show(value)}: {e}") from None
            node[key] = value
            return
        child = node[key] if isinstance(node, list) else node.get(key)
        if child is None:
            child = _default_at(parts[: i + 1])
            if not isinstance(child, (dict, list)):
                raise UserError(f"override {dotted}: '{here}' has no sub-keys")
            node[key] = child
        node, tp = child, child_tp


def _show(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def parse_override(text: str) -> tuple[str, Any]:
    """``key.sub=value`` with the value read as YAML (``1e-4``, ``true``, ``[8, 16]``, ``null``)."""
    if "=" not in text:
        raise UserError(f"override {text!r} is not of the form key.sub=value")
    key, _, value = text.partition("=")
    key = key.strip()
    if not key:
        raise UserError(f"override {text!r} has no key")
    try:
        return key, options.parse_text(value)
    except UserError as e:
        raise UserError(f"override {text!r}: {e}") from None


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        raise UserError(f"config file {path} is a directory; pass a recipe file (recipes/<name>.yaml)")
    data = inputs.read_bytes(path, "config file", "pass a recipe file (recipes/<name>.yaml)")  # no FIFO, no device
    try:
        raw = options.load_yaml(data.decode("utf-8"))  # strict: a key or section given twice is refused
    except UnicodeDecodeError as e:
        line = e.object[:e.start].count(b"\n") + 1
        raise UserError(f"{path}: not UTF-8 text (line {line}); save the recipe as UTF-8") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise UserError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if raw is None:  # not silently the defaults: an empty file is more likely a mistake than a choice
        raise UserError(f"config file {path} is empty (or only comments); give a recipe that sets at least the "
                        "model and data (see recipes/*.yaml; --help-config lists every key)")
    if not isinstance(raw, dict):
        raise UserError(f"{path}: the top level must be a mapping of sections (model:, data:, optim:, ...)")
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Read a recipe, apply ``key=value`` overrides, and build a checked :class:`TrainConfig`."""
    raw = read_yaml(path) if path is not None else {}
    try:
        build(TrainConfig, copy.deepcopy(raw))  # the recipe on its own: its errors name the file
    except UserError as e:
        recipe_error: UserError | None = UserError(f"{path}: {e}" if path is not None else str(e))
    else:
        recipe_error = None
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(raw, key, value)
    try:
        return build(TrainConfig, raw)
    except UserError as e:
        if recipe_error is not None and str(e) in str(recipe_error):
            raise recipe_error from None
        # the recipe alone is fine (or fails differently): the command-line overrides made it invalid
        shown = " ".join(overrides)
        raise UserError(f"{e} (after the command-line overrides: {shown})" if overrides else str(e)) from None


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def dump_config(cfg: TrainConfig, path: str | Path) -> None:
    """Write the resolved config as YAML that :func:`load_config` reads back to an equal config."""
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")


def describe(cls=TrainConfig, prefix: str = "") -> list[str]:
    """One line per leaf key: ``dotted.key (type, default): doc``."""
    lines = []
    docs = field_docs(cls)
    field_types = hints(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = field_types[f.name]
        if dataclasses.is_dataclass(tp):
            lines.append(f"{key}:  {docs.get(f.name, '')}")
            lines.extend(describe(tp, key + "."))
            continue
        default = getattr(defaults, f.name)
        if isinstance(default, list) and default and dataclasses.is_dataclass(default[0]):
            default = [to_dict(d) for d in default]
            lines.append(f"{key} ({type_name(tp)}, default {default}): {docs.get(f.name, '')}")
            lines.extend(describe(typing.get_args(tp)[0], key + "[i]."))
            continue
        lines.append(f"{key} ({type_name(tp)}, default {default!r}): {docs.get(f.name, '')}")
    return lines
