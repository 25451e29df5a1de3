"""Attention over a KV cache with grouped KV heads, shaped for the fast CUDA kernels.

SDPA with a mask *and* ``enable_gqa`` can use neither the flash nor the memory-efficient CUDA kernel (it falls
back to the math kernel, which repeats K/V over the whole cache), so masked calls fold the query groups into
rows instead; unmasked calls (one new token, or a causal prefill from slot 0) keep ``enable_gqa``, which the
flash kernel takes. On the CPU, one new token folds its query groups into rows too (unmasked): SDPA with
``enable_gqa`` took 272 us a layer in bf16 against 46 us folded (SmolLM2-135M, 201 cached tokens, 1 thread).

Where the runner has the small-matmul kernel on its AVX-512 path (``kernel``), decoding attention (one new token,
or T verified ones with their mask) runs the kernel's ``attend_rows`` instead: each query row alone, over its
visible keys in ascending order, the same arithmetic whatever T is and however many rows a packed forward carries.
So T-token verification reproduces token-by-token decoding bitwise (fp32 and bf16), which SDPA does not (its
blocking changes with T). A causal prefill from slot 0, and ``bulk`` calls, stay on SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None) -> Tensor:
    """Masked attention of q (Hq, T, D) over k, v (Hkv, C, D), Hq = G Hkv; ``mask`` (T, C) bool, or (G T, C)
    additive float already repeated per group (``group_mask``).

    The G query heads that share a KV head become rows, (Hkv, G T, D) against (Hkv, C, D): plain multi-head
    attention, which the memory-efficient kernel takes (its mask rows need C to be a multiple of 8-16). Query
    head h uses KV head h // G, as in transformers' ``repeat_kv``. ``scale``: the score scale (None: D ** -0.5).
    """
    Hq, T, D = q.shape
    Hkv = k.shape[0]
    G = Hq // Hkv
    folded = q.reshape(Hkv, G * T, D)  # (Hkv, G T, D): head h = j G + g -> KV head j, rows g T .. g T + T - 1
    if mask.shape[0] != G * T:
        mask = mask.repeat(G, 1)  # (G T, C)
    out = F.scaled_dot_product_attention(folded[None], k[None], v[None], attn_mask=mask,
                                         scale=scale)  # (1, Hkv, G T, D)
    return out[0].reshape(Hq, T, D)  # (Hq, T, D)


def group_mask(visible: Tensor, groups: int, dtype) -> Tensor:
    """(G T, C) additive mask (0 where visible, -inf elsewhere) in ``dtype`` from a (T, C) bool one: built once
    and shared by every layer that attends over the same slots."""
    additive = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
    return additive.repeat(groups, 1)  # (G T, C)


def row_kernel(kernel, q: Tensor):
    """``kernel`` when it has the batch-invariant row attention for ``q`` here (CPU, head dim <= 256, no gradient
    wanted; on the AVX-512 path fp32, or bf16 with AVX512_BF16; on the AVX2 path fp32); else None."""
    if (kernel is None or q.device.type != "cpu" or q.shape[-1] > 256 or not hasattr(kernel, "attend_rows")
            or (q.requires_grad and torch.is_grad_enabled())):
        return None  # (the C++ call has no backward: autograd takes SDPA)
    if kernel.path() == "avx2":
        return kernel if q.dtype == torch.float32 else None
    if q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and kernel.supports_bf16()):
        return kernel
    return None


def rows_for(kernel, q: Tensor, mask: Tensor | None, causal: bool):
    """The module whose row attention runs this call (``row_kernel``: every non-causal call with a bool mask or none),
    or None: SDPA."""
    return None if causal or (mask is not None and mask.dtype != torch.bool) else row_kernel(kernel, q)


def score_scale(q: Tensor, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float | None = None,
           kernel=None) -> Tensor:
    """q (Hq, T, D) over k, v (Hkv, S, D): ``mask`` (T, S) bool, or None for all visible (``causal``: row t sees
    slots [0, t], valid only when the T rows are slots [0, T)); ``scale``: the score scale (None: D ** -0.5);
    ``kernel``: the small-matmul module, whose row attention then runs every non-causal call (``rows_for``)."""
    rows = rows_for(kernel, q, mask, causal)
    if rows is not None:
        return rows.attend_rows(q, k, v, mask, score_scale(q, scale))  # (Hq, T, D)
    if mask is not None:
        return grouped_attention(q, k, v, mask, scale)
    Hq, T, D = q.shape
    Hkv = k.shape[0]
    if not causal and q.device.type == "cpu" and Hq != Hkv:  # all visible: the query groups fold into rows
        out = F.scaled_dot_product_attention(q.reshape(Hkv, Hq // Hkv * T, D)[None], k[None], v[None],
                                             scale=scale)  # (1, Hkv, G T, D)
        return out[0].reshape(Hq, T, D)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=causal, enable_gqa=Hq != Hkv,
                                          scale=scale)[0]
