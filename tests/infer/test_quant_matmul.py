"""Weight-only int8 / int4 matrices for drafts (infer/kernels/quant.py, quant.cpp): the round trip's error bounds,
the matmul against x @ dequantize(w).T on every route (the kernel's AVX-512 path here, its AVX2 path in a forced
subprocess, the portable torch route), batch invariance on the kernel, the refusal of int4 widths the group does not
divide, and that the int4 scheme does not redraw the default model's own (Q4_1) grid."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from infer import kernels
from infer.kernels import quant
from layerskip_core.errors import UserError

SHAPES = [(97, 64), (49, 192), (1, 128), (145, 576)]
"""(N, K): odd row counts off the kernel's 48-row groups (and one row), widths that 32 and 64 divide."""
SCHEMES = [quant.SCHEMES["int8"], quant.SCHEMES["int4"], quant.QuantScheme(4, 32), quant.QuantScheme(4, 64, "fp32")]
FORCED = os.environ.get("LAYERSKIP_KERNEL_ISA") == "avx2"


def _kernel_layout() -> str:
    if quant.kernel_op() is None:
        pytest.skip("the C++ kernel is unavailable here (the portable torch route runs instead)")
    return "panels"


def _weight(N: int, K: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05  # (N, K)
    w[0, :8] = 0.0  # an all-zero int4 group's start, and values of one sign
    return w


def _group_scales(w: torch.Tensor, scheme: quant.QuantScheme) -> torch.Tensor:
    """Each element's scale (N, K), as ``codes_and_scales`` chose it."""
    N, K = w.shape
    _, scales = quant.codes_and_scales(w, scheme)  # (N, K / group)
    return scales.float().repeat_interleave(K // scales.shape[1], dim=1)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("N,K", SHAPES)
def test_round_trip_stays_within_half_a_step_and_both_layouts_agree(scheme, N, K):
    """Every weight is within half its scale of the original (int4: the largest-magnitude value's opposite side may
    clip to 7 steps, within one step), and both layouts dequantize to the same matrix."""
    w = _weight(N, K)
    step = _group_scales(w, scheme).abs()  # (N, K)
    back = quant.dequantize(quant.quantize(w, scheme, "rows"))  # (N, K)
    err = (back - w).abs()  # (N, K)
    slack = 1e-6 * step + 1e-12  # float rounding of w / s and s * q
    clip = 8 * 2**-9 if scheme.scale_dtype == "bf16" else 1e-6  # a bf16 scale a relative 2^-9 short of m / 8
    assert bool((err <= step * (1 + clip) + slack).all())
    inside = (w / torch.where(step == 0, torch.ones_like(step), step)).abs() <= 7.5  # (N, K): not clipped
    assert bool((err[inside] <= 0.5 * step[inside] + slack[inside]).all())
    if quant.kernel_op() is not None:
        assert torch.equal(quant.dequantize(quant.quantize(w, scheme, "panels")), back)


def test_int8_rounds_to_the_nearest_code_and_keeps_each_rows_extreme():
    w = _weight(33, 96)
    qw = quant.quantize(w, "int8", "rows")
    codes, scales = quant.codes_and_scales(w, quant.SCHEMES["int8"])
    assert torch.equal(codes, torch.round(w / scales.float()).to(torch.int8))
    assert int(codes.abs().amax(1).min()) == 127  # each row's extreme is its ±127
    assert qw.nbytes == 33 * 96 + 33 * 4


@pytest.mark.parametrize("route", ["kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("N,K", SHAPES)
def test_matmul_is_x_times_the_dequantized_matrix(route, dtype, scheme, N, K):
    """For T = 1..8: the product in x's dtype is x @ dequantize(w).T, computed exactly, to within fp32 accumulation
    (K 2^-23 sum |x||w|) plus one rounding to x's dtype; int4 multiplies x on its int8 grid (``int4_activations``:
    per row and group, the kernel's integer dot products), the same on every route."""
    layout = _kernel_layout() if route == "kernel" else "rows"
    w = _weight(N, K, seed=N + K)
    qw = quant.quantize(w, scheme, layout)
    if route == "kernel":
        assert quant.route(qw) == ("avx2" if FORCED else kernels.load().path())
    deq = quant.dequantize(qw).double()  # (N, K)
    x = torch.randn(8, K, generator=torch.Generator().manual_seed(1)).to(dtype)  # (8, K)
    for T in range(1, 9):
        y = quant.matmul(x[:T], qw)  # (T, N)
        assert y.dtype == dtype and y.shape == (T, N)
        xt = (x[:T].float() if scheme.bits == 8 else quant.int4_activations(x[:T], scheme.group)).double()  # (T, K)
        exact = xt @ deq.T  # (T, N)
        bound = K * 2**-23 * (xt.abs() @ deq.abs().T) + exact.abs() * (2**-8 if dtype == torch.bfloat16
                                                                                    else 2**-24)
        assert bool(((y.double() - exact).abs() <= bound + 1e-30).all()), (T, float((y.double() - exact).abs().max()))


def test_int4_activations_are_each_groups_symmetric_int8_grid():
    """Each row's group of k becomes s * q with s = max |x| / 127 and q = round(x / s) in -127..127 (the group's
    extreme is exactly ±127 steps; an all-zero group stays zero), row by row whatever the other rows hold."""
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(3))  # (3, 128)
    x[1, 64:] = 0.0
    got = quant.int4_activations(x, 64).reshape(3, 2, 64)  # (3, 2, 64)
    s = x.reshape(3, 2, 64).abs().amax(-1, keepdim=True) / 127  # (3, 2, 1)
    assert bool(((got - x.reshape(3, 2, 64)).abs() <= 0.5 * s * (1 + 1e-6)).all())
    assert torch.equal(got[1, 1], torch.zeros(64))
    steps = got / torch.where(s == 0, torch.ones_like(s), s)  # (3, 2, 64): the codes, to rounding
    assert bool(((steps - steps.round()).abs() <= 1e-4).all()) and int(steps.abs().round().amax()) == 127
    assert torch.equal(quant.int4_activations(x[2:], 64), quant.int4_activations(x, 64)[2:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scheme", SCHEMES[:2], ids=lambda s: s.name)
def test_the_kernel_is_batch_invariant(dtype, scheme):
    """Row t of a T-row product is bitwise the 1-row product, for T = 1..8 and leading batch dims alike."""
    layout = _kernel_layout()
    qw = quant.quantize(_weight(145, 576), scheme, layout)
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(2)).to(dtype)
    alone = torch.cat([quant.matmul(x[t:t + 1], qw) for t in range(8)])  # (8, N)
    for T in range(2, 9):
        assert torch.equal(quant.matmul(x[:T], qw), alone[:T])
    assert torch.equal(quant.matmul(x.view(2, 4, 576), qw), alone.view(2, 4, 145))


def test_the_avx2_path_in_a_forced_process():
    """CPUs without AVX-512 run the kernel's AVX2 path: this file's kernel tests again with it forced."""
    if FORCED:
        pytest.skip("already forced")
    _kernel_layout()
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, LAYERSKIP_KERNEL_ISA="avx2",
               PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), *sys.path]))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "-k", "kernel and not forced", os.path.abspath(__file__)], env=env, capture_output=True,
                         text=True, timeout=600, cwd=os.path.dirname(here))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " skipped" not in out.stdout, out.stdout[-3000:]


def test_int4_refuses_a_width_its_group_does_not_divide_in_one_line():
    with pytest.raises(UserError) as e:
        quant.quantize(torch.randn(10, 100), "int4")
    message = str(e.value)
    assert "\n" not in message and "64" in message and "100" in message
    with pytest.raises(UserError, match="128.*576"):
        quant.quantize(torch.randn(4, 576), quant.QuantScheme(4, 128))
    with pytest.raises(UserError, match="group"):
        quant.QuantScheme(4, 48)
    with pytest.raises(UserError, match="int8"):
        quant.scheme_named("int3")


def test_matmul_refuses_a_wrong_width_or_dtype():
    qw = quant.quantize(torch.randn(5, 64), "int8", "rows")
    with pytest.raises(UserError, match="64"):
        quant.matmul(torch.randn(2, 32), qw)
    with pytest.raises(UserError, match="float16"):
        quant.matmul(torch.randn(2, 64).half(), qw)


def _source_grid(w: torch.Tensor, group: int = 32) -> torch.Tensor:
    """``w`` redrawn on an asymmetric 4-bit grid, a scale and a minimum per ``group`` (the source file's Q4_1)."""
    N, K = w.shape
    b = w.reshape(N, K // group, group)
    low, high = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    scale = torch.where(high > low, (high - low) / 15, torch.ones_like(high))
    return (torch.round((b - low) / scale).clamp(0, 15) * scale + low).reshape(N, K)


@pytest.mark.real_model
def test_the_int4_scheme_does_not_redraw_the_default_models_grid(default_model_path):
    """The default model's layer weights are a dequantized Q4_1 file: an asymmetric 32-group grid redraws them
    exactly (the control: this test can tell), and would overstate a draft's acceptance. The int4 scheme must not:
    most weights move, by a relative error of int4's size."""
    from safetensors import safe_open

    with safe_open(str(default_model_path / "model.safetensors"), "pt") as f:
        names = [n for n in f.keys() if n.endswith("proj.weight")][:14]  # two layers' worth
        weights = [f.get_tensor(n).float() for n in names]
    for name, w in zip(names, weights, strict=True):
        control = _source_grid(w)
        assert float((control - w).abs().max()) <= 1e-6 * float(w.abs().max()), name
        ours = quant.dequantize(quant.quantize(w, "int4", "rows"))
        moved = float((ours != w).float().mean())
        rel = float(((ours - w) ** 2).sum() / (w**2).sum())
        assert moved > 0.5 and rel > 1e-3, (name, moved, rel)


def test_the_avx2_path_is_bitwise_the_avx512_path_on_int4(tmp_path):
    """int4's integer sums are exact and its float steps per lane the same on both paths: a forced-AVX2 process
    gives bitwise the AVX-512 product."""
    if FORCED or quant.kernel_op() is None or kernels.load().path() != "avx512":
        pytest.skip("needs the AVX-512 path here")
    qw = quant.quantize(_weight(145, 576), "int4", "panels")
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(4))  # (8, 576)
    torch.save({"qw": qw, "x": x}, tmp_path / "case.pt")
    script = ("import sys, torch; from infer.kernels import quant; c = torch.load(sys.argv[1], weights_only=False); "
              "assert quant.route(c['qw']) == 'avx2'; torch.save(quant.matmul(c['x'], c['qw']), sys.argv[2])")
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, LAYERSKIP_KERNEL_ISA="avx2", PYTHONPATH=os.pathsep.join([here, *sys.path]))
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "case.pt"), str(tmp_path / "y.pt")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert torch.equal(torch.load(tmp_path / "y.pt"), quant.matmul(x, qw))
