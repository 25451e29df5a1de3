"""The panel layout of the AVX-512 kernel's weights (``panels.cpp``): a matrix (N, K) packed once, at load, into groups
of ``GROUP`` rows, each group one contiguous block, k-major: for each k (bf16: each pair of k) the group's rows side
by side in three 16-row panels. A decoding step then reads every matrix as one sequential stream and needs no
horizontal sum per output (the layout's reasons and measurements: docs/KERNELS.md, "Kept: weights packed in panels").
"""

from __future__ import annotations

import torch
from torch import Tensor

from infer.kernels import arena

GROUP = 48
"""Weight rows per group: 3 panels of 16 (``PANEL_ROWS`` in kernels.h)."""


def usable(module, weight: Tensor) -> bool:
    """Whether the built ``module`` runs ``weight`` (N, K) packed: its AVX-512 path, any N > 0 and K in fp32 (the last
    group's missing rows are zero), K even in bf16 (the layout pairs k)."""
    return (module is not None and hasattr(module, "panel_matmul") and module.path() == "avx512"
            and weight.dim() == 2 and weight.shape[0] > 0
            and (weight.dtype == torch.float32 or weight.shape[1] % 2 == 0))


def place(module, weight: Tensor) -> Tensor:
    """``weight`` (N, K) packed by ``module`` (its ``pack_panels``: (G, K, GROUP), G = ceil(N / GROUP), the last
    group's missing rows zero) and placed in ``infer.kernels.arena`` (a step reads the matrices as one stream)."""
    return arena.place(module.pack_panels(weight.detach()))


def unpack(panels: Tensor, n: int) -> Tensor:
    """The (n, K) matrix ``panels`` (G, K, GROUP) hold (``place``'s layout undone; a new tensor)."""
    G, K, _ = panels.shape
    if panels.dtype == torch.bfloat16:  # each k pair as one 4-byte element: a plain transposition, 4x faster
        pairs = panels.view(G, K // 2, GROUP * 2).view(torch.int32)  # (G, K/2, GROUP)
        return pairs.permute(0, 2, 1).reshape(G * GROUP, K // 2)[:n].contiguous().view(torch.bfloat16)  # (n, K)
    return panels.permute(0, 2, 1).reshape(G * GROUP, K)[:n].contiguous()  # (G, GROUP, K) -> (n, K)


def rows(panels: Tensor, ids: Tensor) -> Tensor:
    """Rows ``ids`` (T,) of the matrix ``panels`` (G, K, GROUP) hold: (T, K) (a gather at stride GROUP per row)."""
    G, K, _ = panels.shape
    group, lane = ids // GROUP, ids % GROUP
    if panels.dtype == torch.bfloat16:
        return panels.view(G, K // 2, GROUP, 2)[group, :, lane].reshape(ids.shape[0], K)  # (T, K/2, 2) -> (T, K)
    return panels[group, :, lane]  # (T, K)


@torch.library.custom_op("layerskip::panel_matmul", mutates_args=())
def traced_matmul(x: Tensor, w: Tensor, n: int) -> Tensor:
    """``panel_matmul`` as a torch operator, for code ``torch.compile`` traces (the static executor): dynamo keeps it
    in the graph as one opaque call instead of breaking the graph at the extension's function."""
    from infer import kernels

    return kernels.load().panel_matmul(x, w, n)


@traced_matmul.register_fake
def _(x: Tensor, w: Tensor, n: int) -> Tensor:
    return x.new_empty(x.shape[0], n)  # (T, n)
