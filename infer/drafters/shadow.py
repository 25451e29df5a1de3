"""How often an early exit's drafts would be accepted, estimated while taking plain steps, and what drafting with it
is expected to give (the adaptive early exit's cost model).

The fallback gate (``infer.drafters.gate``) times plain steps and drafting, but only drafting shows what drafting
costs: a probe of an exit that cannot pay (Gemma 3 270M's untrained exit 9 agrees with the last layer on 1% of
tokens) costs several cycles of k draft forwards per token, more than a short generation gains back. So the adaptive
early exit also watches its exit while it takes plain steps: a plain step's verification keeps the stream entering
layer E at the position it verifies (``Draft.observe``: the forward is cut there, same layers, same output), the
draft head scores it (one row: the shadow draft), and whether its top token is the token the model emitted there is
counted, discounted, with a prior worth a few positions. Drafted cycles count too (each chain's accepted drafts and
its first rejection). The expected speed-up of drafting k tokens per cycle is then M(a, k) / (k c + v(k + 1)) with
this model's measured c (the draft forward at E with its head) and v (``infer.drafters.costs``); the gate probes
drafting only once it predicts at least ``FallbackGate.HOPELESS``, and not before ``MIN_SEEN`` positions were seen.
Scoring costs a draft-head call per observed step, so it stays within ``SHARE`` of the decoding time.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from infer.drafters.costs import exit_costs, exit_prices
from infer.model.plan import cycle_speedup, iid_tokens_per_cycle
from infer.model.runner import DraftHead, Runner
from layerskip_core import jsonfile

PRIOR = 0.1
"""Per-token acceptance assumed before anything is seen (untrained exits agree 0.01-0.8 with the last layer)."""
PRIOR_SEEN = 4.0
"""Positions the prior is worth."""
DECAY = 0.97
"""Weight a seen position keeps per later one (about the last 33 count)."""
MIN_SEEN = 8
"""Positions seen before a prediction is made (before: 0, no probe)."""
SHARE = 0.01
"""Most share of the decoding time spent scoring observed plain steps."""


class ExitShadow:
    """The acceptance of early exit at ``exit_layer`` with ``head``, estimated on plain steps' verified positions and
    drafted chains, and drafting's predicted speed-up from it."""

    def __init__(self, runner: Runner, exit_layer: int, head: DraftHead | None, num_draft: int, measured: bool):
        self.runner, self.exit_layer, self.head, self.k = runner, exit_layer, head, num_draft
        if measured:
            prices, costs = exit_costs(runner, [exit_layer], head, num_draft + 1)
            self.c, self.v = prices[exit_layer], costs.v(num_draft + 1)
        else:
            rows = runner.spec.vocab_size if head is None else head.size
            self.c, self.v = exit_prices(runner.spec, [exit_layer], rows)[exit_layer], 1.0
        self.seen = self.good = 0.0
        self.share = SHARE  # the most share of decoding time spent scoring (tests set 1.0: every plain step)
        self.observe_seconds = self.decode_seconds = 0.0

    @property
    def acceptance(self) -> float:
        """Estimated per-token acceptance a."""
        return (self.good + PRIOR * PRIOR_SEEN) / (self.seen + PRIOR_SEEN)

    def predicted(self) -> float:
        """M(a, k) / (k c + v(k + 1)), the expected speed-up of drafting k tokens per cycle; 0 before ``MIN_SEEN``."""
        if self.seen < (1 - DECAY ** MIN_SEEN) / (1 - DECAY) - 1e-9:  # MIN_SEEN positions, discounted
            return 0.0
        return cycle_speedup(iid_tokens_per_cycle(min(self.acceptance, 0.999), self.k), self.k, self.c, self.v)

    def wants(self) -> bool:
        """Whether this plain step should be observed: scoring so far within ``share`` of the decoding time."""
        return self.observe_seconds <= self.share * self.decode_seconds

    def _add(self, hits: list[bool]) -> None:
        for hit in hits:
            self.seen, self.good = DECAY * self.seen + 1, DECAY * self.good + hit

    @torch.no_grad()
    def learn(self, stream: Tensor, target: list[int]) -> None:
        """Positions verified by a plain step: ``stream`` (P, d) entering E, ``target`` the P tokens emitted there."""
        t0 = time.perf_counter()
        shadow = self.runner.logits(stream, self.head).argmax(-1).tolist()  # (P,): the exit's drafts there
        self._add([s == t for s, t in zip(shadow, target, strict=True)])
        self.observe_seconds += time.perf_counter() - t0

    def learn_drafted(self, accepted: int, proposed: int) -> None:
        """A drafted chain: its ``accepted`` drafts, then the first rejected one (when ``proposed`` went further)."""
        self._add([True] * accepted + ([False] if proposed > accepted else []))

    def to_dict(self) -> dict:
        return {"seen": self.seen, "good": self.good}

    def load(self, d: dict) -> None:
        """What an earlier command saw (``to_dict``); ValueError or KeyError when it is not plausible."""
        seen = jsonfile.number(d["seen"], "shadow.seen", 0.0, 1e6)
        self.seen, self.good = seen, jsonfile.number(d["good"], "shadow.good", 0.0, seen)
