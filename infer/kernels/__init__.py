"""Optional C++ kernel for small-batch matmuls on x86 CPUs: fp32 (AVX-512 where the CPU has it, else AVX2 + FMA)
and bf16 (CPUs with AVX512_BF16 only). The path is chosen once per process from cpuid (``module.path()``,
``supports(module, dtype)``); ``LAYERSKIP_KERNEL_ISA=avx2`` forces the AVX2 path. Why it is built the way it
is, and what torch's own routes measured beside it: docs/KERNELS.md. On the AVX-512 path the matmuls read weights
packed once, at load, into panels (``panels.cpp``; ``infer.kernels.panels`` packs and places them).

The same module runs a runner's decoder layers as one C++ call (``LayerStack``, ``layer_span.cpp``; the Python side
and what it covers: ``infer.model.fused_span``), bitwise what the Python layer loop computes.

The module also has the gated MLP's activation row by row (``gated_act``, ``activation.cpp``: SiLU or GELU-tanh, the
same bits for a row whatever T and the threads), which ``infer.model.layer_math`` calls wherever the matmuls run here.

Built on first use with ``torch.utils.cpp_extension`` (about a minute) from its sources (``SOURCES``: the five C++
files and their header, one extension), into a folder keyed by a
hash of the kernel sources and compiler flags, the torch version and the Python version:
``$TORCH_EXTENSIONS_DIR/layerskip_small_matmul-<key>`` when that variable is set, otherwise
``$LAYERSKIP_CACHE/kernels/layerskip_small_matmul-<key>`` (``~/.cache/layerskip/kernels/...``).
Every checkout and virtualenv with the same source and torch therefore shares one build; once
the library exists it is imported directly (no compiler or ninja run). A build runs under the project's
lock (``layerskip_core.locks``: one builder at a time, a waiting process says whom it waits for and gives
up after ``BUILD_WAIT_S``); a build killed midway leaves no lock that blocks the next one (torch's own
``lock`` file, left behind by a killed build, is removed by the next builder). A library is imported only when it
is whole: a build writes a stamp beside it (``STAMP_SUFFIX``: size and SHA-256) once it succeeded, and a library
whose stamp disagrees or is missing is rebuilt (importing a cut-off or damaged library kills the process with SIGBUS
or SIGSEGV, with no message, on every later run). Where the kernel cannot be
built or the CPU lacks AVX2/FMA, ``load()`` returns None and the runner uses ``torch.matmul`` (the portable path);
set ``LAYERSKIP_KERNEL=torch`` (read by ``layerskip_core.settings``) to force that.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import warnings
from pathlib import Path

from layerskip_core.locks import FileLock
from layerskip_core.packages import cache_root

_HERE = Path(__file__).parent
_SOURCE = _HERE / "small_matmul.cpp"
SOURCES = ("panels.cpp", "attention.cpp", "activation.cpp", "layer_span.cpp", "quant.cpp", "kernels.h")
"""Beside ``small_matmul.cpp`` (``_SOURCE``), compiled into the same extension (a header is copied, not compiled)."""
NAME = "layerskip_small_matmul"
CFLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp")
"""``-ffp-contract=off``: no product and sum contracted into one FMA where the source writes two operations (the fused
layer span's elementwise arithmetic must round as torch's ops do; the kernel's FMAs are explicit intrinsics).
``-fopenmp``: ``at::parallel_for`` is a header template that, under torch's OpenMP backend, splits work with an
``omp parallel`` pragma compiled into this extension; without the flag the pragma is ignored and every call runs on
one thread whatever ``torch.set_num_threads`` says (measured: 2 threads no faster than 1 until this flag)."""
LDFLAGS = ("-fopenmp",)
"""Link flags: the OpenMP runtime the pragmas call (torch's own, already loaded in the process)."""
BUILD_WAIT_S = 900.0
"""Longest wait for another process's build of the kernel before falling back to ``torch.matmul``."""
TORCH_LOCK = "lock"
"""The file ``torch.utils.cpp_extension`` creates in the build folder while it builds (and leaves when killed)."""
STAMP_SUFFIX = ".sha256"
"""Beside the library: ``<size> <sha256>`` of the library as the build that made it left it."""
_loaded: dict[str, object] = {}


def supports(module, dtype) -> bool:
    """Whether the built ``module`` runs matmuls in ``dtype`` on this CPU (fp32 always; bf16 with AVX512_BF16)."""
    import torch

    if module is None:
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(getattr(module, "supports_bf16", lambda: False)())


def cpu_supported() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def cpu_has_bf16() -> bool:
    """Whether this CPU has AVX512_BF16 (bf16 dot products), by /proc/cpuinfo; the kernel checks cpuid itself."""
    try:
        return cpu_supported() and " avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@functools.lru_cache(maxsize=1)
def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles for bf16 (``amx_bf16`` in /proc/cpuinfo), where torch's bf16 matmul (oneDNN)
    runs prefill-sized products several times faster than the panels' bf16 dot products (``weights.Linear``)."""
    try:
        return cpu_supported() and " amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def sources() -> list[Path]:
    """Every file of the build, ``_SOURCE`` first."""
    return [_SOURCE, *(_HERE / name for name in SOURCES)]


def build_key(source: bytes, torch_version: str) -> str:
    """What a build depends on: the sources (``source``: their bytes, joined), the flags, torch and Python (their
    ABIs)."""
    digest = hashlib.sha256(source + "\0".join(CFLAGS + LDFLAGS).encode()).hexdigest()[:16]
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return f"{digest}-torch{torch_version.replace('+', '_')}-{py}"


def build_dir(torch_version: str) -> Path:
    """The folder this kernel source is built in for ``torch_version`` (see the module docstring)."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    root = Path(env).expanduser() if env else cache_root() / "kernels"
    joined = b"\0".join(path.name.encode() + b"\0" + path.read_bytes() for path in sources())
    return root / f"{NAME}-{build_key(joined, torch_version)}"


def _import_library(path: Path):
    spec = importlib.util.spec_from_file_location(NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(folder: Path):
    """Compile into ``folder``; the sources are copied there first so every checkout builds the same files."""
    from torch.utils import cpp_extension  # slow import, needed only to compile

    folder.mkdir(parents=True, exist_ok=True)
    copies = [_copy_into(folder, path) for path in sources()]
    print("layerskip: building the small-matmul CPU kernel (once, about a minute) ...", file=sys.stderr, flush=True)
    return cpp_extension.load(name=NAME, sources=[str(c) for c in copies if c.suffix == ".cpp"],
                              extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), build_directory=str(folder),
                              verbose=False)


def _copy_into(folder: Path, path: Path) -> Path:
    """``path`` copied into ``folder`` (atomically, unless the same bytes are there already): the copy's path."""
    copy = folder / path.name
    if not copy.is_file() or copy.read_bytes() != path.read_bytes():
        tmp = folder / f".{path.name}.{os.getpid()}"
        shutil.copyfile(path, tmp)
        os.replace(tmp, copy)
    return copy


def _digest(library: Path) -> str:
    data = library.read_bytes()
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}"


def stamp(library: Path) -> None:
    """Record ``library`` as whole (after a successful build): its size and hash, written atomically."""
    stamp_file = library.with_name(library.name + STAMP_SUFFIX)
    tmp = stamp_file.with_name(f".{stamp_file.name}.{os.getpid()}")
    tmp.write_text(_digest(library) + "\n")
    os.replace(tmp, stamp_file)


def is_whole(library: Path) -> bool:
    """Whether ``library`` is as its build left it: its stamp (written after a successful build) matches its size and
    SHA-256. A library without a stamp is not trusted (a build from before stamps, or one whose stamp was lost): its
    ELF headers cannot tell bytes damaged at full length, and importing it can kill the process; it is rebuilt."""
    stamp_file = library.with_name(library.name + STAMP_SUFFIX)
    try:
        return stamp_file.is_file() and stamp_file.read_text().strip() == _digest(library)
    except OSError:
        return False


def _import_or_none(library: Path):
    """The built module, or None when there is no whole library or it does not import (a build cut short)."""
    if not library.is_file() or not is_whole(library):
        return None
    try:
        return _import_library(library)
    except ImportError:
        return None


def build_locked(folder: Path):
    """Import the library in ``folder``, building it first if needed, as the only builder of that folder."""
    folder.mkdir(parents=True, exist_ok=True)
    lock = FileLock(folder / "layerskip-build.lock")
    holder = lock.wait(BUILD_WAIT_S, "it is building the small-matmul kernel")
    if holder is not None:
        raise TimeoutError(f"{holder.describe()} has been building the kernel in {folder} for over "
                           f"{BUILD_WAIT_S:.0f} s; end it if it is stuck, or set LAYERSKIP_KERNEL=torch")
    try:
        library = folder / f"{NAME}.so"
        module = _import_or_none(library)  # built by the process we waited for
        if module is not None:
            return module
        library.unlink(missing_ok=True)  # cut off or damaged: ninja would otherwise call it up to date
        library.with_name(library.name + STAMP_SUFFIX).unlink(missing_ok=True)
        stale = folder / TORCH_LOCK
        if stale.exists():  # no other builder holds our lock: a killed build left it
            stale.unlink(missing_ok=True)
            print(f"layerskip: note: removed {stale}, left by a kernel build that was killed"
                  + (f" ({lock.previous.describe()})" if lock.previous else ""), file=sys.stderr)
        module = _build(folder)
        if library.is_file():
            stamp(library)  # only now is it known whole
        return module
    finally:
        lock.release()


def norm_kernel():
    """The loaded module when it has the AVX-512 row norm (``rms_norm``) in use; None when the kernel is not loaded
    (no runner of this process asked for it), or runs the AVX2 path. Never builds."""
    if "norm" not in _loaded:
        if "module" not in _loaded:
            return None
        module = _loaded["module"]
        _loaded["norm"] = module if module is not None and hasattr(module, "rms_norm") and module.path() == "avx512" \
            else None
    return _loaded["norm"]


def load():
    """The compiled module (with ``small_matmul(x, w)``), or None when unavailable."""
    if "module" in _loaded:
        return _loaded["module"]
    module = None
    if cpu_supported():
        try:
            import torch  # the library links against torch: it must be loaded first

            folder = build_dir(torch.__version__)
            module = _import_or_none(folder / f"{NAME}.so") or build_locked(folder)
        except Exception as e:  # no compiler, no ninja, unwritable cache, ...: fall back to torch, say why once
            warnings.warn(f"small-matmul kernel unavailable ({type(e).__name__}: {e}); using torch.matmul",
                          stacklevel=2)
    _loaded["module"] = module
    return module
