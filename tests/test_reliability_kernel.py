"""infer.kernels: one build per kernel source and torch version, shared by checkouts; no needless rebuild."""

from __future__ import annotations

import _json
import shutil
from pathlib import Path

import pytest

from infer import kernels

ELF = Path(_json.__file__) if getattr(_json, "__file__", "").endswith(".so") else None
"""A real shared library to stand in for a built kernel (the interpreter's own ``_json`` extension)."""


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
    shutil.copyfile(ELF, folder / f"{kernels.NAME}.so")
    kernels.stamp(folder / f"{kernels.NAME}.so")
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


@pytest.fixture
def built(tmp_path, monkeypatch):
    """A build folder whose fake compiler copies a real shared library in (as a build leaves it) and counts builds;
    importing is recorded, never done."""
    import torch

    if ELF is None:
        pytest.skip("no shared-library extension module to stand in for the kernel")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("LAYERSKIP_KERNEL", raising=False)
    monkeypatch.setattr(kernels, "cpu_supported", lambda: True)
    folder = kernels.build_dir(torch.__version__)
    folder.mkdir(parents=True)
    library = folder / f"{kernels.NAME}.so"
    builds = []

    def fake_build(f):
        shutil.copyfile(ELF, library)
        builds.append(f)
        return "built"

    monkeypatch.setattr(kernels, "_build", fake_build)
    monkeypatch.setattr(kernels, "_import_library", lambda path: f"imported {path.name}")
    return library, builds


def test_a_build_stamps_its_library_and_a_stamped_library_is_imported(built, monkeypatch):
    library, builds = built
    assert kernels.load() == "built" and len(builds) == 1
    assert kernels.is_whole(library) and library.with_name(library.name + kernels.STAMP_SUFFIX).is_file()
    monkeypatch.setattr(kernels, "_loaded", {})
    assert kernels.load() == f"imported {library.name}" and len(builds) == 1


@pytest.mark.parametrize("stamped", [True, False])
@pytest.mark.parametrize("damage", ["cut off", "one byte changed", "grown"])
def test_a_damaged_library_is_rebuilt_not_imported(built, monkeypatch, stamped, damage):
    """A library cut off by a full disk or a killed copy killed every later run with SIGBUS: it is rebuilt."""
    library, builds = built
    shutil.copyfile(ELF, library)
    if stamped:
        kernels.stamp(library)
    data = library.read_bytes()
    if damage == "cut off":
        data = data[:len(data) // 2]
    elif damage == "one byte changed":
        mid = len(data) // 2
        data = data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:]
    else:
        data += b"\0" * 4096
    library.write_bytes(data)
    # without a stamp a library damaged at full length was imported (its ELF headers look whole) and segfaulted:
    # a library without a stamp is never trusted (issue 67 item 16)
    assert kernels.load() == "built" and len(builds) == 1
    assert kernels.is_whole(library) and library.read_bytes() == ELF.read_bytes()


def test_a_whole_library_without_a_stamp_is_rebuilt_once(built, monkeypatch):
    """A build from before stamps (or one whose stamp was lost) cannot be told from one damaged at full length: it is
    rebuilt once, stamped, then imported."""
    library, builds = built
    shutil.copyfile(ELF, library)
    assert not kernels.is_whole(library)
    assert kernels.load() == "built" and len(builds) == 1 and kernels.is_whole(library)
    monkeypatch.setattr(kernels, "_loaded", {})
    assert kernels.load() == f"imported {library.name}" and len(builds) == 1


@pytest.mark.parametrize("content", [b"", b"\x7fELF", b"not a library at all" * 100])
def test_a_library_that_is_no_elf_file_is_rebuilt(built, content):
    library, builds = built
    library.write_bytes(content)
    assert kernels.load() == "built" and len(builds) == 1
