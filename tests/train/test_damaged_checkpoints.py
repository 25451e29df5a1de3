"""Damaged checkpoints are one line, never a traceback or a half-loaded run: `layerskip export` and `--resume` of a
cut-off weight, optimizer or RNG file, a state file that claims another step, a checkpoint still being written
(issue 37)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from accel_state import fresh_state
from deadline import deadline
from layerskip_cli.main import main as cli
from train import layerskip
from train.checkpoint import STATE_FILE
from train.console import resume_hint
from train.recipe import dump_config

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garbage(path: Path) -> None:
    path.write_bytes(b"\x00garbage\xff" * 10)


def later_step(path: Path) -> None:
    state = json.loads(path.read_text())
    path.write_text(json.dumps(state | {"step": state["step"] + 7}))


DAMAGE = {"model.safetensors cut off": ("model.safetensors", cut),
          "model.safetensors garbage": ("model.safetensors", garbage),
          "optimizer.bin cut off": ("optimizer.bin", cut),
          "RNG pickle garbage": ("random_states_0.pkl", garbage),
          "RNG pickle cut off": ("random_states_0.pkl", cut),
          "scheduler pickle cut off": ("custom_checkpoint_0.pkl", cut),
          "state claims a later step": (STATE_FILE, later_step)}
"""What is damaged in a copy of a good checkpoint: (file, how)."""
EXPORT_REFUSES = {"model.safetensors cut off", "model.safetensors garbage", "state claims a later step"}
"""The damages export sees (it reads the weights and the state, not the optimizer or RNG files)."""


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if "error" in line.lower()]  # (a loading bar may come first)
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def test_damaged_checkpoints_are_one_line_in_export_and_resume(tiny_recipe, tmp_path, capsys):
    cfg = tiny_recipe("optim.max_steps=2", "checkpoint.save_every=1", "checkpoint.keep_last=2",
                      "checkpoint.save_final=false")
    recipe = tmp_path / "recipe.yaml"
    dump_config(cfg, recipe)
    good = Path(cfg.checkpoint.output_dir)
    with deadline(600):
        assert layerskip.main(["--config", str(recipe)]) == 0
        ckpt_files = sorted(p.name for p in (good / "checkpoints" / "step-000002").iterdir())
        assert {name for name, _ in DAMAGE.values()} <= set(ckpt_files), ckpt_files
        for i, (label, (name, damage)) in enumerate(DAMAGE.items()):
            run = tmp_path / f"run{i}"
            shutil.copytree(good, run)
            damage(run / "checkpoints" / "step-000002" / name)
            before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
            capsys.readouterr()
            code = cli(["export", str(run), "--out", str(tmp_path / f"export{i}")])
            err = capsys.readouterr().err
            if label in EXPORT_REFUSES:
                assert code == 2, label
                assert "step-000002" in one_error_line(err), label
                assert not (tmp_path / f"export{i}").exists()
            fresh_state()
            code = layerskip.main(["--config", str(recipe), f"checkpoint.output_dir={run}", "optim.max_steps=3",
                                   "--resume"])
            line = one_error_line(capsys.readouterr().err)
            assert code == 2 and "step-000002" in line, (label, line)
            assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before, label  # nothing changed


def test_export_of_a_checkpoint_being_written_or_no_checkpoint_is_one_line(tmp_path, capsys):
    writing = tmp_path / "run" / "checkpoints" / ".tmp-step-000004-host-123"
    writing.mkdir(parents=True)
    (writing / STATE_FILE).write_text('{"step": 4}')
    for source, message in [(writing, "being written"), (tmp_path / "run", "is neither a checkpoint"),
                            (tmp_path / "missing", "is neither a checkpoint"), (recipe_file(tmp_path), "neither")]:
        assert cli(["export", str(source), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def recipe_file(tmp_path: Path) -> Path:
    path = tmp_path / "a-file.yaml"
    path.write_text("model: {}\n")
    return path


def test_the_interrupt_hint_resumes_only_what_has_a_checkpoint():
    argv = ["--config", "r.yaml", "--overwrite"]
    assert resume_hint(argv, "runs/x", True).endswith("python train/layerskip.py --config r.yaml --resume")
    fresh = resume_hint(argv, "runs/x", False)
    assert "--resume" not in fresh and fresh.endswith("--config r.yaml --overwrite") and "first checkpoint" in fresh


def test_checkpoint_names_and_process_counts_with_non_ascii_digits_are_not_numbers(tmp_path):
    """'step-²' and '--num_processes ²': str.isdigit() is true for '²', which int() refuses (a ValueError
    traceback); both are read as what they are, not a step or a count."""
    from train.checkpoint import _step_of
    from train.console import requested_processes

    damaged = tmp_path / "step-²"
    damaged.mkdir()
    assert _step_of(damaged) == -1
    assert requested_processes(["accelerate", "launch", "--num_processes", "²", "train/layerskip.py"]) == 1
