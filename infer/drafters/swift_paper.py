"""SWIFT as its released code runs it (``swift:paper=true``): the reference mode, beside our SWIFT drafter.

The same search, scoring, drafting and tree code as ``infer.drafters.swift.SwiftDrafter``, with the reference's
choices where ours differ: no fallback to plain steps and no optimisation budget (an optimisation step after every
verification until a stop criterion), the paper's tree widths at every depth with no cap on the tree's nodes, a
GP-UCB Bayesian step whose continuous suggestion keeps its top-n sublayers (``infer.drafters.gp_ucb``), one global best
matchness (never rescored), the window of each prompt's first γ+1 generated tokens scored on the prompt's KV
only, stop criteria compared strictly, the odd inner layers as the starting plan, the full LM head, and with a
plan given no optimisation at all (the reference's cached-plan mode). The released evaluation script's window
(50) and match threshold (0.93) are ``SwiftConfig``'s defaults in this mode.
"""

from __future__ import annotations

from infer.drafters.base import DecodeState, DraftInputs
from infer.drafters.swift import SwiftDrafter
from infer.drafters.tree import WIDEST
from infer.model.plan import LayerPlan, odd_inner_plan


class SwiftPaperDrafter(SwiftDrafter):
    """SWIFT's reference mode (chosen by ``paper=true``)."""

    bayes = "gp_ucb"
    strict_stop = True  # score > threshold, more than patience / max-opt-steps steps, as the reference compares

    @classmethod
    def resolve(cls, spec, runner, tokenizer=None) -> DraftInputs:
        """The starting plan only: the references all draft with the full head."""
        return DraftInputs(None, super().resolve(spec, runner, tokenizer).plan)

    @property
    def fallback(self) -> bool:
        return False

    @property
    def tree_nodes(self) -> int:
        """A full tree of the widest width at every depth."""
        return self.config.num_draft * WIDEST

    def start_plan(self) -> LayerPlan:
        """The odd inner layers, whatever the skip ratio (the reference initialises the skip set to
        ``range(1, L - 1, 2)`` for both sublayer kinds)."""
        return odd_inner_plan(self.runner.num_layers)

    def initial_stop(self) -> str:
        """With a plan given, no optimisation; else at least one step (the reference checks its step limit after a
        step)."""
        return "plan given (paper: no optimisation)" if self.plan_given else ""

    def within_budget(self) -> bool:
        return True

    def rescore(self, state: DecodeState) -> int:
        """The reference keeps one global best score: a new window does not rescore the incumbent."""
        return 0

    def to_beat(self) -> float:
        """The reference's global best score starts at 0."""
        return max(self.best_score, 0.0)

    def new_window(self, state: DecodeState) -> tuple[int, int]:
        """The prompt's first γ+1 generated tokens (the first γ re-run, each predicting the next), whose draft-mode
        rows see only the prompt's KV, as the reference's ``swift_optimization`` scores them on a copy of the
        prompt's prefilled cache."""
        return state.prompt_len, state.prompt_len + self.config.context_window
