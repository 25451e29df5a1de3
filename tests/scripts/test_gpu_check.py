"""scripts/gpu_check.py end to end on the CPU with tiny shapes: the documented JSON schema and the GPU.md block."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_gpu_check_tiny_on_cpu(tmp_path, capsys):
    gpu_check = load_script()
    (tmp_path / "GPU.md").write_text("# GPU\n\nintro kept\n\n<!-- gpu_check:begin -->\nold\n<!-- gpu_check:end -->\n"
                                     "\nafter kept\n")
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path)]) == 0, capsys.readouterr().err
    result = json.loads((tmp_path / "gpu" / "latest.json").read_text())
    assert {"device", "torch", "transformers", "commit", "date", "exact", "shapes"} <= set(result)
    assert result["device"] == "cpu" and result["tiny"] is True
    exact = result["exact"]
    assert exact["greedy_fp32_mismatches"] == 0 and exact["greedy_runs"] >= 12
    assert 0.0 <= exact["parity_max_abs"] < 1e-3
    assert set(result["shapes"]) == {"SmolLM2-135M", "Llama-3.2-1B-like", "Llama-2-7B-like"}
    for name, s in result["shapes"].items():
        for key in ("ms_forward", "ours_ar_tok_s", "hf_dynamic_tok_s", "hf_static_tok_s", "hf_early_exit_tok_s",
                    "ours_early_exit_tok_s"):
            assert isinstance(s[key], float) and s[key] > 0, (name, key)
        assert s["v"]["1"] == 1.0 and set(s["v"]) == {"1", "2", "4", "8"}
        assert len(s["c"]) == 3 and all(v > 0 for v in s["c"].values())
    assert "train" in result and result["e2e_ok"] is True
    page = (tmp_path / "GPU.md").read_text()
    assert "intro kept" in page and "after kept" in page and "\nold\n" not in page
    assert page.count("<!-- gpu_check:begin -->") == 1 and "| SmolLM2-135M |" in page
    assert "python scripts/gpu_check.py --device cpu" in page and result["commit"] in page
    assert "gpu_check:train:begin" in (tmp_path / "TRAINING.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_check_cuda_without_a_gpu(tmp_path, capsys):
    assert load_script().main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "CUDA is not available" in err and len(err.strip().splitlines()) == 1
