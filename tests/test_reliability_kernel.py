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
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{kernels.NAME}.so").write_bytes(b"")
    monkeypatch.setattr(kernels, "_loaded", {})
    assert kernels.load() == f"imported {kernels.NAME}.so" and len(built) == 1
    assert "building" not in capsys.readouterr().err


HOLD = """
import sys, time
from layerskip_core.locks import FileLock
folder = sys.argv[1]
assert FileLock(folder + "/layerskip-build.lock").acquire() is None
open(folder + "/lock", "w").close()  # torch's build lock, as cpp_extension leaves it when killed
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def builder(tmp_path, monkeypatch):
    """A build folder with a fake compiler that records whether torch's stale lock was still there."""
    import torch

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("LAYERSKIP_KERNEL", raising=False)
    monkeypatch.setattr(kernels, "cpu_supported", lambda: True)
    folder = kernels.build_dir(torch.__version__)
    folder.mkdir(parents=True)
    saw_torch_lock = []
    monkeypatch.setattr(kernels, "_build", lambda f: saw_torch_lock.append((f / "lock").exists()) or "built")
    return folder, saw_torch_lock


def start_holder(folder):
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_build_killed_midway_does_not_block_the_next(builder, capsys):
    """kill -9 of the first builder: its locks stay on disk, yet the next run builds at once and says why."""
    import signal

    folder, saw_torch_lock = builder
    proc = start_holder(folder)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (folder / "lock").exists() and (folder / "layerskip-build.lock").exists()
    assert kernels.load() == "built" and saw_torch_lock == [False]
    err = capsys.readouterr().err
    assert f"removed {folder / 'lock'}" in err and f"pid {proc.pid}" in err
    assert not (folder / "layerskip-build.lock").exists()


def test_a_live_builder_is_waited_for_with_a_message_and_a_limit(builder, capsys, monkeypatch):
    folder, saw_torch_lock = builder
    monkeypatch.setattr(kernels, "BUILD_WAIT_S", 1.0)
    proc = start_holder(folder)
    try:
        with pytest.warns(UserWarning, match="has been building the kernel .* LAYERSKIP_KERNEL=torch"):
            assert kernels.load() is None  # gave up: torch.matmul
    finally:
        proc.kill()
        proc.wait()
    assert f"waiting for pid {proc.pid}" in capsys.readouterr().err
    assert saw_torch_lock == [] and (folder / "lock").exists()  # a live builder's lock is left alone
