"""Device and dtype names as users type them (``--device``, ``--dtype``), resolved in one place.

``auto`` means CUDA in bf16 when a GPU is visible, else the CPU in fp32: bf16 halves the weight
reads that bound decoding on a GPU, while on a CPU fp32 is both faster and exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from layerskip_core.errors import UserError

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
               "fp16": "float16", "float16": "float16"}
"""Accepted dtype names -> torch attribute names (torch itself is imported on first use, so that
``--help`` and argument errors of every command stay instant)."""
DTYPE_CHOICES = ("auto", "fp32", "bf16", "fp16")
DEVICE_HELP = "auto (CUDA when available, else CPU), cpu, cuda or cuda:N"


def parse_dtype(name: str | torch.dtype, device: torch.device | str | None = None) -> torch.dtype:
    """A torch dtype from its name; ``auto`` picks bf16 on CUDA and fp32 elsewhere."""
    import torch  # lazily: see DTYPE_NAMES

    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        dev = torch.device(device) if device is not None else resolve_device("auto")
        return torch.bfloat16 if dev.type == "cuda" else torch.float32
    if name not in DTYPE_NAMES:
        raise UserError(f"unknown dtype {name!r}; use one of {', '.join(DTYPE_CHOICES)}")
    return getattr(torch, DTYPE_NAMES[name])


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of a dtype (fp32, bf16, fp16) for stats and file names."""
    long = str(dtype).removeprefix("torch.")
    return next((short for short in ("fp32", "bf16", "fp16") if DTYPE_NAMES[short] == long), long)


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """``auto`` / ``cpu`` / ``cuda`` / ``cuda:N`` to a device that exists on this machine."""
    import torch  # lazily: see DTYPE_NAMES

    if isinstance(name, torch.device):
        name = str(name)
    name = name.strip().lower()
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        index = name.partition(":")[2]
        if index and not (index.isascii() and index.isdigit()):
            raise UserError(f"bad device {name!r}; use {DEVICE_HELP}")
        if not torch.cuda.is_available():
            raise UserError(f"--device {name}: CUDA is not available on this machine (torch "
                            f"{torch.__version__}); use --device cpu or auto")
        if index and int(index) >= torch.cuda.device_count():
            raise UserError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) visible")
        return torch.device(name)
    raise UserError(f"unknown device {name!r}; use {DEVICE_HELP}")
