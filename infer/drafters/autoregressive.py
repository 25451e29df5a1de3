"""No draft: every step is one full forward (the baseline, on the same runner and loop).

Lossy early-exit decoding (the LayerSkip paper's "EE" rows) is plain decoding of a truncated target:
``DecodeConfig(target_exit=E)`` (``--target-exit E``), which only this drafter takes.
"""

from __future__ import annotations

from dataclasses import dataclass

from infer.drafters.base import NO_INPUTS, DecodeState, Draft, Drafter, DraftInputs


@dataclass
class AutoregressiveConfig:
    """Settings of plain decoding (none)."""


class AutoregressiveDrafter(Drafter):
    name = "autoregressive"
    Config = AutoregressiveConfig
    drafts = False
    examples = {"": {}}  # plain decoding takes no options (infer.drafters.examples)

    def __init__(self, runner, config: AutoregressiveConfig | None = None, inputs: DraftInputs = NO_INPUTS):
        self.config = config or AutoregressiveConfig()

    def propose(self, state: DecodeState) -> Draft | None:
        return None
