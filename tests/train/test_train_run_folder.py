"""One run per output folder: refusal, --overwrite, resume config check, log cut back, safe pruning."""

from __future__ import annotations

import json
import os
import pkgutil
import sys
from pathlib import Path

import pytest

from accel_state import fresh_state
from deadline import deadline
from train import layerskip
from train.checkpoint import RUN_LOCK, STATE_FILE, list_checkpoints, save_checkpoint
from train.recipe import dump_config

REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


@pytest.fixture
def recipe(tiny_recipe, tmp_path) -> Path:
    """A 2-step tiny run with a checkpoint every step, as a recipe file for the command line."""
    cfg = tiny_recipe("optim.max_steps=2", "checkpoint.save_every=1", "checkpoint.keep_last=2",
                      "checkpoint.save_final=false")
    path = tmp_path / "recipe.yaml"
    dump_config(cfg, path)
    return path


def _main(capsys, *argv: str) -> tuple[int, str]:
    fresh_state()
    code = layerskip.main(list(argv))
    return code, capsys.readouterr().err


def _steps(out: Path) -> list[int]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if "loss" in r]


def test_new_run_into_a_run_folder_is_refused_and_overwrite_starts_again(recipe, tmp_path, capsys):
    out = tmp_path / "run"
    assert _main(capsys, "--config", str(recipe))[0] == 0
    before = (out / "metrics.jsonl").read_bytes()
    code, err = _main(capsys, "--config", str(recipe), "optim.max_steps=3")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--resume" in err and "--overwrite" in err and "checkpoint.output_dir" in err
    assert (out / "metrics.jsonl").read_bytes() == before  # nothing touched
    code, err = _main(capsys, "--config", str(recipe), "optim.max_steps=3", "--overwrite")
    assert code == 0, err
    assert _steps(out) == [1, 2, 3]  # only the new run
    assert [p.name for p in list_checkpoints(out)] == ["step-000002", "step-000003"]
    assert _main(capsys, "--config", str(recipe), "--overwrite", "--resume")[0] == 2


def test_resume_checks_the_saved_config(recipe, tmp_path, capsys):
    out = tmp_path / "run"
    assert _main(capsys, "--config", str(recipe))[0] == 0
    code, err = _main(capsys, "--config", str(recipe), "optim.lr=0.1", "--resume", "data.block_size=16")
    assert code == 2 and "optim.lr" in err and "data.block_size" in err and len(err.strip().splitlines()) == 1
    code, err = _main(capsys, "--config", str(recipe), "--resume", "optim.max_steps=3", "logging.log_every=1")
    assert code == 0, err  # the run's length and logging may change
    assert _steps(out) == [1, 2, 3]


def test_resume_of_an_older_checkpoint_with_newer_ones_is_refused(recipe, tmp_path, capsys):
    out = tmp_path / "run"
    assert _main(capsys, "--config", str(recipe))[0] == 0
    older = list_checkpoints(out)[0]
    code, err = _main(capsys, "--config", str(recipe), f"checkpoint.resume={older}")
    assert code == 2 and "step-000002" in err


def test_folder_without_checkpoint_cannot_be_resumed_into(recipe, tmp_path, capsys):
    out = tmp_path / "run"
    assert _main(capsys, "--config", str(recipe), "checkpoint.save_every=0")[0] == 0
    code, err = _main(capsys, "--config", str(recipe), "checkpoint.save_every=0")
    assert code == 2 and "no checkpoint to resume" in err and "--resume" not in err
    code, err = _main(capsys, "--config", str(recipe), "checkpoint.save_every=0", "--resume")
    assert code == 2 and "no checkpoint" in err and "--overwrite" in err
    assert _steps(out) == [1, 2]


def test_unwritable_output_dir_is_one_line(recipe, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    for out in ("/proc/layerskip-no-such/run", str(tmp_path / "file" / "run")):
        code, err = _main(capsys, "--config", str(recipe), f"checkpoint.output_dir={out}")
        assert code == 2 and len(err.strip().splitlines()) == 1 and "checkpoint.output_dir" in err


class _FakeAccelerator:
    is_main_process = True
    num_processes = 1

    def wait_for_everyone(self):
        pass

    def save_state(self, path):
        Path(path).mkdir(parents=True)


def test_pruning_never_deletes_the_current_runs_checkpoint(tiny_recipe, tmp_path):
    cfg = tiny_recipe("checkpoint.keep_last=2")
    root = Path(cfg.checkpoint.output_dir) / "checkpoints"
    for step in (4, 5):  # checkpoints with higher step numbers than the one being saved
        (root / f"step-{step:06d}").mkdir(parents=True)
        (root / f"step-{step:06d}" / STATE_FILE).write_text(json.dumps({"step": step}))
    saved = save_checkpoint(_FakeAccelerator(), cfg, 1, {"tokens": 0})
    assert saved.is_dir() and (saved / STATE_FILE).is_file()


def test_script_runs_without_a_sys_path_hack_and_shadows_no_module():
    source = (REPO / "train" / "layerskip.py").read_text()
    assert "sys.path" not in source
    # `python train/layerskip.py` puts train/ first on sys.path: none of its modules may hide another one
    names = [m.name for m in pkgutil.iter_modules([str(REPO / "train")])]
    shadowed = [n for n in names if n in sys.stdlib_module_names or _importable_elsewhere(n)]
    assert shadowed == []


def _importable_elsewhere(name: str) -> bool:
    import importlib.machinery

    paths = [p for p in sys.path if Path(p or ".").resolve() != (REPO / "train").resolve()]
    return importlib.machinery.PathFinder.find_spec(name, paths) is not None


def test_uncreatable_token_cache_is_one_line_before_loading(recipe, tmp_path, capsys, monkeypatch):
    import train.model

    monkeypatch.setattr(train.model, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    code, err = _main(capsys, "--config", str(recipe), "data.cache_dir=/proc/layerskip-no-such/tokens")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "data.cache_dir" in err


def test_truncate_metrics_by_line_count_or_by_step(tmp_path):
    from train.tracking import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    records = [{"step": 1}, {"step": 2}, {"step": 2, "split": "val"}, {"step": 3}]
    text = "".join(json.dumps(r) + "\n" for r in records) + '{"step": 4, "lo'  # last line cut by the kill
    path.write_text(text)
    truncate_metrics(path, 2, step=2)  # the checkpoint recorded 2 lines: the eval line came after it
    assert [json.loads(line) for line in path.read_text().splitlines()] == records[:2]
    path.write_text(text)
    truncate_metrics(path, None, step=2)  # older checkpoints: every record up to the step
    assert [json.loads(line) for line in path.read_text().splitlines()] == records[:3]


HOLD = """
import sys, time
from layerskip_core.locks import FileLock
assert FileLock(sys.argv[1]).acquire() is None
print("ready", flush=True)
time.sleep(60)
"""


def _holder(lock: Path):
    """Another process holding ``lock``, as a running training holds its folder's."""
    import os
    import subprocess

    lock.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.parametrize("extra", [(), ("--overwrite",), ("--resume",)])
def test_a_second_training_into_a_folder_in_use_is_refused_naming_the_holder(recipe, tmp_path, capsys, extra):
    out = tmp_path / "run"
    proc = _holder(out / RUN_LOCK)
    try:
        code, err = _main(capsys, "--config", str(recipe), *extra)
    finally:
        proc.kill()
        proc.wait()
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"{out} is in use by another training (pid {proc.pid} on " in err
    assert sorted(p.name for p in out.iterdir()) == [RUN_LOCK]  # no metrics, no checkpoint of the refused run


def test_the_lock_of_a_killed_training_is_taken_over_with_a_note(recipe, tmp_path, capsys):
    out = tmp_path / "run"
    proc = _holder(out / RUN_LOCK)
    proc.kill()  # SIGKILL: the stamp stays on disk
    proc.wait()
    stale = out / "checkpoints" / ".tmp-step-000001-otherhost-1"
    stale.mkdir(parents=True)
    (stale / "from-the-killed-run").write_text("x")
    code, err = _main(capsys, "--config", str(recipe))
    assert code == 0, err
    assert "taking it over" in err and f"pid {proc.pid}" in err
    assert _steps(out) == [1, 2] and not stale.exists() and not (out / RUN_LOCK).exists()
    assert not any((p / "from-the-killed-run").exists() for p in list_checkpoints(out))


def test_the_lock_is_released_when_a_training_fails(tiny_recipe):
    cfg = tiny_recipe("checkpoint.save_final=false")

    def fail(step):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        layerskip.run_training(cfg, on_step=fail)
    assert not (Path(cfg.checkpoint.output_dir) / RUN_LOCK).exists()


def _tree(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("inside", ["model.name_or_path", "data.sources", "data.cache_dir"])
def test_overwrite_refuses_a_run_that_reads_from_what_it_would_delete(recipe, tmp_path, tiny_model_dir, text_dir,
                                                                      capsys, inside):
    import shutil

    out = tmp_path / "run"
    with deadline(300):
        assert _main(capsys, "--config", str(recipe))[0] == 0
        shutil.copytree(tiny_model_dir if inside == "model.name_or_path" else text_dir, out / "final")
        value = {"model.name_or_path": f"model.name_or_path={out / 'final'}",
                 "data.sources": f"data.sources=[{{type: files, path: '{out / 'final'}'}}]",
                 "data.cache_dir": f"data.cache_dir={out / 'final' / 'tokens'}"}[inside]
        before = _tree(out)
        code, err = _main(capsys, "--config", str(recipe), value, "--overwrite")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"--overwrite would delete {out / 'final'}" in err and inside in err
    assert _tree(out) == before  # the previous run and the input are whole


@pytest.mark.parametrize("bad", ["model.name_or_path={missing}", "data.sources=[{{type: files, path: '{empty}'}}]"])
def test_overwrite_with_a_model_or_data_that_do_not_load_deletes_nothing(recipe, tmp_path, capsys, bad):
    out = tmp_path / "run"
    (tmp_path / "empty").mkdir()
    with deadline(300):
        assert _main(capsys, "--config", str(recipe))[0] == 0
        before = _tree(out)
        code, err = _main(capsys, "--config", str(recipe), "--overwrite",
                          bad.format(missing=tmp_path / "no-model", empty=tmp_path / "empty"))
    errors = [line for line in err.splitlines() if "error" in line]  # (the model's loading bar may come first)
    assert code == 2 and len(errors) == 1 and "Traceback" not in err
    assert _tree(out) == before


@pytest.mark.parametrize("kind", ["symlink", "folder", "fifo"])
def test_training_with_a_bad_run_lock_is_one_line_and_writes_nothing(recipe, tmp_path, capsys, kind):
    out = tmp_path / "run"
    out.mkdir()
    lock = out / RUN_LOCK
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    {"symlink": lambda: lock.symlink_to(target), "folder": lock.mkdir, "fifo": lambda: os.mkfifo(lock)}[kind]()
    with deadline(60):
        code, err = _main(capsys, "--config", str(recipe))
    assert code == 2 and f"lock file {lock} cannot be used" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert sorted(p.name for p in out.iterdir()) == [RUN_LOCK] and target.read_text() == "keep me\n"


def test_a_copied_checkpoint_folder_is_skipped_with_one_note(recipe, tmp_path, capsys):
    """Issue 67 item 14: ``cp -r step-000002 step-000002.bak`` broke --resume, a rerun's refusal and `layerskip
    export` with ``ValueError: invalid literal for int()``; a folder not named like a checkpoint is skipped, and
    each command says so once."""
    import shutil

    from train.checkpoint_export import find_checkpoint

    out = tmp_path / "run"
    assert _main(capsys, "--config", str(recipe))[0] == 0
    root = out / "checkpoints"
    shutil.copytree(root / "step-000002", root / "step-000002.bak")
    (root / "notes").mkdir()
    assert [p.name for p in list_checkpoints(out)] == ["step-000001", "step-000002"]
    assert find_checkpoint(out).name == "step-000002"
    assert capsys.readouterr().err.count("checkpoint by name (step-<step>): notes, step-000002.bak") == 1
    code, err = _main(capsys, "--config", str(recipe))  # a rerun is refused, naming the checkpoint to resume
    assert code == 2 and "from step-000002)" in err and err.count("not a checkpoint by name") == 1
    code, err = _main(capsys, "--config", str(recipe), "--resume", "optim.max_steps=3")
    assert code == 0, err
    assert err.count("step-000002.bak") == 1 and _steps(out) == [1, 2, 3]
    assert (root / "step-000002.bak").is_dir()  # never pruned: not this run's checkpoint
