"""Command-line flags made from the settings dataclasses, for every command and script (one home per setting).

``add_model_flags`` / ``model_settings`` (``ModelSettings``: --model, --device, --dtype, --executor,
--threads), ``add_run_flags`` / ``run_settings`` (the same without --model, for commands that take several),
``add_sampling_flags`` / ``sampling_config`` (``infer.model.sampling.SamplingConfig``) and the drafter flags
(one group per drafter, built from each drafter's config). A command passes its own defaults as an instance
(e.g. ``ModelSettings(executor="static")``); the help shows them, and flags not given keep them.
"""

from __future__ import annotations

import argparse

from layerskip_core.options import add_dataclass_flags, add_flag, from_args
from layerskip_core.settings import ModelSettings, RunSettings


def add_model_flags(p: argparse.ArgumentParser, defaults: ModelSettings | None = None,
                    skip: tuple[str, ...] = ()) -> None:
    """--model, --device, --dtype, --executor, --threads (less ``skip``: e.g. a command that runs no decoding
    forwards has no executor); ``defaults``: this command's (default: the class's)."""
    add_dataclass_flags(p.add_argument_group("model and device"), ModelSettings, skip=skip,
                        defaults=defaults or ModelSettings())


def model_settings(args: argparse.Namespace, defaults: ModelSettings | None = None) -> ModelSettings:
    """The ``ModelSettings`` of the flags given, over ``defaults`` (the same as given to ``add_model_flags``)."""
    return from_args(ModelSettings, args, defaults or ModelSettings())


def add_run_flags(p: argparse.ArgumentParser, defaults: RunSettings | None = None,
                  skip: tuple[str, ...] = ()) -> None:
    """--device, --dtype, --executor, --threads (the model flag is the command's own)."""
    add_dataclass_flags(p.add_argument_group("device"), RunSettings, skip=skip, defaults=defaults or RunSettings())


def run_settings(args: argparse.Namespace, defaults: RunSettings | None = None) -> RunSettings:
    """The ``RunSettings`` of the flags given, over ``defaults``."""
    return from_args(RunSettings, args, defaults or RunSettings())


def add_sampling_flags(p: argparse.ArgumentParser, defaults=None) -> None:
    """--temperature, --top-k, --top-p, --seed (``defaults``: a ``SamplingConfig``)."""
    from infer.model.sampling import SamplingConfig  # torch-heavy: imported when a parser is built, after --help checks

    add_dataclass_flags(p.add_argument_group("sampling"), SamplingConfig, defaults=defaults)


def sampling_config(args: argparse.Namespace, defaults=None):
    from infer.model.sampling import SamplingConfig  # lazy: torch, when a parser is built

    return from_args(SamplingConfig, args, defaults)


def add_drafter_flags(p: argparse.ArgumentParser) -> None:
    """--drafter and one flag group per drafter; options several drafters share get a group of their own."""
    # infer.drafters imports torch: loaded when the parser is built, so only for the commands that draft
    from infer.drafters import DRAFTERS, all_options  # lazy: torch, when a parser is built

    p.add_argument("--drafter", default="autoregressive",
                   help=f"one of: {', '.join(DRAFTERS)} (default autoregressive)")
    current = list(all_options().values())
    shared = [o for o in current if len(o.owners) > 1]
    group = p.add_argument_group("options of several drafters (same meaning in each; defaults per drafter)")
    for o in shared:
        add_flag(group, o.field, o.type, f"{o.help()} [{', '.join(o.owners)}]")
    for name in DRAFTERS:
        own = [o for o in current if o.owners == [name]]
        if own:
            group = p.add_argument_group(f"{name} options")
            for o in own:
                add_flag(group, o.field, o.type, o.help())


def drafter_spec_of(args: argparse.Namespace):
    """The drafter spec of --drafter and the drafter flags given (``infer.drafters.spec.drafter_spec``)."""
    from infer.drafters import all_options, drafter_spec  # lazy: torch, when flags are read

    options = {f: getattr(args, f) for f in all_options() if getattr(args, f, None) is not None}
    return drafter_spec(args.drafter, options)
