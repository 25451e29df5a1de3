"""Drafters behind one protocol, looked up by name."""

from __future__ import annotations

from infer.drafters.autoregressive import AutoregressiveDrafter
from infer.drafters.base import DecodeState, Draft, Drafter, VerifyOutcome
from infer.drafters.early_exit import EarlyExitDrafter

DRAFTERS: dict[str, type] = {
    AutoregressiveDrafter.name: AutoregressiveDrafter,
    EarlyExitDrafter.name: EarlyExitDrafter,
}

__all__ = ["DRAFTERS", "DecodeState", "Draft", "Drafter", "VerifyOutcome"]
