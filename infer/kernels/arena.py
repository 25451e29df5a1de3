"""Weight matrices placed one after another in memory, in the order they are created (the order a step reads them).

One decoding step reads every weight once, matrix after matrix. Read from separate allocations, the default model's
per-layer matrices (1.3-7 MB each) stream at ~0.80 of the rate of one sequential read of the same bytes; placed
back to back in one buffer, at ~0.91-0.95 (1 thread, AMD EPYC Zen 4; docs/KERNELS.md). ``place`` copies a matrix
into the current slab (a plain byte buffer of ``SLAB_BYTES``) right after the previous one; a slab is freed when
no matrix placed in it is alive any more. Matrices over ``MAX_BYTES`` (an LM head, often the embedding's own
storage: the runner then points the embedding at what ``place`` returns, so it is held once) get their own buffer
only where they lie in a file mapping (a checkpoint read by mmap, whose pages stay small); elsewhere they stay where
they are. On Linux a slab starts on a 2 MB boundary and asks for
transparent huge pages (``madvise(MADV_HUGEPAGE)``, best effort): the step's weights then stream through 2 MB pages
instead of 4 KB ones (measured: a one-token step ~10% faster, docs/KERNELS.md, "The fused layer span"). The pages a
placed matrix lies on are then collapsed into huge pages at once (``MADV_COLLAPSE``, Linux 6.1+): where the host's
memory is fragmented (after a large runner was freed) the first writes got small pages, in one measured case 82 of
268 MB huge and the layers' matmuls 1.6x slower. A matrix left where it is gets the same advice and collapse in place
(its memory is anonymous: a converted LM head). A file-backed one is copied into huge pages of its own: the default
model's fp32 LM head (113 MB, tied to the embedding, mmapped from the checkpoint) took 5.74 ms a token in the file's
4 KB pages and 4.45 ms in its copy (1 thread, Zen 4, medians of 15 with the cache flushed between).
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading

import torch
from torch import Tensor

SLAB_BYTES = 64 << 20
MAX_BYTES = 16 << 20
ALIGN = 64
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
"""Linux's ``madvise`` advice: back the range with transparent huge pages where it can."""
MADV_COLLAPSE = 25
"""Linux's ``madvise`` advice (6.1+): turn the range's pages into huge pages now."""
_lock = threading.Lock()
_slabs: dict[torch.device, tuple[Tensor, int]] = {}  # per device: (slab, bytes used)


def place(weight: Tensor) -> Tensor:
    """``weight`` (contiguous) as a view of the current slab, right after the previously placed matrix; large
    matrices, and tensors that need gradients, are returned as they are (contiguous)."""
    weight = weight.contiguous()
    nbytes = weight.numel() * weight.element_size()
    if nbytes == 0 or weight.requires_grad:
        return weight
    if nbytes > MAX_BYTES:
        if weight.device.type == "cpu" and file_backed(weight.data_ptr()):
            return _own_copy(weight)
        if weight.device.type == "cpu":
            _collapse(weight.data_ptr(), nbytes)
        return weight
    with _lock:
        slab, used = _slabs.get(weight.device, (None, 0))
        if slab is None or used + nbytes > slab.numel():
            slab, used = _new_slab(weight.device), 0
        view = slab[used:used + nbytes].view(weight.dtype).view(weight.shape)
        _slabs[weight.device] = (slab, used + -(-nbytes // ALIGN) * ALIGN)
    view.copy_(weight)
    if weight.device.type == "cpu":  # the 2 MB pages it lies on, collapsed now (see the module docstring)
        start = view.data_ptr() // HUGE_PAGE * HUGE_PAGE
        advise_huge_pages(start, -(-(view.data_ptr() + nbytes - start) // HUGE_PAGE) * HUGE_PAGE, MADV_COLLAPSE)
    return view


def _own_copy(weight: Tensor) -> Tensor:
    """A CPU copy of ``weight`` in a buffer of its own (``_huge_buffer``), its pages then collapsed."""
    nbytes = weight.numel() * weight.element_size()
    copy = _huge_buffer(nbytes).view(weight.dtype).view(weight.shape)
    copy.copy_(weight)
    _collapse(copy.data_ptr(), -(-nbytes // HUGE_PAGE) * HUGE_PAGE)  # whole 2 MB pages: the buffer has room
    return copy


def file_backed(address: int) -> bool:
    """Whether ``address`` lies in a mapping of a file (Linux's ``/proc/self/maps``); False elsewhere."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                low, high = (int(a, 16) for a in fields[0].split("-"))
                if low <= address < high:
                    return len(fields) == 6 and fields[5].startswith("/")
    except OSError:
        return False
    return False


def _new_slab(device: torch.device) -> Tensor:
    """A fresh slab: on the CPU ``SLAB_BYTES`` of ``_huge_buffer`` (nothing is touched yet, so the first writes fault
    them in as huge pages where the host has them free)."""
    if device.type != "cpu":
        return torch.empty(SLAB_BYTES, dtype=torch.uint8, device=device)
    return _huge_buffer(SLAB_BYTES)


def _huge_buffer(nbytes: int) -> Tensor:
    """``nbytes`` CPU bytes from a 2 MB boundary, with room up to the next one, advised to huge pages (a view: it
    holds the whole allocation)."""
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    advise_huge_pages(raw.data_ptr() + offset, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
    return raw[offset:offset + nbytes]


def advise_huge_pages(address: int, length: int, advice: int = MADV_HUGEPAGE) -> bool:
    """Ask Linux to back ``[address, address + length)`` (page-aligned) with transparent huge pages; False where it
    cannot (another OS, no ``madvise``, THP off): the memory works as before, in small pages."""
    libc = _libc()
    if libc is None:
        return False
    return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), advice) == 0


def _collapse(address: int, length: int) -> None:
    """The whole 2 MB pages inside ``[address, address + length)`` into huge pages, in place (best effort)."""
    start, end = -(-address // HUGE_PAGE) * HUGE_PAGE, (address + length) // HUGE_PAGE * HUGE_PAGE
    if end > start and advise_huge_pages(start, end - start):
        advise_huge_pages(start, end - start, MADV_COLLAPSE)


@functools.cache
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc if hasattr(libc, "madvise") else None
    except OSError:
        return None


def release() -> None:
    """Forget the current slabs (their memory is freed once no placed matrix is alive); the next ``place`` starts a
    new one."""
    with _lock:
        _slabs.clear()
