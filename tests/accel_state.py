"""accelerate keeps process-wide singletons: tests that run training twice in one process reset them."""

from __future__ import annotations


def fresh_state() -> None:
    """Each run builds its own Accelerator; reset the singletons the previous one left."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
