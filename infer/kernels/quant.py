"""Weight-only int8 / int4 matrices for quantized drafts: the format, and the matmul a draft calls.

A ``QuantScheme`` says how a float matrix W (N, K) becomes codes and scales; ``quantize`` makes a ``QuantWeight``
(codes, scales, shape, scheme, ``nbytes``), ``dequantize`` gives the float matrix it stands for, and ``matmul(x, qw)``
computes x @ dequantize(qw).T with the activations x (T, K) in fp32 or bf16 (the result in x's dtype; int8: the
arithmetic in fp32; int4: x on a per-row, per-group int8 grid first, ``int4_activations``, and the dot products in
integers, since a draft may be approximate and decoding int4 codes to fp32 cost more than reading them). Schemes (both
symmetric, no zero point):

- int8, per output channel: W[n] ~ s[n] * q[n], q = round(W[n] / s[n]) in -127..127, s[n] = max |W[n]| / 127.
- int4, groups of ``group`` k along a row: W[n, g] ~ s[n, g] * q, q in -8..7, s = -m / 8 where m is the group's
  value of largest magnitude (its sign kept), so that value is exactly -8 s and the other side reaches 7 s
  (values past 7 s clip to 7; llama.cpp's Q4_0 rule). The scale is rounded to its storage dtype first and q
  computed against the rounded scale, so ``dequantize`` is exactly the grid the codes were chosen on.

The named schemes (``SCHEMES``; why these, measured: docs/KERNELS.md, "Quantized draft weights"): ``int8`` (fp32
scales) and ``int4`` (groups of 64, bf16 scales). Symmetric groups never reproduce the default model's weights,
which are a dequantized Q4_1 file (groups of 32 with a scale *and a minimum*): an asymmetric 32-group scheme would
redraw that grid exactly and overstate a draft's acceptance (issue 64 item 4; tested).

Layouts: ``panels`` (the C++ kernel's, ``quant.cpp``: rows in groups of 48, k-major, one stream a call; the AVX-512
or AVX2 path of the kernel module, registered as ``torch.ops.layerskip_quant.matmul``) where the kernel is loaded
on this CPU, else ``rows`` (codes (N, K) int8 or nibble pairs (N, K / 2), the portable route: dequantize and
``F.linear`` in fp32). Row t of a T-row ``matmul`` is bitwise the 1-row call on the kernel (see quant.cpp);
the portable route promises that only to rounding.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from layerskip_core.errors import UserError
from layerskip_core.settings import KERNEL_ENV

ROWS = 48
"""Weight rows per group of the ``panels`` layout (``PANEL_ROWS`` in kernels.h)."""
INT4_GROUPS = (32, 64, 128)
"""The int4 group sizes a scheme may use."""
_SCALE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_BITS = torch.tensor([0, 16, 4, 20, 8, 24, 12, 28], dtype=torch.int32)
"""Where the int4 code of k0 + c sits in a row's 32-bit word of the panels (quant.cpp's layout)."""


@dataclass(frozen=True)
class QuantScheme:
    """How a float matrix becomes integer codes and floating-point scales (see the module docstring)."""

    bits: int
    """8 (int8 codes, one scale per output row) or 4 (int4 codes, one scale per row and group of k)."""
    group: int = 0
    """int4: the k per scale (one of ``INT4_GROUPS``; must divide the matrix's width K); 0 for int8."""
    scale_dtype: str = "fp32"
    """How the scales are stored: 'fp32' or 'bf16'."""

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise UserError(f"quantization: bits must be 8 or 4, not {self.bits}")
        if self.bits == 8 and self.group != 0:
            raise UserError(f"quantization: int8 has one scale per output row (group 0), not groups of {self.group}")
        if self.bits == 4 and self.group not in INT4_GROUPS:
            raise UserError(f"quantization: int4 group must be one of {', '.join(map(str, INT4_GROUPS))}, "
                            f"not {self.group}")
        if self.scale_dtype not in _SCALE_DTYPES:
            raise UserError(f"quantization: scale dtype must be fp32 or bf16, not {self.scale_dtype!r}")

    @property
    def name(self) -> str:
        return "int8" if self.bits == 8 else f"int4-g{self.group}-{self.scale_dtype}"

    def check_width(self, shape: tuple[int, int]) -> None:
        """Refuse a matrix (N, K) whose width K the scheme's groups do not divide, in one line."""
        N, K = shape
        if self.bits == 4 and K % self.group:
            fits = " or ".join(str(g) for g in INT4_GROUPS if K % g == 0)
            raise UserError(f"int4 groups of {self.group} do not divide the width {K} of a ({N}, {K}) matrix: use "
                            + (f"a group that divides {K} ({fits}) or int8" if fits else "int8"))


SCHEMES = {"int8": QuantScheme(8), "int4": QuantScheme(4, 64, "bf16")}
"""The schemes ``--draft-dtype int8|int4`` name."""


@dataclass(frozen=True)
class QuantWeight:
    """A quantized matrix W (N, K): its codes and scales in one of two layouts (the module docstring)."""

    scheme: QuantScheme
    """How it was quantized."""
    shape: tuple[int, int]
    """(N, K): output rows and input width."""
    codes: Tensor
    """``panels``: int8 (G, K, 48) or int4 words int32 (G, K / 8, 48), G = ceil(N / 48), padded rows zero.
    ``rows``: int8 (N, K), or int4 nibble pairs uint8 (N, K / 2) (low nibble the even k; two's complement)."""
    scales: Tensor
    """``panels``: int8 (G * 48,), int4 (G, K / group, 48). ``rows``: int8 (N,), int4 (N, K / group)."""
    layout: str
    """'panels' (the kernel's) or 'rows' (portable)."""

    @property
    def nbytes(self) -> int:
        """Bytes a matmul reads: codes and scales as stored (the panels' padding rows included)."""
        return self.codes.nbytes + self.scales.nbytes


def scheme_named(name: str) -> QuantScheme:
    """The scheme ``name`` ('int8' or 'int4') stands for; an unknown name is refused in one line."""
    if name not in SCHEMES:
        raise UserError(f"unknown quantization {name!r}: choose one of {', '.join(SCHEMES)}")
    return SCHEMES[name]


def codes_and_scales(weight: Tensor, scheme: QuantScheme) -> tuple[Tensor, Tensor]:
    """``weight`` (N, K) float quantized by ``scheme``: codes int8 (N, K) and scales (N, K / group) or (N, 1) in the
    scheme's scale dtype (the layout-free form every layout packs)."""
    if weight.dim() != 2:
        raise UserError(f"quantization: a matrix (N, K) is needed, not a tensor of shape {tuple(weight.shape)}")
    N, K = weight.shape
    scheme.check_width((N, K))
    w = weight.detach().float()
    group = K if scheme.bits == 8 else scheme.group
    blocks = w.reshape(N, K // group, group)  # (N, K / group, group)
    if scheme.bits == 8:
        scale = blocks.abs().amax(-1) / 127.0  # (N, 1)
        low, high = -127, 127
    else:
        at = blocks.abs().argmax(-1, keepdim=True)  # (N, K / group, 1)
        scale = -blocks.gather(-1, at).squeeze(-1) / 8.0  # (N, K / group); may be negative
        low, high = -8, 7
    scale = scale.to(_SCALE_DTYPES[scheme.scale_dtype])
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    codes = torch.round(blocks / safe.unsqueeze(-1)).clamp_(low, high).to(torch.int8)  # (N, K / group, group)
    return codes.reshape(N, K), scale


def dequantize(qw: QuantWeight) -> Tensor:
    """The fp32 matrix (N, K) ``qw`` stands for: each code times its scale (exactly the grid it was quantized on)."""
    N, K = qw.shape
    codes, scales = _rows(qw)  # (N, K) int8, (N, K / group)
    group = K // scales.shape[1]
    return (codes.float().reshape(N, K // group, group) * scales.float().unsqueeze(-1)).reshape(N, K)


def quantize(weight: Tensor, scheme: QuantScheme | str, layout: str = "auto") -> QuantWeight:
    """``weight`` (N, K) float quantized by ``scheme`` (a ``QuantScheme`` or a name in ``SCHEMES``), packed in
    ``layout``: 'panels' (the kernel's; needs it loaded on this CPU), 'rows' (portable), or 'auto' (panels where the
    kernel runs and the weight is on the CPU, else rows)."""
    scheme = scheme_named(scheme) if isinstance(scheme, str) else scheme
    codes, scales = codes_and_scales(weight, scheme)
    if layout == "auto":
        layout = "panels" if weight.device.type == "cpu" and kernel_op() is not None else "rows"
    if layout == "panels":
        if kernel_op() is None:
            raise UserError("quantization: the 'panels' layout needs the C++ kernel on this CPU; use layout 'rows'")
        packed, packed_scales = _pack_panels(codes, scales, scheme)
    elif layout == "rows":
        packed, packed_scales = (_pairs(codes) if scheme.bits == 4 else codes), scales.reshape(weight.shape[0], -1)
        if scheme.bits == 8:
            packed_scales = packed_scales.reshape(-1)
    else:
        raise UserError(f"quantization: layout must be 'panels', 'rows' or 'auto', not {layout!r}")
    return QuantWeight(scheme, (int(weight.shape[0]), int(weight.shape[1])), packed, packed_scales, layout)


def matmul(x: Tensor, qw: QuantWeight) -> Tensor:
    """x (..., K) fp32 or bf16 times the quantized matrix: x @ dequantize(qw).T, (..., N) in x's dtype."""
    N, K = qw.shape
    if x.dtype not in (torch.float32, torch.bfloat16) or x.shape[-1] != K:
        raise UserError(f"quantized matmul: x (..., {K}) fp32 or bf16 is needed, not {x.dtype} {tuple(x.shape)}")
    rows = x.reshape(-1, K)  # (T, K)
    if qw.layout == "panels" and x.device.type == "cpu" and (op := kernel_op()) is not None:
        y = op(rows, qw.codes, qw.scales, N, qw.scheme.bits, qw.scheme.group)  # (T, N)
    else:
        xf = rows.float() if qw.scheme.bits == 8 else int4_activations(rows, qw.scheme.group)  # (T, K)
        y = F.linear(xf, dequantize(qw).to(x.device)).to(x.dtype)  # (T, N)
    return y.reshape(*x.shape[:-1], N)


def int4_activations(x: Tensor, group: int) -> Tensor:
    """The fp32 activations an int4 matmul multiplies: x (T, K) with each row's group of ``group`` k on a symmetric
    int8 grid (s = max |x| / 127, q = round-half-even(x / s) in -127..127; s = 0 gives 0), as q * s (T, K)."""
    T, K = x.shape
    blocks = x.float().reshape(T, K // group, group)  # (T, K / group, group)
    s = blocks.abs().amax(-1, keepdim=True) / 127.0  # (T, K / group, 1)
    q = torch.round(blocks / torch.where(s == 0, torch.ones_like(s), s)).clamp_(-127, 127)  # (T, K / group, group)
    return (q * s).reshape(T, K)


def route(qw: QuantWeight) -> str:
    """Which code multiplies ``qw`` in this process: 'avx512' or 'avx2' (the kernel's paths) or 'torch'."""
    if qw.layout == "panels" and kernel_op() is not None:
        from infer import kernels

        return kernels.load().path()
    return "torch"


def kernel_op():
    """``torch.ops.layerskip_quant.matmul`` when the kernel module is loaded here (building it on first use), else
    None (no AVX2 CPU, no compiler, ``LAYERSKIP_KERNEL=torch``, or a build without ``quant.cpp``)."""
    from infer import kernels

    if os.environ.get(KERNEL_ENV, "").strip() == "torch" or kernels.load() is None:
        return None
    return getattr(torch.ops.layerskip_quant, "matmul", None) if _registered() else None


def _registered() -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("layerskip_quant::matmul", "CPU")
    except RuntimeError:
        return False


def _pack_panels(codes: Tensor, scales: Tensor, scheme: QuantScheme) -> tuple[Tensor, Tensor]:
    """codes int8 (N, K) and scales (N, K / group) in quant.cpp's panel layout (its header comment)."""
    N, K = codes.shape
    G = -(-N // ROWS)
    padded = torch.zeros(G * ROWS, K, dtype=torch.int8)
    padded[:N] = codes
    sc = torch.zeros(G * ROWS, scales.shape[1], dtype=scales.dtype)
    sc[:N] = scales
    if scheme.bits == 8:
        return padded.view(G, ROWS, K).permute(0, 2, 1).contiguous(), sc.reshape(-1).contiguous()  # (G, K, 48)
    nibbles = (padded.view(G, ROWS, K // 8, 8).to(torch.int32) & 0xF) << _BITS  # (G, 48, K / 8, 8)
    words = nibbles.sum(-1, dtype=torch.int64).to(torch.int64)  # (G, 48, K / 8), 32-bit patterns as int64
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    panel_scales = sc.view(G, ROWS, -1).permute(0, 2, 1).contiguous()  # (G, K / group, 48)
    return words.permute(0, 2, 1).contiguous(), panel_scales  # (G, K / 8, 48)


def _pairs(codes: Tensor) -> Tensor:
    """int4 codes int8 (N, K) as nibble pairs uint8 (N, K / 2): the even k in the low nibble."""
    u = (codes.to(torch.int16) & 0xF).to(torch.uint8)  # (N, K)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def _rows(qw: QuantWeight) -> tuple[Tensor, Tensor]:
    """The codes int8 (N, K) and scales (N, K / group) of ``qw``, whatever its layout."""
    N, K = qw.shape
    if qw.layout == "rows":
        if qw.scheme.bits == 8:
            return qw.codes, qw.scales.reshape(N, 1)
        pairs = qw.codes.to(torch.int16)  # (N, K / 2)
        nib = torch.stack([pairs & 0xF, pairs >> 4], -1).reshape(N, K)  # (N, K) in 0..15
        return ((nib ^ 8) - 8).to(torch.int8), qw.scales
    G = qw.codes.shape[0]
    if qw.scheme.bits == 8:
        codes = qw.codes.permute(0, 2, 1).reshape(G * ROWS, K)[:N]
        return codes, qw.scales.reshape(G * ROWS, 1)[:N]
    words = qw.codes.permute(0, 2, 1).reshape(G * ROWS, K // 8, 1)[:N]  # (N, K / 8, 1) int32
    nib = (words >> _BITS) & 0xF  # (N, K / 8, 8)
    codes = ((nib ^ 8) - 8).reshape(N, K).to(torch.int8)
    return codes, qw.scales.permute(0, 2, 1).reshape(G * ROWS, K // qw.scheme.group)[:N]
