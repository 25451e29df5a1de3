"""Scripted drafters for tests of one verification (chains and trees) without a real draft model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.drafters.base import Draft


@dataclass
class ScriptedDrafter:
    """Proposes a fixed chain (``parents`` None) or tree at every step."""

    tokens: list[int]
    parents: list[int] | None
    name = "scripted"
    lookahead = 32

    def start(self, state):
        pass

    def propose(self, state):
        return Draft(torch.tensor(self.tokens), parents=self.parents)

    def update(self, state, outcome):
        pass

    def stats(self):
        return {}

    def finish(self):
        pass
