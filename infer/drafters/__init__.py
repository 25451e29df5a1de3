"""Drafters (subclasses of ``base.Drafter``, one file each), their registry (``registry``) and their specs
(``spec``: a drafter's name and checked Config, parsed once and resolved once against a loaded model)."""

from __future__ import annotations

from infer.drafters.base import DecodeState, Draft, Drafter, DrafterStats, DraftInputs, DraftVocabOption, VerifyOutcome
from infer.drafters.examples import ExampleModel
from infer.drafters.registry import DRAFTERS, Option, all_options, drafter_class, example_cases
from infer.drafters.spec import (
    ResolvedSpec,
    Spec,
    build_config,
    build_drafter,
    drafter_spec,
    parse_spec,
    split_spec,
)

__all__ = ["DRAFTERS", "DecodeState", "Draft", "DraftInputs", "DraftVocabOption", "Drafter", "DrafterStats",
           "ExampleModel", "Option", "ResolvedSpec", "Spec", "VerifyOutcome", "all_options", "build_config",
           "build_drafter", "drafter_class", "drafter_spec", "example_cases", "parse_spec", "split_spec"]
