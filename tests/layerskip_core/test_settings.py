"""Settings are resolved once, at the edge: one thread by default everywhere, the environment read only there."""

import pytest
import torch

from layerskip_cli.main import main
from layerskip_core.errors import UserError
from layerskip_core.settings import ModelSettings, RunSettings


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


@pytest.mark.parametrize("threads", [0, -1, 1.5, True])
def test_bad_thread_counts_are_refused(threads):
    with pytest.raises(UserError, match="--threads must be an integer >= 1"):
        RunSettings(threads=threads)


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
