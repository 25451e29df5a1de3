"""infer.kernels: one build per kernel source and torch version, shared by checkouts; no needless rebuild."""

from __future__ import annotations

import shutil

import pytest

from infer import kernels


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(kernels, "_loaded", {})


def test_build_folder_depends_on_source_and_torch_not_on_the_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("LAYERSKIP_CACHE", str(tmp_path / "cache"))
    here = kernels.build_dir("2.5.0")
    assert here.parent == tmp_path / "cache" / "kernels"
    other_checkout = tmp_path / "other" / "small_matmul.cpp"
    other_checkout.parent.mkdir()
    shutil.copy(kernels._SOURCE, other_checkout)
    monkeypatch.setattr(kernels, "_SOURCE", other_checkout)
    assert kernels.build_dir("2.5.0") == here  # same source elsewhere: same build
    assert kernels.build_dir("2.6.0") != here  # another torch: another build
    other_checkout.write_text(other_checkout.read_text() + "\n// changed\n")
    assert kernels.build_dir("2.5.0") != here  # changed source: another build


def test_torch_extensions_dir_is_respected(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert kernels.build_dir("2.5.0").parent == tmp_path / "ext"


def test_existing_build_is_imported_without_compiling_or_the_build_message(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("LAYERSKIP_KERNEL", raising=False)
    monkeypatch.setattr(kernels, "cpu_supported", lambda: True)
    built = []
    monkeypatch.setattr(kernels, "_build", lambda folder: built.append(folder) or "built")
    monkeypatch.setattr(kernels, "_import_library", lambda path: f"imported {path.name}")
    assert kernels.load() == "built" and len(built) == 1  # nothing there yet: builds
    folder = kernels.build_dir(torch.__version__)
    folder.mkdir(parents=True)
    (folder / f"{kernels.NAME}.so").write_bytes(b"")
    monkeypatch.setattr(kernels, "_loaded", {})
    assert kernels.load() == f"imported {kernels.NAME}.so" and len(built) == 1
    assert "building" not in capsys.readouterr().err
