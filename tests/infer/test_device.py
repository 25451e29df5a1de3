"""--device / --dtype on every model-loading command: plumbing on CPU, a missing GPU refused in one line."""

import json
from pathlib import Path

import pytest
import torch

from layerskip_cli.main import main

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_generate_reports_device_and_dtype(capsys, tiny_model_dir, device):
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--json",
                             "--max-new-tokens", "4", "--device", device)
    assert code == 0, err
    stats = json.loads(out)["stats"]
    expected = "cuda" if device == "auto" and torch.cuda.is_available() else "cpu"
    assert stats["device"].startswith(expected)
    assert stats["dtype"] == ("bf16" if expected == "cuda" else "fp32")  # auto: bf16 on CUDA, fp32 on CPU
    assert stats["lossy"] is False


def test_generate_bf16_says_outputs_may_differ_at_near_ties(capsys, tiny_model_dir):
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--json",
                             "--max-new-tokens", "4", "--device", "cpu", "--dtype", "bf16",
                             "--drafter", "early_exit", "--exit-layer", "2")
    assert code == 0, err
    assert json.loads(out)["stats"]["dtype"] == "bf16"
    assert err.count("near-tie") == 1 and "identical in fp32" in err
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--json",
                           "--max-new-tokens", "4", "--device", "cpu", "--drafter", "early_exit", "--exit-layer", "2")
    assert code == 0 and "near-tie" not in err  # fp32: the contract is exact, nothing to say


def test_bench_records_device_and_dtype(tiny_model_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n')
    out = tmp_path / "out"
    code = main(["bench", "--model", str(tiny_model_dir), "--drafters", "autoregressive", "--peers", "hf_generate",
                 "--data", str(prompts), "--n", "1", "--max-new-tokens", "4", "--repeats", "1", "--out", str(out),
                 "--quiet", "--device", "cpu", "--dtype", "fp32"])
    assert code == 0, capsys.readouterr().err
    payload = json.loads((out / "results.json").read_text())
    assert payload["meta"]["device"] == "cpu" and payload["meta"]["dtype"] == "fp32"
    assert payload["config"]["run"]["device"] == "cpu"
    assert "(cpu)" in (out / "results.md").read_text()


@NO_CUDA
@pytest.mark.parametrize("command", [
    ["generate", "--prompt", "hi"],
    ["bench", "--data", "humaneval", "--out", "OUT"],
    ["search", "--data", "humaneval", "--out", "OUT.json"],
    ["eval-exits", "--data", "humaneval"],
])
def test_cuda_without_a_gpu_is_one_line(capsys, tiny_model_dir, tmp_path, command):
    argv = [a.replace("OUT", str(tmp_path / "o")) for a in command]
    code, out, err = run_cli(capsys, *argv, "--model", str(tiny_model_dir), "--device", "cuda")
    assert code == 2
    assert "CUDA is not available" in err and "--device cpu" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@NO_CUDA
def test_scripts_refuse_cuda_without_a_gpu(tiny_model_dir):
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "tools.bench.bench_verify_cost", "--model", str(tiny_model_dir),
                           "--device", "cuda"], capture_output=True, text=True, cwd=repo)
    assert proc.returncode == 2 and "CUDA is not available" in proc.stderr and "Traceback" not in proc.stderr


def test_executor_flag_static_equals_eager_and_graphs_need_cuda(capsys, tiny_model_dir):
    args = ["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--json", "--max-new-tokens", "6",
            "--device", "cpu", "--drafter", "early_exit", "--exit-layer", "2", "--num-draft", "3"]
    outputs = {}
    for executor in ("eager", "static"):
        code, out, err = run_cli(capsys, *args, "--executor", executor)
        assert code == 0, err
        row = json.loads(out)
        assert row["stats"]["executor"] == executor
        outputs[executor] = row["tokens"]
    assert outputs["static"] == outputs["eager"]
    if not torch.cuda.is_available():
        code, out, err = run_cli(capsys, *args, "--executor", "graphs")
        assert code == 2 and out == "" and "CUDA graphs need a CUDA device" in err
        assert len(err.strip().splitlines()) == 1


def test_auto_dtype_follows_the_requested_device_not_the_machine(tiny_model_dir, monkeypatch):
    """dtype 'auto' on an explicit CPU device is fp32 even where CUDA exists (it used to resolve against CUDA)."""
    from infer.model.runner import Runner
    from layerskip_core.settings import RunSettings

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    run = RunSettings(device="cpu", dtype="auto").resolve()
    assert run.dtype == torch.float32 and run.executor == "eager"
    runner = Runner.from_pretrained(tiny_model_dir, dtype=run.dtype, device=run.device, executor=run.executor)
    assert runner.dtype == torch.float32


def test_graph_capture_and_replay_run_on_the_runners_device():
    """Streams, graph pools and graphs follow the current CUDA device, not a tensor's: capture and replay of a
    runner on cuda:1 happen inside torch.cuda.device(cuda:1) (built here without entering it: no GPU needed)."""
    from contextlib import nullcontext

    from infer.model.graphs import _on_device

    context = _on_device(torch.device("cuda:1"), capture=True)
    assert isinstance(context, torch.cuda.device) and context.idx == 1
    assert isinstance(_on_device(torch.device("cpu"), capture=False), nullcontext)
