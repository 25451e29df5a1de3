"""LayerSkip early-exit drafting: layers [0, E) + final norm + shared LM head, token by token.

The draft's KV for layers < E and its hidden states at layer E are exactly what the full
model computes, so verification runs only layers >= E for the drafted positions (plus
layers < E for the last drafted token, which no draft pass has seen).
"""

from __future__ import annotations

from dataclasses import dataclass

from infer.drafters.base import DecodeState, Draft, VerifyOutcome
from infer.drafters.chain import EarlyExitForward, draft_chain
from infer.errors import UserError


@dataclass
class EarlyExitConfig:
    """Settings of the early-exit drafter."""

    exit_layer: int = 8
    """E: draft with decoder layers [0, E), then the final norm and LM head (1 <= E <= L)."""
    num_draft: int = 6
    """k: most tokens drafted per verification."""
    confidence: float = 0.0
    """Stop drafting when the draft's top-1 probability falls below this (0 = always draft k)."""

    def __post_init__(self) -> None:
        if self.num_draft < 1:
            raise UserError(f"num-draft must be >= 1, got {self.num_draft}")
        if not 0.0 <= self.confidence < 1.0:
            raise UserError(f"confidence must be in [0, 1), got {self.confidence}")


class EarlyExitDrafter:
    name = "early_exit"
    Config = EarlyExitConfig
    aliases = {"E": "exit_layer", "k": "num_draft"}

    def __init__(self, runner, config: EarlyExitConfig | None = None):
        self.config = config or EarlyExitConfig()
        L = runner.num_layers
        if not 1 <= self.config.exit_layer <= L:
            raise UserError(f"exit layer {self.config.exit_layer} is out of range: the model has {L} "
                            f"layers, so use 1 <= --exit-layer <= {L}")
        self.forward = EarlyExitForward(runner, self.config.exit_layer)
        self.forwards = 0

    @property
    def lookahead(self) -> int:
        return self.config.num_draft + 1

    def start(self, state: DecodeState) -> None:
        self.forwards = 0

    def propose(self, state: DecodeState) -> Draft | None:
        chain = draft_chain(state, self.forward, self.config.num_draft, self.config.confidence)
        self.forwards += chain.forwards
        return chain.draft if chain.forwards else None

    def update(self, state: DecodeState, outcome: VerifyOutcome) -> None:
        pass

    def stats(self) -> dict:
        return {"draft_forwards": self.forwards}
