"""Command-line flags made from the settings dataclasses, for every command and script (one home per setting).

``add_model_flags`` / ``model_settings`` (``ModelSettings``: --model, --device, --dtype, --executor,
--threads), ``add_run_flags`` / ``run_settings`` (the same without --model, for commands that take several),
``add_sampling_flags`` / ``sampling_config`` (``infer.model.sampling.SamplingConfig``) and the drafter flags
(one group per drafter, built from each drafter's config). A command passes its own defaults as an instance
(e.g. ``ModelSettings(executor="static")``); the help shows them, and flags not given keep them.
"""

from __future__ import annotations

import argparse

from layerskip_core.errors import UserError
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


def sampling_config(args: argparse.Namespace, defaults=None, sample_with: str = "--temperature T"):
    """The ``SamplingConfig`` of the flags given, over ``defaults``; --top-k or --top-p on a greedy run (which they
    would not change) is refused, saying to sample with ``sample_with``."""
    from infer.model.sampling import SamplingConfig  # lazy: torch, when a parser is built

    config = from_args(SamplingConfig, args, defaults)
    shaping = [f for f in ("top_k", "top_p") if getattr(args, f, None) is not None]
    if config.greedy and shaping:
        flags = " and ".join(f"--{f.replace('_', '-')}" for f in shaping)
        raise UserError(f"{flags} shape{'s' if len(shaping) == 1 else ''} sampling, and this run is greedy "
                        f"(temperature 0), which {'they' if len(shaping) > 1 else 'it'} would not change: add "
                        f"{sample_with} to sample, or drop {flags}")
    return config


def add_drafter_flags(p: argparse.ArgumentParser) -> None:
    """--drafter and one flag group per drafter; options several drafters share get a group of their own."""
    # infer.drafters imports torch: loaded when the parser is built, so only for the commands that draft
    from infer.drafters import DRAFTERS, all_options  # lazy: torch, when a parser is built
    from infer.drafters.spec import BEST  # lazy, as above

    p.add_argument("--drafter", default=None,
                   help=f"one of: {', '.join(DRAFTERS)} (default autoregressive: plain decoding), or {BEST}: the "
                   "model's best measured setting (early_exit with the exit adapter shipped for the model, at the "
                   "setting it was tuned with; said on stderr with its source and speed-up; refused for a model "
                   "without one)")
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
    """The drafter spec of --drafter and the drafter flags given (``infer.drafters.spec.drafter_spec``); drafter
    flags without --drafter are refused with the drafters that take them (plain decoding drafts nothing)."""
    from infer.drafters import all_options, drafter_spec  # lazy: torch, when flags are read
    from infer.drafters.spec import option_owners  # lazy, as above

    options = {f: getattr(args, f) for f in all_options() if getattr(args, f, None) is not None}
    if args.drafter is None and options:
        flag = "--" + next(iter(options)).replace("_", "-")
        lossy = "; lossy early exit (plain decoding of layers [0, E) only) is spelled target_exit: --target-exit E" \
            if "exit_layer" in options else ""
        raise UserError(f"{flag} is a drafter's option, and no --drafter was given (plain decoding drafts nothing): "
                        f"add --drafter NAME; {option_owners(next(iter(options)))}{lossy}")
    args.drafter = args.drafter or "autoregressive"  # the name the output reports
    return drafter_spec(args.drafter, options)
