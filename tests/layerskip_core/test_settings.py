"""Settings are resolved once, at the edge: one thread by default everywhere, the environment read only there."""

import os

import pytest
import torch

from layerskip_cli.main import main
from layerskip_core.errors import UserError
from layerskip_core.settings import ModelSettings, RunSettings, resolve_compile


def test_resolved_settings_are_concrete(monkeypatch):
    monkeypatch.delenv("LAYERSKIP_EXECUTOR", raising=False)
    monkeypatch.delenv("LAYERSKIP_KERNEL", raising=False)
    run = RunSettings(device="cpu").resolve()
    assert (run.device, run.dtype, run.executor, run.threads, run.kernel) == \
        (torch.device("cpu"), torch.float32, "eager", 1, "auto")


def test_the_environment_is_read_by_the_resolution_only(monkeypatch):
    monkeypatch.setenv("LAYERSKIP_KERNEL", "torch")
    monkeypatch.setenv("LAYERSKIP_EXECUTOR", "static")
    run = RunSettings(device="cpu").resolve()
    assert (run.kernel, run.executor) == ("torch", "static")
    assert RunSettings(device="cpu", executor="eager").resolve().executor == "eager"  # a flag wins over the variable
    monkeypatch.setenv("LAYERSKIP_KERNEL", "fast")
    with pytest.raises(UserError, match="LAYERSKIP_KERNEL='fast'"):
        RunSettings(device="cpu").resolve()


def test_compile_is_resolved_with_the_other_settings(tiny_model_dir):
    """--compile/--no-compile resolve to a bool at the edge (default: on CUDA only); the runner takes it as it is."""
    from infer.loading import load_resolved

    assert RunSettings(device="cpu").resolve().compile is False
    assert RunSettings(device="cpu", compile=True).resolve().compile is True
    assert resolve_compile(None, torch.device("cuda")) and not resolve_compile(False, torch.device("cuda"))
    run = ModelSettings(device="cpu", executor="static", compile=False, model=str(tiny_model_dir)).resolve()
    assert run.to_dict()["compile"] is False
    assert not load_resolved(run).runner.static.compile


@pytest.mark.parametrize("threads", [0, -1, 1.5, True, 10**9, 1e9, 4 * (os.cpu_count() or 1) + 1])
def test_bad_thread_counts_are_refused(threads):
    with pytest.raises(UserError, match=r"--threads must be an integer in \[1, "):
        RunSettings(threads=threads)
    assert RunSettings(threads=4 * (os.cpu_count() or 1)).threads == 4 * (os.cpu_count() or 1)


@pytest.mark.parametrize("argv", [["generate", "--prompt", "x", "--threads", "1000000000"],
                                  ["bench", "--threads", "1000000000", "--out", "never-written"]])
def test_a_huge_thread_count_is_one_line_before_any_model_loads(argv, capsys, tmp_path, monkeypatch):
    from layerskip_cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--threads must be an integer in [1, " in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_scripts_and_training_bound_threads_too(tmp_path):
    import eval_adapter

    from train.recipe import load_config

    with pytest.raises(UserError, match="threads must be an integer in"):
        load_config(None, ["threads=1000000000"])
    assert eval_adapter.main(["--adapter", "a", "--config", "c", "--threads", "1000000000"]) == 2


def test_model_settings_resolve_the_folder_once(tiny_model_dir):
    run = ModelSettings(device="cpu", model=str(tiny_model_dir)).resolve()
    assert run.model.resolve() == tiny_model_dir.resolve() and run.device == torch.device("cpu")


def test_one_thread_by_default_everywhere(tiny_model_dir, capsys):
    """generate, the Python API, bench and search share one default (1) and --threads overrides it."""
    from infer.loading import load_model

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        load_model(str(tiny_model_dir), device="cpu")
        assert torch.get_num_threads() == 1
        load_model(str(tiny_model_dir), device="cpu", threads=2)
        assert torch.get_num_threads() == 2
        assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--max-new-tokens", "2",
                     "--device", "cpu"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    for command in ("generate", "bench", "search"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        help_text = " ".join(capsys.readouterr().out.split())
        assert "(default 1)" in help_text.split("--threads INT torch CPU threads", 1)[1][:200], command


def test_a_drafters_config_is_built_once_and_its_draft_vocab_resolved_once(tiny_model_dir):
    """LoadedModel.engine takes a Config as it is and resolves its draft_vocab into the drafter's draft head (the tiny
    model has no shipped counts: 'auto' is the full head), never changing the Config."""
    from infer.drafters import build_config
    from infer.loading import load_model

    config = build_config("early_exit", {"E": "2", "k": "3"})
    assert build_config("early_exit", config) is config
    model = load_model(str(tiny_model_dir), device="cpu")
    with model.engine("early_exit", config) as engine:
        assert engine.drafter.config is config and config.draft_vocab == "auto" and engine.drafter.vocab is None
        assert (engine.drafter.config.exit_layer, engine.drafter.config.num_draft) == (2, 3)
    with pytest.raises(UserError, match="'autoregressive' takes a dict of options or its AutoregressiveConfig"):
        model.engine("autoregressive", config)


@pytest.mark.real_model
def test_auto_draft_vocab_of_the_default_model_is_resolved_at_the_edge(default_model_path):
    from infer.loading import load_model
    from layerskip_core.draft_vocab import AUTO_SIZE

    model = load_model(str(default_model_path), device="cpu")
    with model.engine("early_exit", exit_layer=8) as engine:
        assert engine.drafter.config.draft_vocab == "auto" and engine.drafter.vocab.size == AUTO_SIZE
