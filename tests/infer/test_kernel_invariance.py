"""The small-matmul kernel on every path it has (AVX-512 fp32, AVX2 fp32, AVX-512 bf16): close to torch's matmul (the
portable path) and batch invariant, each output row bitwise the same whatever T and however the rows are split.
A runner's T-token forward against token-by-token decoding, in fp32 and bf16: bitwise equal (the kernel's row attention,
``tests/infer/test_kernel_attention.py``); bf16 self-speculation against bf16 plain decoding: token for token."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from infer import kernels
from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter
from infer.kernels import arena
from infer.model.attention import row_kernel
from infer.model.runner import Runner
from infer.model.weights import Linear, load_kernel
from tiny_models import make_model

SHAPES = [(1, 37, 64), (2, 6, 8), (3, 64, 128), (4, 23, 576), (5, 13, 576), (6, 25, 40), (7, 26, 40),
          (8, 28, 576), (8, 31, 1536), (9, 100, 1536), (9, 20, 64), (10, 17, 576), (12, 35, 576), (16, 49, 24),
          (17, 30, 72), (32, 8, 8), (1, 50, 7), (3, 20, 102), (5, 9, 13), (8, 17, 1100), (16, 33, 63)]
"""(T, N, K): token counts that hit every pass shape of the AVX-512 panels (1-8 tokens in one pass, 9-16 in two, 17
and 32 in three and four, each pass's own count) and every block of the AVX2 path (8 rows for one token, 4-row
halves of 4, 2 and 1 tokens); row counts off the 48-row panel groups and the 8-row blocks; K off the 8- and 16-lane
chunks, and off 8 altogether (the AVX2 path's masked last chunk; odd K: fp32 only, bf16's panels pair k)."""


def _module():
    module = kernels.load()
    if module is None:
        pytest.skip("small-matmul kernel unavailable on this machine (the portable torch path runs instead)")
    return module


def test_the_kernel_builds_where_it_can():
    """On a CPU the kernel supports, with a C++ compiler, the sources must compile: every other kernel test skips
    when the kernel is unavailable (so a source that no longer compiles would otherwise pass the suite, with the
    runners quietly on torch's matmul)."""
    if not kernels.cpu_supported() or not any(shutil.which(c) for c in (os.environ.get("CXX", "c++"), "c++", "g++")):
        pytest.skip("no AVX2 CPU or no C++ compiler here: the portable torch path is the expected one")
    assert kernels.load() is not None


def within_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether y is x @ w^T up to fp32 accumulation in any order (|error| <= K 2^-24 sum_k |x_k w_k|, the bound of
    summing K products) and, for a bf16 y, its one output rounding (2^-8 relative)."""
    exact = F.linear(x.double(), w.double())
    bound = x.shape[1] * 2 ** -24 * F.linear(x.double().abs(), w.double().abs())
    if y.dtype == torch.bfloat16:
        bound = bound + (exact.abs() + bound) * 2 ** -8
    return bool(((y.double() - exact).abs() <= bound).all())


def check_kernel(module, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    for T, N, K in SHAPES:
        if dtype == torch.bfloat16 and K % 2:
            continue
        x = torch.randn(T, K, generator=gen).to(dtype)
        w = torch.randn(N, K, generator=gen).to(dtype)
        y = module.small_matmul(x, w)
        assert y.dtype == dtype and y.shape == (T, N)
        assert within_rounding(y, x, w), (T, N, K)
        for t in range(T):  # each row is bitwise what a single-token call computes
            assert torch.equal(module.small_matmul(x[t:t + 1], w)[0], y[t]), (T, N, K, t)
        for split in {1, T // 2, T - 1} - {0, T}:  # and what any split of the rows computes
            assert torch.equal(torch.cat([module.small_matmul(x[:split], w), module.small_matmul(x[split:], w)]), y)


def test_fp32_close_to_torch_and_batch_invariant():
    check_kernel(_module(), torch.float32)


AVX2_CHECK = """
import torch, test_kernel_invariance as t
from infer import kernels
module = kernels.load()
assert module.path() == "avx2" and not module.supports_bf16(), module.path()
t.check_kernel(module, torch.float32)
print("ok")
"""


def test_avx2_path_close_to_torch_and_batch_invariant():
    """The AVX2 path (what CPUs without AVX-512 run), forced on this CPU in a fresh process."""
    _module()
    here = os.path.dirname(__file__)
    env = dict(os.environ, LAYERSKIP_KERNEL_ISA="avx2",
               PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), *sys.path]))
    out = subprocess.run([sys.executable, "-c", AVX2_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_avx2_path_row_attention_is_batch_invariant():
    """CPUs without AVX-512 run the row attention's AVX2 version (fp32): the attention tests and a runner's T-token
    forward against one token at a time (bitwise), forced onto the AVX2 path in a fresh process. The fp32 tests must
    run there, not skip (bf16 has no AVX2 path and skips)."""
    _module()
    here = os.path.dirname(__file__)
    env = dict(os.environ, LAYERSKIP_KERNEL_ISA="avx2",
               PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), *sys.path]))
    tests = [os.path.join(here, "test_kernel_attention.py"),
             os.path.join(here, "test_kernel_invariance.py") + "::test_runner_verification_matches_token_by_token"]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                          *tests], env=env, capture_output=True, text=True, timeout=600, cwd=os.path.dirname(here))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "torch.float32 here" not in out.stdout, out.stdout[-3000:]


def _bf16_module():
    module = _module()
    if not module.supports_bf16():
        pytest.skip("this CPU has no AVX512_BF16: bf16 runs on torch's matmul")
    return module


def test_bf16_close_to_torch_and_batch_invariant():
    module = _bf16_module()
    check_kernel(module, torch.bfloat16)
    x, w = torch.randn(3, 576).bfloat16(), torch.randn(50, 576).bfloat16()
    exact = F.linear(x.double(), w.double())  # bf16 inputs are exact in fp64: only the output rounding differs
    assert (module.small_matmul(x, w).double() - exact).abs().max() <= exact.abs().max() * 2 ** -7


def test_load_kernel_picks_dtypes_the_cpu_runs():
    cpu = torch.device("cpu")
    assert load_kernel(torch.float32, cpu, "torch") is None
    assert load_kernel(torch.float16, cpu, "auto") is None
    module = kernels.load()
    assert load_kernel(torch.float32, cpu, "auto") is module
    bf16 = load_kernel(torch.bfloat16, cpu, "auto")
    assert (bf16 is not None) == (module is not None and kernels.cpu_has_bf16() and module.supports_bf16())


def test_linear_places_weights_back_to_back_and_keeps_values():
    module = _module()
    arena.release()
    ws = [torch.randn(n, 64) for n in (10, 7, 33)]
    linears = [Linear(w, None, module) for w in ws]
    x = torch.randn(3, 64)
    for w, lin in zip(ws, linears, strict=True):
        assert torch.equal(lin.weight, w) and within_rounding(lin(x), x, w)
    read = [lin.matrix() for lin in linears]  # what the kernel reads: packed panels on AVX-512, else the matrix
    assert (module.path() == "avx512") == all(m.dim() == 3 for m in read)
    ends = [m.data_ptr() + m.numel() * 4 for m in read]
    starts = [m.data_ptr() for m in read]
    assert all(0 <= s - e < arena.ALIGN for e, s in zip(ends[:-1], starts[1:], strict=True))  # back to back
    big = torch.randn(arena.MAX_BYTES // 4 // 64 + 1, 64)
    head = Linear(big, None, module)
    if head.panels is None:
        assert head.weight.data_ptr() == big.data_ptr()  # an LM-head-sized matrix stays put
    else:  # packed: the panels are the only copy; the matrix unpacks from them exactly, and its rows gather
        assert torch.equal(head.weight, big)
        ids = torch.tensor([0, 47, 48, big.shape[0] - 1])
        assert torch.equal(head.rows(ids), big[ids])
    assert Linear(ws[0], None, None).weight.data_ptr() == ws[0].data_ptr()  # no kernel: no copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_panels_unpack_and_gather_rows_exactly(dtype):
    """The panel layout loses nothing: a packed matrix (rows off the 48-row groups) unpacks to itself and any of its
    rows gathers exactly (a tied embedding reads the LM head's rows this way), in fp32 and bf16."""
    module = _bf16_module() if dtype == torch.bfloat16 else _module()
    w = torch.randn(100, 72).to(dtype)
    lin = Linear(w, None, module)
    if lin.panels is None:
        pytest.skip("the kernel's AVX-512 path is not this CPU's (no packed panels)")
    assert lin.panels.shape == (3, 72, 48) and lin.plain is None
    assert torch.equal(lin.weight, w)
    ids = torch.tensor([99, 0, 47, 48, 95, 96, 5])
    assert torch.equal(lin.rows(ids), w[ids])


@pytest.mark.parametrize("amx", [False, True])
def test_a_bf16_prefill_runs_on_torch_where_the_cpu_has_amx(monkeypatch, amx):
    """bf16 prefill rows (``bulk``) from ``TORCH_BULK_ROWS`` on run on torch's matmul over the unpacked matrix where the
    CPU has AMX (rows padded to a multiple, cut back), else on the panels; decoding steps and fp32 stay on the panels.
    Either way the product is W x to bf16 rounding."""
    from infer.model import weights

    module = _bf16_module()
    monkeypatch.setattr(kernels, "cpu_has_amx", lambda: amx)
    w = torch.randn(100, 72).bfloat16()
    lin = Linear(w, None, module)
    if lin.panels is None:
        pytest.skip("the kernel's AVX-512 path is not this CPU's (no packed panels)")
    calls = []
    panel_matmul = module.panel_matmul
    monkeypatch.setattr(lin, "kernel", type("K", (), {"panel_matmul": lambda self, *a: calls.append(1) or
                                                        panel_matmul(*a)})())
    for rows, bulk in [(weights.TORCH_BULK_ROWS - 1, True), (weights.TORCH_BULK_ROWS + 5, True), (200, False)]:
        x = torch.randn(rows, 72).bfloat16()
        calls.clear()
        y = lin(x, bulk=bulk)
        exact = F.linear(x.double(), w.double())  # (rows, 100)
        assert y.shape == (rows, 100) and y.dtype == torch.bfloat16
        assert (y.double() - exact).abs().max() <= exact.abs().max() * 2 ** -7
        on_torch = amx and bulk and rows >= weights.TORCH_BULK_ROWS
        assert calls == ([] if on_torch else [1]), (rows, bulk)
    assert not Linear(torch.randn(100, 72), None, module).bulk_on_torch(torch.randn(64, 72))  # fp32: the panels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runner_verification_matches_token_by_token(dtype):
    """A T-token forward against one token at a time: the matmuls, norms and (on the AVX-512 path) the attention are
    batch invariant, so the logits are bitwise equal; elsewhere (SDPA attention) equal to rounding."""
    if dtype == torch.bfloat16:
        _bf16_module()
    else:
        _module()
    runner = Runner.from_model(make_model("llama", seed=3), dtype=dtype)
    assert runner.kernel is not None
    exact = row_kernel(runner.kernel, torch.empty(0, dtype=dtype)) is not None
    ids = torch.arange(5, 45)
    cache = runner.new_cache(64)
    runner.forward(cache, ids[:24])  # the prompt
    for T in (2, 3, 4, 5, 8, 16):  # a verification of T tokens after the prompt, then the same tokens one by one
        batched = runner.forward(cache, ids[24:24 + T])
        cache.rollback(24)
        stepped = torch.cat([runner.forward(cache, ids[i:i + 1]) for i in range(24, 24 + T)])
        cache.rollback(24)
        if exact:
            assert torch.equal(batched, stepped), T
        tol = 1e-5 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(batched.float(), stepped.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("name, options", [("early_exit", {"E": 2, "k": 3}), ("early_exit", {"E": 3, "k": 6}),
                                           ("swift", {"context_window": 8, "remember": "off", "adaptive": False})])
def test_bf16_self_speculation_equals_bf16_plain_decoding(name, options):
    """With the batch-invariant row attention (AVX-512 path with AVX512_BF16), bf16 verification reproduces bf16
    one-token decoding bitwise, so no near-tie flips: self-speculation gives plain decoding's tokens."""
    _bf16_module()
    runner = Runner.from_model(make_model("llama", seed=5, layers=6), dtype=torch.bfloat16)
    assert row_kernel(runner.kernel, torch.empty(0, dtype=torch.bfloat16)) is not None
    config = DecodeConfig(max_new_tokens=48)
    drafted = 0
    for prompt in ([5, 17, 99, 3, 44, 120, 7], list(range(60, 90)), [200, 3, 3, 9]):
        plain = Engine(runner, build_drafter("autoregressive", runner)).generate(prompt, config).tokens
        result = Engine(runner, build_drafter(name, runner, options)).generate(prompt, config)
        assert result.tokens == plain, prompt[:3]
        drafted += result.stats.drafted
    assert drafted > 0


def test_rms_norm_close_to_torch_and_batch_invariant():
    from infer.model import weights

    module = _module()
    x, w = torch.randn(9, 576), torch.randn(576)
    fast = kernels.norm_kernel()
    if fast is None:
        assert module.path() != "avx512"  # only the AVX-512 path has the row norm
        pytest.skip("the row norm runs on the AVX-512 path only")
    y = weights.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(y, F.rms_norm(x, (576,), w, 1e-5), atol=1e-5, rtol=1e-5)
    assert all(torch.equal(weights.rms_norm(x[t:t + 1], w, 1e-5)[0], y[t]) for t in range(9))
    for d in (8, 40, 64):  # a masked last chunk
        xd, wd = torch.randn(3, d), torch.randn(d)
        torch.testing.assert_close(fast.rms_norm(xd, wd, 1e-6), F.rms_norm(xd, (d,), wd, 1e-6), atol=1e-5, rtol=1e-5)
    x.requires_grad_(True)
    assert weights.rms_norm(x, w, 1e-5).grad_fn is not None  # autograd: torch's norm


def test_bf16_rms_norm_is_hf_arithmetic_and_batch_invariant():
    from infer.model import weights

    module = _bf16_module()
    x, w = (torch.randn(9, 576) * 3).bfloat16(), torch.randn(576).bfloat16()
    y = module.rms_norm(x, w, 1e-5)
    x32 = x.float()
    ref = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()  # HF LlamaRMSNorm
    assert y.dtype == torch.bfloat16
    assert (y.float() - ref.float()).abs().max() <= ref.float().abs().max() * 2 ** -7  # at most a rounding apart
    assert all(torch.equal(module.rms_norm(x[t:t + 1], w, 1e-5)[0], y[t]) for t in range(9))
    assert torch.equal(weights.rms_norm(x, w, 1e-5), y)  # the runner's norm takes it


def test_threads_split_rows_without_changing_any_bit():
    """Two threads really split the rows (the extension is built for torch's parallel backend: without ``-fopenmp``
    ``at::parallel_for`` ran every call on one thread, and this test passed with nothing split) and give the same
    bits as one."""
    module = _module()
    x, w = torch.randn(5, 576), torch.randn(300, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert module.parallel_threads() == 1
        one = module.small_matmul(x, w)
        torch.set_num_threads(2)
        assert module.parallel_threads() == 2
        assert torch.equal(module.small_matmul(x, w), one)
    finally:
        torch.set_num_threads(threads)
