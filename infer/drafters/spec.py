"""A drafter spec: the drafter's name and its checked Config, made in one place from any way of writing it.

Written as compact text (``early_exit:E=8:k=6``, ``autoregressive:target_exit=8``), as command-line flags or as
Python keywords, a spec is built here once: short option names (``E``, ``k``, ...: each drafter's ``aliases``)
become field names, text becomes the field's type, and anything else is refused with the options the drafter
takes. Resolving a spec against a loaded model (``Spec.resolve``) yields the frozen inputs the drafter's
constructor takes (``infer.drafters.base.DraftInputs``: draft head, plan, adapter); nothing reads a spec back.

What the caller set is kept apart from what holds its default (``Spec.given``): an exit adapter's tuned setting
(``layerskip_core.adapter_spec.TunedDecoding``, in its header) fills only the options left unset, so an explicit
option always wins. ``best`` (``BEST``) is the short spelling of a model's best measured setting: early exit with
the adapter shipped for the model at the setting it was tuned with, said once with its source and speed-up.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from infer.assets.adapter import adapter_path
from infer.drafters.base import Drafter, DraftInputs
from infer.drafters.gate import RememberOption
from infer.drafters.registry import DRAFTERS, all_options, class_for, drafter_class
from infer.model.plan import LayerPlan, check_save_plan_option
from layerskip_core.draft_vocab import DraftVocab
from layerskip_core.errors import UserError
from layerskip_core.options import from_text, hints

OBJECTS = {"draft_vocab": DraftVocab, "plan": LayerPlan}
"""Options a Python caller may give as an object instead of text (a file, a size): field -> its object type."""
BEST = "best"
"""The drafter name that stands for a model's best measured setting: ``early_exit`` with ``adapter=default`` (the
adapter shipped for the model) at the setting the adapter was tuned with (its header's ``decoding``)."""
BEST_DRAFTER = "early_exit"
"""The drafter ``best`` runs."""
REPO = Path(__file__).resolve().parents[2]
"""The checkout (or installed tree) a shipped file's path is shown relative to."""


class Said:
    """The runners something was said on, held weakly (a runner that ends is forgotten); a copy or a pickle starts
    empty, so a spec stays copyable and picklable."""

    def __init__(self):
        self.runners: weakref.WeakSet = weakref.WeakSet()

    def first(self, runner) -> bool:
        """True the first time ``runner`` is asked about (then remembered)."""
        if runner in self.runners:
            return False
        self.runners.add(runner)
        return True

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.runners = weakref.WeakSet()


@dataclass(frozen=True)
class Spec:
    """One drafter as chosen: its name, its Config (built and checked), and ``target_exit`` (plain decoding of a
    lossy early-exit target), which belongs to the generation, not the drafter."""

    drafter: str
    """Drafter name (``infer.drafters.registry.DRAFTERS``)."""
    config: object
    """The drafter's Config."""
    target_exit: int | None = None
    """``DecodeConfig.target_exit`` for this method (None: the full model)."""
    given: frozenset[str] = frozenset()
    """Config fields set by the caller (the others hold their defaults)."""
    vocab: DraftVocab | None = None
    """A draft vocabulary given as an object, used instead of ``config.draft_vocab`` (which then is not read)."""
    plan: LayerPlan | None = None
    """A skip plan given as an object, used instead of ``config.plan``'s file."""
    best: bool = False
    """Written as ``best``: the model's best measured setting (its shipped adapter's tuned setting) is required."""
    said: Said = field(default_factory=Said, compare=False, repr=False)
    """Runners this spec (and the specs made from it) has announced its tuned setting on: said once per model."""

    @property
    def cls(self) -> type[Drafter]:
        """The class that runs this spec (``infer.drafters.registry.class_for``)."""
        return class_for(self.drafter, self.config)

    @property
    def options(self) -> dict:
        """The options the caller set, by field name (objects included): what ``drafter_spec`` rebuilds this from."""
        objects = {"draft_vocab": self.vocab, "plan": self.plan}
        return {f: getattr(self.config, f) for f in sorted(self.given) if f not in objects or objects[f] is None} \
            | {f: value for f, value in objects.items() if value is not None}

    def resolve(self, runner, tokenizer=None) -> ResolvedSpec:
        """This spec on ``runner``'s model: its draft head, plan and adapter made once (``tokenizer``: lets a
        finetuned checkpoint use its base model's token counts), for every drafter built from it. An exit adapter's
        tuned setting fills the options left unset (``tuned``)."""
        if self.best:
            check_best(runner)
        inputs = self.cls.resolve(self, runner, tokenizer)
        return ResolvedSpec(self.tuned(inputs.adapter, runner), inputs)

    def tuned(self, adapter, runner=None) -> Spec:
        """This spec with ``adapter``'s tuned setting (``ExitAdapter.decoding``) in every option the caller left
        unset, checked again; said once per runner on stderr (``best``: its name, source and measured speed-up)."""
        decoding = getattr(adapter, "decoding", None)
        if self.best and decoding is None:
            raise UserError(f"drafter {BEST!r}: {shown(adapter.source)} carries no tuned setting, so there is no best "
                            "measured setting to use; give the drafter's options yourself (--drafter early_exit "
                            "--adapter FILE ...), or tune it: scripts/best_fixed.py --write-adapter")
        unset = {} if decoding is None else \
            {k: v for k, v in decoding.settings.items() if k not in self.given and hasattr(self.config, k)}
        spec = dataclasses.replace(self, config=dataclasses.replace(self.config, **unset)) if unset else self
        check_unused(spec)
        if decoding is not None and runner is not None and (unset or self.best) and self.said.first(runner):
            print(tuned_note(spec, adapter, unset), file=sys.stderr, flush=True)
        return spec

    def build(self, runner) -> Drafter:
        """A drafter of this spec on ``runner`` (resolved now; resolve once to build several)."""
        return self.resolve(runner).build(runner)

    def replace(self, **fields) -> Spec:
        """This spec with some Config fields set (checked again)."""
        return dataclasses.replace(self, config=dataclasses.replace(self.config, **fields),
                                   given=self.given | frozenset(fields))

    def for_warm_up(self) -> Spec:
        """The spec of an untimed run: nothing remembered is read or written, nothing saved
        (``Drafter.WARM_UP``)."""
        return self.replace(**self.cls.WARM_UP)

    def remembering(self, mode: str) -> Spec:
        """``remember=mode`` for a drafter that remembers across commands and was not told otherwise."""
        if not isinstance(self.config, RememberOption) or "remember" in self.given:
            return self
        return self.replace(remember=mode)


@dataclass(frozen=True)
class ResolvedSpec:
    """A spec resolved against a loaded model: what builds its drafters, as often as needed."""

    spec: Spec
    """The spec."""
    inputs: DraftInputs
    """Its draft head, plan and adapter on the model (frozen)."""

    def build(self, runner) -> Drafter:
        """A fresh drafter (its own state) on ``runner``, the model the spec was resolved on."""
        return self.spec.cls(runner, self.spec.config, self.inputs)


def build_drafter(name: str | Spec, runner, options: dict | object | None = None) -> Drafter:
    """A drafter on ``runner``: a spec, or a drafter name with its ``options`` (see ``drafter_spec``; or a spec
    resolved already)."""
    if isinstance(name, Spec):
        return name.build(runner)
    if isinstance(options, ResolvedSpec):
        _same_drafter(name, options.spec)
        return options.build(runner)
    return drafter_spec(name, options).build(runner)


def _same_drafter(name: str, spec: Spec) -> None:
    if spec.drafter != name and not (name == BEST and spec.best):
        raise UserError(f"a spec of drafter {spec.drafter!r} was given for drafter {name!r}")


def build_config(name: str, options: dict | object) -> object:
    """A drafter's Config from ``options`` (field names or short names -> values or text; None values ignored); a
    Config already built is returned as it is (so it is built and checked once)."""
    return drafter_spec(name, options).config


def drafter_spec(name: str, options: dict | object | None = None, target_exit: int | None = None) -> Spec:
    """The spec of drafter ``name`` with ``options``: a dict (field names or short names -> values or text; None
    values ignored; a ``DraftVocab`` or ``LayerPlan`` object for draft_vocab or plan), or its Config already built.
    ``best`` (``BEST``) is early exit with the shipped adapter at its tuned setting; ``options`` override it."""
    if name == BEST and not isinstance(options, Spec):
        if options is not None and not isinstance(options, dict):
            raise UserError(f"drafter {BEST!r} takes a dict of options (overriding its setting), not "
                            f"{type(options).__name__}")
        spec = drafter_spec(BEST_DRAFTER, {"adapter": "default"} | (options or {}), target_exit)
        return dataclasses.replace(spec, best=True)
    if isinstance(options, Spec):
        _same_drafter(name, options)
        return options
    cls = drafter_class(name)
    if isinstance(options, cls.Config):  # a Config built in Python: a field at its class default counts as unset
        spec = Spec(name, options, target_exit, frozenset(f.name for f in dataclasses.fields(options)
                                                          if getattr(options, f.name) != _default(f)))
        check_save_plan_option(getattr(options, "save_plan", None))  # a folder or unwritable place: before decoding
        return spec
    if options is not None and not isinstance(options, dict):
        raise UserError(f"drafter {name!r} takes a dict of options or its {cls.Config.__name__}, "
                        f"not {type(options).__name__}")
    types = hints(cls.Config)
    kwargs, objects, named = {}, {}, {}
    for key, value in (options or {}).items():
        if value is None:
            continue
        field = cls.aliases.get(key, key)
        if field not in types:
            raise UserError(_not_an_option(name, key, sorted(set(types) | set(cls.aliases))))
        if field in named:  # E and exit_layer are one option: the last must not silently win
            raise UserError(f"drafter {name!r} was given option {field} twice ({named[field]!r} and {key!r}); "
                            "give it once")
        named[field] = key
        if isinstance(value, OBJECTS.get(field, ())):
            objects[field] = value
            continue
        if isinstance(value, os.PathLike):  # a file option (plan, save_plan, adapter, draft_vocab) given as a Path
            value = os.fspath(value)
        if isinstance(value, str):
            value = from_text(value, types[field], f"option {key} of drafter {name!r}")
        kwargs[field] = value
    spec = Spec(name, cls.Config(**kwargs), target_exit, frozenset(kwargs) | frozenset(objects),
                       objects.get("draft_vocab"), objects.get("plan"))
    spec.cls.check_spec(spec)
    check_save_plan_option(getattr(spec.config, "save_plan", None))
    if getattr(spec.config, "adapter", None) is None:  # an adapter's tuned setting may still fill them: at resolve
        check_unused(spec)
    return spec


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def check_unused(spec: Spec) -> None:
    """Refuse an option the caller set that would do nothing with the rest of the setting: a tree's node cap with
    no tree, ``keep_last`` with no confidence stop (each would otherwise be ignored without a word)."""
    config = spec.config
    if "max_tree_nodes" in spec.given and not getattr(config, "tree", True):
        raise UserError(f"drafter {spec.drafter!r}: max_tree_nodes (--max-tree-nodes) caps a token tree, and tree is "
                        "off: add tree (--tree, tree=true), or drop max_tree_nodes")
    if "keep_last" in spec.given and getattr(config, "keep_last", False) and not getattr(config, "confidence", 1.0):
        raise UserError(f"drafter {spec.drafter!r}: keep_last (--keep-last) keeps the token a confidence stop ends "
                        "on, and there is no confidence stop: add confidence (--confidence c, 0 < c < 1), or drop "
                        "keep_last")


def check_best(runner) -> None:
    """Refuse ``best`` on a model the project measured no best setting for (no adapter shipped for it), in one
    line saying what to use."""
    try:
        adapter_path("default", runner)
    except UserError:
        raise UserError(f"drafter {BEST!r}: no best setting is known for this model (one is measured only where an "
                        "exit adapter is shipped for the model: the default model, SmolLM2-135M-Instruct); use "
                        "--drafter autoregressive (plain decoding), or train and tune an adapter for it and pass "
                        "--drafter early_exit --adapter FILE") from None


def shown(path) -> str:
    """A file's path for a message: relative to the checkout when inside it."""
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def tuned_note(spec: Spec, adapter, unset: dict) -> str:
    """The one line that says which tuned setting applies, where it comes from and what it measured."""
    d = adapter.decoding
    speed = f"measured {d.speedup:.2f}x plain decoding" if d.speedup is not None else "speed-up not measured"
    where = "; ".join(x for x in (d.measured, d.source) if x)
    told = [f"{k}={getattr(spec.config, k)}" for k in sorted(spec.given) if k in d.settings]
    over = f"; given here: {', '.join(told)}" if told else ""
    head = "layerskip: best setting for this model:" if spec.best else \
        "layerskip: note: the exit adapter's tuned setting applies to the options not given:"
    return (f"{head} {BEST_DRAFTER}:adapter={spec.config.adapter}:{d.spec_text()} (tuned, in the header of "
            f"{shown(adapter.source)}), {speed}{f' ({where})' if where else ''}{over}")


def _not_an_option(name: str, key: str, valid: list[str]) -> str:
    message = f"option {key!r} does not apply to drafter {name!r} (its options: {', '.join(valid) or 'none'})"
    if name == "autoregressive" and key in ("E", "exit_layer"):  # its one knob is the generation's, not the drafter's
        message += ("; lossy early exit is spelled target_exit, a generation setting: DecodeConfig(target_exit=E), "
                    "`--target-exit E` or the spec autoregressive:target_exit=E")
    elif name == "autoregressive":  # plain decoding drafts nothing: say which drafters take the option
        message += f"; plain decoding drafts nothing: {option_owners(key)}"
    return message


def option_owners(key: str) -> str:
    """'the drafters that take it: early_exit, swift' for a drafter option given where none drafts."""
    field_name = next((cls.aliases[key] for cls in DRAFTERS.values() if key in cls.aliases), key)
    option = all_options().get(field_name)
    owners = [d for d in (option.owners if option else []) if d != "autoregressive"]
    takes = f"the drafters that take it: {', '.join(owners)}" if owners else "no drafter takes it"
    return f"{takes} (or {BEST!r}: the model's best measured setting, where one is known)"


def split_spec(text: str) -> tuple[str, dict[str, str], int | None]:
    """``'early_exit:E=8:k=6'`` -> ``('early_exit', {'E': '8', 'k': '6'}, None)``; ``target_exit=E`` comes apart
    (it goes to the generation)."""
    name, *parts = text.strip().split(":")
    if name != BEST:
        drafter_class(name)
    options, target = {}, None
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise UserError(f"bad drafter spec {text!r}: options look like name:key=value:key=value")
        if key in options or (key == "target_exit" and target is not None):
            raise UserError(f"bad drafter spec {text!r}: {key} is given twice; give each option once")
        if key == "target_exit":
            target = from_text(value, int, f"{text!r}: target_exit")
            continue
        options[key] = value
    return name, options, target


def parse_spec(text: str) -> Spec:
    """``'early_exit:E=8:k=6'`` -> the spec of early_exit with exit_layer 8 and num_draft 6, checked before any
    model is loaded."""
    name, options, target = split_spec(text)
    return drafter_spec(name, options, target)
