"""The installed wheel: the help texts come from the field docstrings in the source, so the wheel must carry them; and
it carries the product only (the four packages and their data), none of the lab beside it in the checkout."""

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
"""What the wheel packages (pyproject.toml)."""
BESIDE = ("tools", "scripts", "tests", "recipes", "docs")
"""What lies beside the packages in a checkout and must stay out of the wheel."""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the checkout (the packages, the lab and tests beside them, the build files), so
    that building writes nothing here and a packaging rule that took the lab would show."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    for name in (*PACKAGES, *BESIDE):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp / "dist"), str(source)], check=True, capture_output=True, timeout=600, cwd=tmp)
    [built] = (tmp / "dist").glob("layerskip*.whl")
    return built


@pytest.mark.slow
def test_the_installed_wheel_shows_a_drafter_option_help(wheel, tmp_path):
    """Unpack the wheel as an install would (no checkout on the path) and read one help text."""
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


def package_files() -> set[str]:
    """Every module of the packages in the checkout, as a path inside the wheel."""
    return {p.relative_to(REPO).as_posix() for name in PACKAGES for p in (REPO / name).rglob("*.py")
            if "__pycache__" not in p.parts}


@pytest.mark.slow
def test_the_wheel_carries_the_product_and_no_lab_code(wheel):
    """Every file of the wheel lies in one of the four packages (or its metadata), every module of theirs is in it,
    and nothing of tools/, scripts/ or tests/ is, by path or under a package (a tools module by its path there)."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if not n.endswith("/")]
    meta = [n for n in names if n.split("/")[0].endswith(".dist-info")]
    carried = set(names) - set(meta)
    assert {n.split("/")[0] for n in carried} <= set(PACKAGES), sorted(carried)
    assert package_files() <= carried, sorted(package_files() - carried)
    lab = {p.relative_to(REPO / "tools").as_posix() for p in (REPO / "tools").rglob("*.py")} - {"__init__.py"}
    stray = sorted(n for n in carried if n.endswith(".py") and any(n.endswith("/" + x) for x in lab))
    assert not stray, f"the wheel carries lab modules under a package: {stray}"
    [record] = [n for n in meta if n.endswith("/entry_points.txt")]
    with zipfile.ZipFile(wheel) as zf:
        assert "layerskip = layerskip_cli.main:main" in zf.read(record).decode()


def test_field_docs_without_source_are_refused_not_empty():
    """A class whose source cannot be read (here: built at run time) is refused loudly, never given empty help."""
    cls = type("Built", (), {"__module__": "nowhere"})
    with pytest.raises(RuntimeError, match="source is not available"):
        own_field_docs(cls)
