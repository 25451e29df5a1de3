"""core.models: model folders checked before loading, the default model's completion marker, hub ids."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from layerskip_core import models
from layerskip_core.errors import UserError
from layerskip_core.models import fetch_default_model, resolve_model
from tiny_models import save_tiny

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny"))


def _copy(src: Path, dest: Path, cut: int | None = None, weights: bool = True) -> Path:
    shutil.copytree(src, dest)
    weights_file = dest / "model.safetensors"
    if not weights:
        weights_file.unlink()
    elif cut is not None:
        weights_file.write_bytes(weights_file.read_bytes()[:cut])
    return dest


def test_folder_without_weights_is_refused(tiny_dir, tmp_path):
    folder = _copy(tiny_dir, tmp_path / "m", weights=False)
    with pytest.raises(UserError, match="no weights"):
        resolve_model(folder)


@pytest.mark.parametrize("cut", [4, 100, 20_000])
def test_cut_short_safetensors_is_refused(tiny_dir, tmp_path, cut):
    folder = _copy(tiny_dir, tmp_path / "m", cut=cut)
    with pytest.raises(UserError, match="model.safetensors"):
        resolve_model(folder)
    assert resolve_model(tiny_dir) == tiny_dir


def test_missing_shard_is_refused(tiny_dir, tmp_path):
    folder = _copy(tiny_dir, tmp_path / "m")
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-00002-of-00002.safetensors"}}')
    with pytest.raises(UserError, match="model-00002-of-00002"):
        resolve_model(folder)


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "layerskip_cli", *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_fetch_model_refuses_a_foreign_folder_with_cut_short_weights(tiny_dir, tmp_path):
    folder = _copy(tiny_dir, tmp_path / "m", cut=1000)
    proc = _cli("fetch-model", "--dest", str(folder))
    assert proc.returncode == 2 and str(folder) not in proc.stdout
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and "not empty" in proc.stderr


def test_cut_short_default_model_dir_is_refused_through_the_environment(tiny_dir, tmp_path, monkeypatch):
    folder = _copy(tiny_dir, tmp_path / "m", cut=1000)
    monkeypatch.setenv("LAYERSKIP_MODEL_DIR", str(folder))
    with pytest.raises(UserError):
        resolve_model("default")


@pytest.mark.parametrize("dest", ["/proc/layerskip-no-such/m", "file/m"])
def test_unwritable_destination_fails_before_fetching_or_converting(tmp_path, dest):
    (tmp_path / "file").write_text("x")
    target = dest if dest.startswith("/") else str(tmp_path / dest)
    proc = _cli("fetch-model", "--dest", target, env={"LAYERSKIP_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "converting" not in proc.stderr and "fetching" not in proc.stderr


def test_unwritable_cache_fails_before_converting(tmp_path):
    proc = _cli("fetch-model", "--dest", str(tmp_path / "m"), env={"LAYERSKIP_CACHE": "/proc/layerskip-no-such"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "LAYERSKIP_CACHE" in proc.stderr
    assert "converting" not in proc.stderr


@pytest.fixture
def fake_conversion(monkeypatch, tiny_dir, tmp_path):
    """Conversion writes the tiny model (no download); returns the list of conversions made."""
    calls = []
    monkeypatch.setattr(models, "fetch_packaged_file", lambda *a, **k: tmp_path / "fake.gguf")

    def convert(gguf, out_dir):
        calls.append(out_dir)
        for f in tiny_dir.iterdir():
            shutil.copy(f, out_dir / f.name)
        os.chmod(out_dir / "model.safetensors", 0o600)  # as safetensors writes it

    monkeypatch.setattr(models, "_convert_gguf", convert)
    monkeypatch.setenv("LAYERSKIP_CACHE", str(tmp_path / "cache"))
    return calls


def test_conversion_writes_marker_last_with_normal_permissions(tmp_path, fake_conversion):
    dest = fetch_default_model(tmp_path / "models" / "m", log=lambda _: None)
    assert (dest / models.COMPLETE_FILE).is_file() and (dest / models.PROVENANCE_FILE).is_file()
    mask = os.umask(0o022)
    os.umask(mask)
    assert dest.stat().st_mode & 0o777 == 0o777 & ~mask
    assert (dest / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask
    assert fetch_default_model(dest, log=lambda _: None) == dest and len(fake_conversion) == 1
    assert [p.name for p in dest.parent.iterdir()] == ["m"]  # no temporary folder left


def test_damaged_converted_folder_is_converted_again(tmp_path, fake_conversion):
    dest = fetch_default_model(tmp_path / "m", log=lambda _: None)
    weights = dest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    logged = []
    assert fetch_default_model(dest, log=logged.append) == dest and len(fake_conversion) == 2
    assert any("converting it again" in m for m in logged)
    assert models.weights_problem(dest) is None


def test_full_verification_catches_a_changed_file_of_equal_size(tmp_path, fake_conversion):
    dest = fetch_default_model(tmp_path / "m", log=lambda _: None)
    data = bytearray((dest / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (dest / "model.safetensors").write_bytes(bytes(data))
    assert fetch_default_model(dest, log=lambda _: None) == dest and len(fake_conversion) == 1  # sizes only
    fetch_default_model(dest, log=lambda _: None, verify=True)  # what `layerskip fetch-model` does
    assert len(fake_conversion) == 2


def test_older_conversion_without_marker_is_marked_not_converted(tmp_path, fake_conversion):
    dest = fetch_default_model(tmp_path / "m", log=lambda _: None)
    (dest / models.COMPLETE_FILE).unlink()
    os.chmod(dest, 0o700)
    assert fetch_default_model(dest, log=lambda _: None) == dest and len(fake_conversion) == 1
    assert (dest / models.COMPLETE_FILE).is_file() and dest.stat().st_mode & 0o077 != 0


def test_hub_id_offline_is_one_line_naming_the_model_and_a_local_folder(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as err:
        resolve_model("facebook/layerskip-llama3.2-1B")
    message = str(err.value)
    assert "facebook/layerskip-llama3.2-1B" in message and "offline" in message and "local folder" in message
    assert "\n" not in message


def test_local_folder_wins_over_a_hub_id_of_the_same_spelling(tiny_dir, tmp_path, monkeypatch):
    shutil.copytree(tiny_dir, tmp_path / "org" / "name")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("org/name") == Path("org/name")


def test_hub_id_uses_snapshot_download(tiny_dir, monkeypatch):
    import huggingface_hub

    seen = []

    def fake_snapshot(repo_id, **kwargs):
        seen.append(repo_id)
        return str(tiny_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    assert resolve_model("someorg/somemodel", log=lambda _: None) == tiny_dir and seen == ["someorg/somemodel"]


def test_folder_without_tokenizer_or_with_broken_config_is_refused(tiny_dir, tmp_path):
    no_tok = _copy(tiny_dir, tmp_path / "a")
    for f in no_tok.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(UserError, match="no tokenizer"):
        resolve_model(no_tok)
    broken = _copy(tiny_dir, tmp_path / "b")
    (broken / "config.json").write_text('{"model_type": "lla')
    with pytest.raises(UserError, match="config.json is not readable JSON"):
        resolve_model(broken)


def test_cut_short_tokenizer_or_torch_bin_is_refused(tiny_dir, tmp_path):
    import torch

    tok = _copy(tiny_dir, tmp_path / "a")
    (tok / "tokenizer.json").write_bytes((tok / "tokenizer.json").read_bytes()[:100])
    with pytest.raises(UserError, match="tokenizer.json"):
        resolve_model(tok)
    binary = _copy(tiny_dir, tmp_path / "b", weights=False)
    torch.save({"w": torch.zeros(100)}, binary / "pytorch_model.bin")
    assert resolve_model(binary) == binary
    (binary / "pytorch_model.bin").write_bytes((binary / "pytorch_model.bin").read_bytes()[:200])
    with pytest.raises(UserError, match="pytorch_model.bin is cut short"):
        resolve_model(binary)
