"""The help texts come from the field docstrings in the source: an installed wheel must carry them."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from layerskip_core.options import own_field_docs

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("layerskip_core", "train", "infer", "layerskip_cli")
"""What the wheel packages (pyproject.toml), copied with its build files so that building writes nothing here."""


@pytest.mark.slow
def test_the_installed_wheel_shows_a_drafter_option_help(tmp_path):
    """Build the wheel, unpack it as an install would (no checkout on the path) and read one help text."""
    source = tmp_path / "source"
    for name in PACKAGES:
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True, timeout=600,
                   cwd=tmp_path)
    [wheel] = (tmp_path / "dist").glob("layerskip*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    code = ("import infer.drafters.early_exit as m; from layerskip_core.options import field_docs; "
            f"assert m.__file__.startswith({str(site)!r}), m.__file__; "
            "print(field_docs(m.EarlyExitDrafterConfig)['num_draft'])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "most tokens drafted per verification" in proc.stdout


def test_field_docs_without_source_are_refused_not_empty():
    """A class whose source cannot be read (here: built at run time) is refused loudly, never given empty help."""
    cls = type("Built", (), {"__module__": "nowhere"})
    with pytest.raises(RuntimeError, match="source is not available"):
        own_field_docs(cls)
