"""No draft: every step is one full forward (the baseline, on the same runner and loop)."""

from __future__ import annotations

from dataclasses import dataclass

from infer.drafters.base import DecodeState, Draft, VerifyOutcome


@dataclass
class AutoregressiveConfig:
    """The baseline has no knobs."""


class AutoregressiveDrafter:
    name = "autoregressive"
    Config = AutoregressiveConfig
    lookahead = 0

    def __init__(self, runner, config: AutoregressiveConfig | None = None):
        self.config = config or AutoregressiveConfig()

    def start(self, state: DecodeState) -> None:
        pass

    def propose(self, state: DecodeState) -> Draft | None:
        return None

    def update(self, state: DecodeState, outcome: VerifyOutcome) -> None:
        pass

    def stats(self) -> dict:
        return {}
