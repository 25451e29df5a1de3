"""Scripted drafters for tests of one verification (chains and trees) without a real draft model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.drafters.base import Draft, Drafter, Needs


@dataclass
class ScriptedDrafter(Drafter):
    """Proposes a fixed chain (``parents`` None) or tree at every step."""

    tokens: list[int]
    parents: list[int] | None
    name = "scripted"

    def needs(self):
        return Needs(lookahead=32)

    def propose(self, state):
        return Draft(torch.tensor(self.tokens), parents=self.parents)
