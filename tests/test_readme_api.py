"""The README's "Python API" block runs as it stands on the default model (CI fetches it)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def api_block() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Python API", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the Python API section should hold one python block"
    return blocks[0]


@pytest.mark.real_model
def test_readme_python_api_runs(default_model_path, tmp_path):
    """From a folder outside the checkout: the block's paths do not depend on where it runs."""
    proc = subprocess.run([sys.executable, "-c", api_block()], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=os.environ | {"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert any("tok/s, acceptance" in line for line in lines)  # the stats were read


def test_api_names_are_exported():
    import infer

    for name in re.findall(r"`(\w+)`", (REPO / "README.md").read_text().split("Exported from `infer`:")[1]
                           .split("\n\n")[0]):
        assert hasattr(infer, name), name


@pytest.mark.real_model
def test_readme_transformers_block_runs(default_model_path):
    """The README's block for transformers' generate: greedy equals plain generate, sampling returns stats."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Inside transformers' `generate`", 1)[1].split("\n## ", 1)[0]
    [block] = re.findall(r"```python\n(.*?)```", section, re.S)
    proc = subprocess.run([sys.executable, "-c", block], cwd=default_model_path, capture_output=True, text=True,
                          timeout=600, env=os.environ | {"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
