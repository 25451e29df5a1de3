"""What a training run refuses at launch and says on screen; exporting any checkpoint as a plain model folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from layerskip_cli.main import main as cli
from layerskip_core.errors import UserError
from train.console import (
    RELAUNCHED,
    check_launch,
    cpu_relaunch,
    interrupt_on_sigterm,
    requested_processes,
    sigterm_held,
)
from train.layerskip import run_training
from train.recipe import dump_config

REPO = Path(__file__).resolve().parents[2]
NO_GPU = lambda: False  # noqa: E731


def test_deepspeed_without_a_gpu_is_refused_in_one_line_by_local_rank_0_only():
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "WORLD_SIZE": "8", "LOCAL_RANK": "0"}
    with pytest.raises(UserError, match="DeepSpeed launch, but no GPU") as err:
        check_launch(env, [], NO_GPU)
    assert "cpu-ddp.yaml" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(SystemExit) as quiet:
        check_launch(env | {"LOCAL_RANK": "3"}, [], NO_GPU)
    assert quiet.value.code == 2
    check_launch(env, [], lambda: True)  # with a GPU it goes ahead


def test_one_process_cpu_launch_of_two_becomes_the_launch_of_two_synchronised_processes():
    command = ["/venv/bin/python", "/venv/bin/accelerate", "launch", "--num_processes", "2", "--cpu", "train/x.py"]
    assert requested_processes(command) == 2
    assert requested_processes(["python", "-m", "accelerate.commands.launch", "--num-processes=3", "x.py"]) == 3
    assert requested_processes(["python", "train/layerskip.py", "--num_processes", "2"]) == 1  # not accelerate's
    relaunch = cpu_relaunch({"ACCELERATE_USE_CPU": "True"}, command, "train/x.py", ["--config", "r.yaml"])
    assert relaunch[1:] == ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "train/x.py",
                            "--config", "r.yaml"]
    assert cpu_relaunch({"WORLD_SIZE": "2"}, command, "x.py", []) is None  # the processes did start
    assert cpu_relaunch({}, ["python", "train/layerskip.py"], "x.py", []) is None
    with pytest.raises(UserError, match="started one process again"):  # never a loop of relaunches
        cpu_relaunch({RELAUNCHED: "1"}, command, "x.py", [])


@pytest.mark.slow
def test_real_accelerate_cpu_launch_of_two_processes_trains_two_synchronised_processes(tiny_recipe, tmp_path):
    cfg = tiny_recipe("optim.max_steps=2", "checkpoint.save_every=2", output="two")
    recipe = tmp_path / "r.yaml"
    dump_config(cfg, recipe)
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"} | {"OMP_NUM_THREADS": "1",
                                                                               "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--cpu",
                           str(REPO / "train/layerskip.py"), "--config", str(recipe)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("started one process; running the 2 synchronised CPU processes") == 1
    assert "Traceback" not in proc.stderr
    metrics = (Path(cfg.checkpoint.output_dir) / "metrics.jsonl").read_text().splitlines()
    digests = [r["param_digest"] for r in map(json.loads, metrics) if "param_digest" in r]
    assert digests and len(digests[0]) == 2  # two processes trained together


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_evaluations_are_one_line_on_screen_and_any_checkpoint_exports(tiny_recipe, tmp_path, capsys, lora):
    from tiny_models import save_tiny

    tied = save_tiny(tmp_path / "tied", seed=4, tie_word_embeddings=True)
    cfg = tiny_recipe(f"model.name_or_path={tied}", "early_exit.exits=[1, 2]", "logging.eval_every=2",
                      "checkpoint.save_every=2", "optim.max_steps=4", f"lora.enabled={str(lora).lower()}")
    run_training(cfg)
    err = capsys.readouterr().err
    evals = [line for line in err.splitlines() if "layerskip-train: eval: final loss" in line]
    assert len(evals) == 2 and "E1 agree" in evals[0] and "E2 agree" in evals[0]
    assert "Removed shared tensor" not in err and "is_gradient_checkpointing" not in err
    run = Path(cfg.checkpoint.output_dir)
    assert cli(["export", str(run), "--out", str(tmp_path / "step4")]) == 0  # a run folder: its newest checkpoint
    final = load_file(run / "final" / "model.safetensors")
    exported = load_file(tmp_path / "step4" / "model.safetensors")
    assert final.keys() == exported.keys() and all(torch.equal(final[k], exported[k]) for k in final)
    assert cli(["export", str(run / "checkpoints" / "step-000002"), "--out", str(tmp_path / "step2")]) == 0
    earlier = load_file(tmp_path / "step2" / "model.safetensors")
    assert any(not torch.equal(earlier[k], final[k]) for k in final)
    capsys.readouterr()
    assert cli(["export", str(run), "--out", str(tmp_path / "step2")]) == 2  # never overwritten
    assert "already exists" in capsys.readouterr().err


def test_export_refuses_what_is_not_a_checkpoint(tmp_path, capsys):
    assert cli(["export", str(tmp_path), "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "is neither a checkpoint" in err and len(err.strip().splitlines()) == 1


def test_train_help_names_the_command(capsys):
    with pytest.raises(SystemExit):
        cli(["train", "--help"])
    assert capsys.readouterr().out.startswith("usage: layerskip train")


@pytest.mark.slow
def test_sigterm_ends_a_run_with_the_resume_hint(tiny_recipe, tmp_path):
    cfg = tiny_recipe("optim.max_steps=100000", "checkpoint.save_every=1", "checkpoint.save_final=false")
    recipe = tmp_path / "r.yaml"
    dump_config(cfg, recipe)
    env = os.environ | {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO),
                        "PYTHONFAULTHANDLER": "1"}  # a process that will not end shows every thread's stack
    proc = subprocess.Popen([sys.executable, str(REPO / "train/layerskip.py"), "--config", str(recipe)],
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    deadline = time.monotonic() + 240
    while not list((Path(cfg.checkpoint.output_dir) / "checkpoints").glob("step-*")) and time.monotonic() < deadline:
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    try:
        err = proc.communicate(timeout=120)[1]
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)  # faulthandler prints the stacks on its way out
        pytest.fail("the run did not end within 120 s of SIGTERM; its stderr:\n" + proc.communicate()[1][-6000:])
    assert proc.returncode == 130, err[-2000:]
    assert f"continue with: python train/layerskip.py --config {recipe} --resume" in err
    assert "Traceback" not in err and err.count("interrupted") == 1  # the hint says it, once


def test_a_sigterm_during_a_save_arrives_when_the_save_is_done():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        interrupt_on_sigterm()
        done = []
        with pytest.raises(KeyboardInterrupt):
            with sigterm_held():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # the signal is handled here: recorded, not raised
                done.append("saved")
        assert done == ["saved"]
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # the run's handler is back
        with sigterm_held():  # nothing received: nothing raised on leaving
            pass
    finally:
        signal.signal(signal.SIGTERM, previous)
