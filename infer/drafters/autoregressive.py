"""No draft: every step is one full forward (the baseline, on the same runner and loop).

With ``exit_layer=E`` it is lossy early-exit decoding (the LayerSkip paper's "EE" rows): every
token comes from layers [0, E) + final norm + LM head, so the output is the exit layer's, not the
model's; ``E = L`` (the model's layer count) is plain decoding again.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import UserError
from infer.drafters.base import DecodeState, Draft, VerifyOutcome


@dataclass
class AutoregressiveConfig:
    """Settings of plain decoding."""

    exit_layer: int | None = None
    """E: lossy early exit, decode with layers [0, E) + final norm + LM head only; the output is the exit
    layer's (default: all layers, exact)."""


class AutoregressiveDrafter:
    name = "autoregressive"
    Config = AutoregressiveConfig
    aliases = {"E": "exit_layer"}
    lookahead = 0

    def __init__(self, runner, config: AutoregressiveConfig | None = None):
        self.config = config or AutoregressiveConfig()
        self.num_layers = runner.num_layers
        E = self.config.exit_layer
        if E is not None and not 1 <= E <= self.num_layers:
            raise UserError(f"exit layer {E} is out of range: the model has {self.num_layers} layers, so use "
                            f"1 <= --exit-layer <= {self.num_layers}")

    def start(self, state: DecodeState) -> None:
        pass

    def propose(self, state: DecodeState) -> Draft | None:
        return None

    def update(self, state: DecodeState, outcome: VerifyOutcome) -> None:
        pass

    def finish(self) -> None:
        """Nothing to save."""

    def stats(self) -> dict:
        E = self.config.exit_layer
        return {} if E is None or E == self.num_layers else {"exit_layer": E, "lossy": True}
