"""Optional C++ kernel for small-batch fp32 matmuls on x86 CPUs (AVX2 + FMA).

Built on first use with ``torch.utils.cpp_extension`` (about a minute, cached afterwards in
torch's extension folder). Where it cannot be built or the CPU lacks AVX2/FMA, ``load()``
returns None and the runner uses ``torch.matmul``; set ``LAYERSKIP_KERNEL=torch`` to force that.
"""

from __future__ import annotations

import os
import platform
import sys
import warnings
from pathlib import Path

_SOURCE = Path(__file__).with_name("small_matmul.cpp")
NAME = "layerskip_small_matmul"
_loaded: dict[str, object] = {}


def cpu_supported() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def _already_built(cpp_extension) -> bool:
    try:
        folder = Path(cpp_extension._get_build_directory(NAME, verbose=False))
    except Exception:
        return False
    return any(folder.glob(f"{NAME}*.so"))


def load():
    """The compiled module (with ``small_matmul(x, w)``), or None when unavailable."""
    if "module" in _loaded:
        return _loaded["module"]
    module = None
    if os.environ.get("LAYERSKIP_KERNEL", "auto") != "torch" and cpu_supported():
        try:
            from torch.utils import cpp_extension

            if not _already_built(cpp_extension):
                print("layerskip: building the small-matmul CPU kernel (once, about a minute) ...", file=sys.stderr,
                      flush=True)
            module = cpp_extension.load(name=NAME, sources=[str(_SOURCE)],
                           extra_cflags=["-O3", "-mavx2", "-mfma"], verbose=False)
        except Exception as e:  # no compiler, no ninja, ...: fall back to torch, say why once
            warnings.warn(f"small-matmul kernel unavailable ({type(e).__name__}: {e}); using torch.matmul",
                          stacklevel=2)
    _loaded["module"] = module
    return module
