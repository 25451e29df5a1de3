"""A run whose loss or weights stop being finite stops in one line and saves nothing from those steps (issue 49)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from layerskip_core.errors import UserError
from train.layerskip import run_training

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


@pytest.mark.parametrize("overrides", [
    ("optim.lr=1e30",),  # finite, in float32's range, yet the weights blow up after a step
    ("optim.lr=1e30", "optim.max_steps=1", "optim.warmup_steps=0"),  # a finite loss, then weights of 1e30: the
    # held-out loss after the step is not finite
    ("keep_final.kl_weight=3e38", "optim.lr=1e30"),
])
def test_a_diverged_run_stops_without_saving(tiny_recipe, overrides):
    cfg = tiny_recipe("optim.max_steps=3", "checkpoint.save_every=1", "optim.max_grad_norm=0", *overrides)
    with pytest.raises(UserError, match="training diverged by step .*stopped before saving anything from here") as e:
        run_training(cfg)
    out = Path(cfg.checkpoint.output_dir)
    assert not (out / "final").exists()
    stopped = int(re.search(r"by step (\d+)", str(e.value)).group(1))
    assert all(int(c.name.removeprefix("step-")) <= stopped for c in out.glob("checkpoints/step-*"))
