"""The drafters by name, and their options as the command line shows them.

Each drafter class has a ``name``, a ``Config`` dataclass (one docstring per field), an ``aliases`` map of the
short option names of compact specs (``early_exit:E=8:k=6``; ``infer.drafters.spec`` turns either into a spec) and
its ``examples`` (``infer.drafters.examples``: what the tests that run every drafter and the GPU check run it with).
Adding a drafter is its file and one entry in ``DRAFTERS``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from infer.drafters.autoregressive import AutoregressiveDrafter
from infer.drafters.base import Drafter, DrafterStats
from infer.drafters.dynamic_exit import DynamicExitDrafter
from infer.drafters.early_exit import EarlyExitDrafter, QuantSelfDrafter
from infer.drafters.examples import ExampleModel
from infer.drafters.self_sd import SelfSDDrafter
from infer.drafters.swift import SwiftConfig, SwiftDrafter
from infer.drafters.swift_paper import SwiftPaperDrafter
from layerskip_core.errors import UserError
from layerskip_core.options import field_docs, hints

DRAFTERS: dict[str, type[Drafter]] = {
    AutoregressiveDrafter.name: AutoregressiveDrafter,
    EarlyExitDrafter.name: EarlyExitDrafter,
    QuantSelfDrafter.name: QuantSelfDrafter,
    DynamicExitDrafter.name: DynamicExitDrafter,
    SelfSDDrafter.name: SelfSDDrafter,
    SwiftDrafter.name: SwiftDrafter,
}


def drafter_class(name: str) -> type[Drafter]:
    """The drafter class registered as ``name``; an unknown name is refused with the names there are."""
    if name not in DRAFTERS:
        raise UserError(f"unknown drafter {name!r}; choose one of: {', '.join(DRAFTERS)}")
    return DRAFTERS[name]


def example_cases(model: ExampleModel, main_only: bool = False) -> dict[str, tuple[str, dict]]:
    """Every registered drafter's examples for ``model`` (its class's ``examples``), in registry order, as case ->
    (drafter name, options): a drafter's main example is the case of its name, a variant ``NAME_VARIANT``;
    ``main_only``: the main one of each. A class without examples of its own (not inherited) is refused."""
    out: dict[str, tuple[str, dict]] = {}
    for name, cls in DRAFTERS.items():
        if "examples" not in vars(cls):
            raise TypeError(f"drafter {name!r} ({cls.__name__}) names no examples of its own: give its class an "
                            "examples classmethod (infer.drafters.examples)")
        variants = cls.examples(model) if callable(cls.examples) else cls.examples
        if "" not in variants:
            raise TypeError(f"drafter {name!r}'s examples have no main one (the key '')")
        for variant, options in variants.items():
            if variant == "" or not main_only:
                out[f"{name}_{variant}" if variant else name] = (name, dict(options))
    return out


def class_for(name: str, config) -> type[Drafter]:
    """The class that runs drafter ``name`` with ``config``: SWIFT's reference mode (``paper=true``) is a class of its
    own (``infer.drafters.swift_paper``)."""
    if isinstance(config, SwiftConfig) and config.paper:
        return SwiftPaperDrafter
    return drafter_class(name)


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


def stats_from_dict(values: dict) -> DrafterStats:
    """A drafter's statistics read back from their JSON form (``GenerationStats.to_dict``): the stats class
    (``DrafterStats`` or a registered drafter's subclass of it) whose fields are exactly ``values``' keys."""
    classes, found = [DrafterStats], []
    while classes:
        c = classes.pop()
        found.append(c)
        classes += c.__subclasses__()
    for c in found:
        if {f.name for f in dataclasses.fields(c)} == set(values):
            return c(**values)
    raise UserError(f"no drafter reports the statistics {sorted(values)}: the records were written by another version")
