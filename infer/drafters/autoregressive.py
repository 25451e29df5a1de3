"""No draft: every step is one full forward (the baseline, on the same runner and loop).

Lossy early-exit decoding (the LayerSkip paper's "EE" rows) is plain decoding of a truncated target:
``GenerationConfig(target_exit=E)`` (``--target-exit E``), which only this drafter takes. The old
spelling, this drafter's ``exit_layer`` option (``autoregressive:E=8``, ``--drafter autoregressive
--exit-layer 8``), still works for one release with a warning: spec and flag parsing map it there.
"""

from __future__ import annotations

from dataclasses import dataclass

from infer.drafters.base import DecodeState, Draft, VerifyOutcome


@dataclass
class AutoregressiveConfig:
    """Settings of plain decoding (none)."""


class AutoregressiveDrafter:
    name = "autoregressive"
    Config = AutoregressiveConfig
    drafts = False
    lookahead = 0

    def __init__(self, runner, config: AutoregressiveConfig | None = None):
        self.config = config or AutoregressiveConfig()

    def start(self, state: DecodeState) -> None:
        pass

    def propose(self, state: DecodeState) -> Draft | None:
        return None

    def update(self, state: DecodeState, outcome: VerifyOutcome) -> None:
        pass

    def finish(self) -> None:
        """Nothing to save."""

    def stats(self) -> dict:
        return {}
