"""Issue 49 on training: a run whose loss or weights stop being finite stops in one line and saves nothing from those
steps; an adapter run prints its evaluation line; an interrupted run closes its bar before the --resume hint."""

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


def test_an_adapter_run_prints_its_evaluation_line(tiny_recipe, capsys):
    """As LayerSkip and LoRA runs print ``eval: final loss ...``, an adapter run says what its adapter reached."""
    cfg = tiny_recipe("adapter.enabled=true", "adapter.exit_layer=2", "optim.max_steps=2")
    run_training(cfg)
    lines = [x for x in capsys.readouterr().err.splitlines() if "eval: adapter at E2" in x]
    assert len(lines) == 1 and "agreement with the full model" in lines[0] and "the plain exit 2" in lines[0]


def test_an_interrupted_run_closes_its_bar_before_the_hint(tiny_recipe, monkeypatch):
    """Ctrl-C mid-run: the progress bar is closed on the way out, so the --resume hint prints below it."""
    import train.layerskip as loop

    closed = []
    real = loop.tqdm

    def tracked(*args, **kwargs):
        bar = real(*args, **kwargs)
        close = bar.close
        bar.close = lambda: (closed.append(kwargs.get("desc")), close())[1]
        return bar

    monkeypatch.setattr(loop, "tqdm", tracked)

    def interrupt(step):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_training(tiny_recipe("optim.max_steps=3", "logging.progress=true"), on_step=interrupt)
    assert "train" in closed
