"""The one check of an exit layer against a model's depth (drafting, lossy targets, training exits, adapters)."""

from __future__ import annotations

from layerskip_core.errors import UserError


def check_exit_layer(exit_layer: int, num_layers: int, what: str = "exit layer", *, below_last: bool = False) -> None:
    """Refuse an exit layer E outside the model: 1 <= E <= L where E = L is the full model (drafting, a lossy
    target), or 1 <= E < L with ``below_last`` (a training exit or an adapter: the last layer is the model's own
    output). ``what`` names the setting in the message."""
    top, relation = (num_layers - 1, "<") if below_last else (num_layers, "<=")
    if not 1 <= exit_layer <= top:
        raise UserError(f"{what} {exit_layer} is out of range: the model has {num_layers} layers, so use "
                        f"1 <= E {relation} {num_layers}")
