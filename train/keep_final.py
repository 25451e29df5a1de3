"""The frozen starting model of ``keep_final``: the teacher whose final-layer distribution the trained model's
final layer is distilled toward (``keep_final.kl_weight``), so that the early-exit loss cannot buy its drafts
with the verifier's quality.

The teacher is the model as it was loaded, before the first step: for full training a frozen copy made at
set-up (before a resumed run loads its checkpoint, so a resumed run has the same teacher); with LoRA the same
model with its adapters disabled (peft's ``disable_adapter``), which costs no copy. It is held outside the
module tree of :class:`train.model.LayerSkipLM`, so it is never in a state dict, a checkpoint, the optimiser
or DDP's parameters; it runs without layer dropout and without gradients.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from layerskip_core.errors import UserError
from train.losses import is_plain_head


class StartModel:
    """The starting model's final layer, frozen (not an ``nn.Module``: nothing here is saved or trained)."""

    def __init__(self, model: nn.Module, head: nn.Module, parts_of: Callable[[nn.Module], object]):
        if not is_plain_head(head):
            raise UserError("keep_final.kl_weight needs a plain LM head (not LoRA-wrapped, not ZeRO-3-partitioned); "
                            "remove lm_head from lora.target_modules or set keep_final.kl_weight=0")
        self.parts_of = parts_of
        """``train.model.decoder_parts``, handed in by the model that owns this teacher (no import back up)."""
        self.lora = hasattr(model, "disable_adapter")
        self.copy = None if self.lora else copy.deepcopy(model).requires_grad_(False).eval()

    def final_normed(self, lm, input_ids: Tensor) -> tuple[Tensor, Tensor]:
        """(the start's normed last hidden state (B, T, d), its LM-head weight (V, d)) for ``input_ids`` (B, T).

        ``lm`` is the :class:`train.model.LayerSkipLM` being trained: its decoder loop runs the start's layers.
        """
        with torch.no_grad():
            if self.lora:
                with lm.model.disable_adapter(), eval_mode(lm.model):  # a teacher without dropout, as the copy
                    _, h = lm.hidden_states(input_ids)  # (B, T, d)
                    parts = self.parts_of(lm.model)
                    return parts.norm(h), parts.lm_head.weight
            if next(self.copy.parameters()).device != input_ids.device:
                self.copy.to(input_ids.device)  # once: the trained model was moved after this copy was made
            parts = self.parts_of(self.copy)
            _, h = lm.hidden_states(input_ids, model=self.copy)  # (B, T, d)
            return parts.norm(h), parts.lm_head.weight


@contextmanager
def eval_mode(module: nn.Module):
    """``module`` in eval mode (no dropout) inside the block; every submodule's own train/eval flag restored after."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for m, training in modes:
            m.training = training
