"""Weight matrices placed one after another in memory, in the order they are created (the order a step reads them).

One decoding step reads every weight once, matrix after matrix. Read from separate allocations, the default model's
per-layer matrices (1.3-7 MB each) stream at ~0.80 of the rate of one sequential read of the same bytes; placed
back to back in one buffer, at ~0.91-0.95 (1 thread, AMD EPYC Zen 4; docs/KERNELS.md). ``place`` copies a matrix
into the current slab (a plain byte buffer of ``SLAB_BYTES``) right after the previous one; a slab is freed when
no matrix placed in it is alive any more. Matrices over ``MAX_BYTES`` (an LM head, often the embedding's own
storage, which a copy would hold twice) stay where they are.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

SLAB_BYTES = 64 << 20
MAX_BYTES = 16 << 20
ALIGN = 64
_lock = threading.Lock()
_slabs: dict[torch.device, tuple[Tensor, int]] = {}  # per device: (slab, bytes used)


def place(weight: Tensor) -> Tensor:
    """``weight`` (contiguous) as a view of the current slab, right after the previously placed matrix; large
    matrices, and tensors that need gradients, are returned as they are (contiguous)."""
    weight = weight.contiguous()
    nbytes = weight.numel() * weight.element_size()
    if nbytes == 0 or nbytes > MAX_BYTES or weight.requires_grad:
        return weight
    with _lock:
        slab, used = _slabs.get(weight.device, (None, 0))
        if slab is None or used + nbytes > slab.numel():
            slab, used = torch.empty(SLAB_BYTES, dtype=torch.uint8, device=weight.device), 0
        view = slab[used:used + nbytes].view(weight.dtype).view(weight.shape)
        _slabs[weight.device] = (slab, used + -(-nbytes // ALIGN) * ALIGN)
    view.copy_(weight)
    return view


def release() -> None:
    """Forget the current slabs (their memory is freed once no placed matrix is alive); the next ``place`` starts a
    new one."""
    with _lock:
        _slabs.clear()
