"""The exactness contract at widths off the kernel's vectors (issue 67, item 4): heads x head dim 102, an MLP width of
100 or 1100, a hidden size of 60 or 63, a vocabulary of 321, a head dim of 34. On every kernel path (AVX-512 here, the
AVX2 path forced in a subprocess) and on 1 and 2 threads, a runner's T-row forward is bitwise its rows one at a time,
and every drafter's greedy output equals plain decoding on a model full of near-ties. Where a shape or path stays
outside the contract (the portable path, bf16 at an odd width, a head dim over 256), the runner says so once at load
(``ExactnessWarning``). docs/KERNELS.md, "Where the exactness contract holds"."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from infer import kernels
from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import ExampleModel, build_drafter, example_cases
from infer.model.layer_math import gated
from infer.model.runner import Runner
from infer.model.weights import ExactnessWarning, Linear
from layerskip_core.families import ModelSpec
from tiny_models import make_model

ODD = {  # name: LlamaConfig overrides of the tiny model (64 wide, 4 heads of 16, MLP 128, vocabulary 320)
    "HqD102": dict(hidden_size=96, num_attention_heads=3, num_key_value_heads=1, head_dim=34),
    "I100": dict(intermediate_size=100),
    "d60": dict(hidden_size=60, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "d63": dict(hidden_size=63, num_attention_heads=3, num_key_value_heads=1, head_dim=22),
    "V321": dict(vocab_size=321),
    "I1096": dict(intermediate_size=1096),
}
"""q/k/v's and o's widths off 8 (and a head dim off the AVX2 attention's 8 lanes), the MLP's, the hidden size's (odd:
63), the LM head's rows; I1096 (every width a multiple of 8, the MLP's not of 64): a 31-row verification has 33976
>= 32768 gate elements, which torch's SiLU splits between 2 threads mid-row, where a vector loop's tail falls
elsewhere than in a row alone."""
SIZES = (2, 3, 5, 8, 17, 31, 32, 33)
"""Verified rows: the fused span's range (up to 32) and past it (33: the Python loop)."""
NEAR_TIE = dict(hidden_size=96, num_attention_heads=3, num_key_value_heads=1, head_dim=34, intermediate_size=100,
                vocab_size=321)


def _module():
    module = kernels.load()
    if module is None:
        pytest.skip("small-matmul kernel unavailable on this machine (the portable torch path runs instead)")
    return module


def _runner(name: str, dtype: torch.dtype = torch.float32, **kwargs) -> Runner:
    return Runner.from_model(make_model("llama", seed=3, **ODD[name]), dtype=dtype, **kwargs)


def _threads(n: int):
    """torch's thread count set to ``n`` (and the kernel's parallel regions really on n) until the caller resets."""
    if n > 1 and (os.cpu_count() or 1) < n:
        pytest.skip(f"{n} threads need {n} cores")
    torch.set_num_threads(n)
    assert kernels.load().parallel_threads() == n


def check_verification(runner: Runner, sizes=SIZES) -> None:
    """A T-row forward after a prompt against the same tokens one at a time: bitwise equal logits, every T."""
    V = runner.lm_head.shape[0]
    ids = (torch.arange(7, 7 + 24 + max(sizes)) * 37) % V
    cache = runner.new_cache(32 + max(sizes))
    runner.forward(cache, ids[:24])  # the prompt
    for T in sizes:
        batched = runner.forward(cache, ids[24:24 + T])
        cache.rollback(24)
        stepped = torch.cat([runner.forward(cache, ids[i:i + 1]) for i in range(24, 24 + T)])
        cache.rollback(24)
        differ = (batched != stepped).any(-1).nonzero().flatten().tolist()
        assert not differ, f"T={T}: rows {differ} differ from one-token decoding"


def kernel_everywhere(runner: Runner) -> None:
    """Every matrix on the kernel, and the fused span taken on the AVX-512 path (in bf16 too where the hidden size is
    not a multiple of 16: its norms then run torch's upcast, as the Python loop's do)."""
    linears = [runner.lm_head] + [m for w in runner.layers for m in (w.qkv, w.o, w.gate_up, w.down)]
    assert all(m.kernel is not None for m in linears), [m.shape for m in linears if m.kernel is None]
    assert (runner.fused is not None) == (runner.kernel.path() == "avx512")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", list(ODD))
def test_verification_is_token_by_token_bitwise(name, threads):
    _module()
    before = torch.get_num_threads()
    try:
        _threads(threads)
        runner = _runner(name)
        check_verification(runner)
        kernel_everywhere(runner)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", [n for n in ODD if n != "d63"])  # d63: odd widths in bf16 warn (below)
def test_bf16_verification_is_token_by_token_bitwise(name):
    module = _module()
    if not module.supports_bf16():
        pytest.skip("this CPU has no AVX512_BF16: bf16 runs on torch's matmul")
    before = torch.get_num_threads()
    try:
        _threads(2)
        runner = _runner(name, torch.bfloat16)
        check_verification(runner, (2, 5, 17, 31, 33))
        kernel_everywhere(runner)
    finally:
        torch.set_num_threads(before)


GATE_SHAPES = [(1, 100), (7, 100), (333, 100), (31, 1096), (31, 1100), (5, 1536), (33, 1536), (3, 7)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gelu", [False, True])
def test_kernel_activation_is_row_invariant_and_torchs_to_rounding(gelu, dtype):
    """``gated_act``: each row of a T-row call bitwise the row alone, on 2 threads against 1 (torch's F.silu is not,
    where a tensor of 32768 elements or more splits mid-row), within a few ulps of torch's act(gate) * up."""
    module = _module()
    if dtype == torch.bfloat16 and module.path() != "avx512":
        pytest.skip("bf16 activation: the AVX-512 path")
    gen = torch.Generator().manual_seed(1)
    before = torch.get_num_threads()
    try:
        for T, width in GATE_SHAPES:
            gu = (torch.randn(T, 2 * width, generator=gen) * 4).to(dtype)  # (T, 2 I): gate | up
            _threads(2)
            out = module.gated_act(gu, gelu)  # (T, I)
            _threads(1)
            alone = torch.cat([module.gated_act(gu[t:t + 1], gelu) for t in range(T)])
            assert torch.equal(out, alone), (T, width)
            gate, up = gu.double().chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
            ref = act.to(dtype).double() * up if dtype == torch.bfloat16 else act * up  # torch's bf16 rounding
            # a few fp32 roundings of act's argument (|x| scale) and of the result; bf16: one rounding more
            tol = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -20
            assert ((out.double() - ref).abs() <= tol * (ref.abs() + (gate * up).abs() * 2 ** -4)).all(), (T, width)
    finally:
        torch.set_num_threads(before)


def test_layer_math_takes_the_kernel_activation_where_the_matmul_is_the_kernels():
    module = _module()
    spec = ModelSpec.from_config(make_model("llama", **ODD["I100"]).config)
    gu = torch.randn(4, 200)
    assert torch.equal(gated(spec, Linear(torch.randn(200, 64), None, module), gu), module.gated_act(gu, False))
    torch_side = gated(spec, Linear(torch.randn(200, 64), None, None), gu)  # torch's matmul: torch's SiLU
    gate, up = gu.chunk(2, dim=-1)
    assert torch.equal(torch_side, F.silu(gate) * up)


AVX2_RUN = ["-k", "test_verification_is_token_by_token_bitwise or test_kernel_activation or "
            "test_every_drafter_equals_plain_decoding_at_near_ties or test_no_warning"]


def test_avx2_path_keeps_odd_widths_exact():
    """CPUs with AVX2 but no AVX-512 (the path forced on this CPU in a fresh process): the same checks there; they
    must run, not skip."""
    module = _module()
    if module.path() != "avx512":
        pytest.skip("this CPU runs the AVX2 path already: the tests above ran on it")
    here = os.path.dirname(__file__)
    env = dict(os.environ, LAYERSKIP_KERNEL_ISA="avx2",
               PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), *sys.path]))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                          os.path.abspath(__file__), *AVX2_RUN], env=env, capture_output=True, text=True,
                         timeout=900, cwd=os.path.dirname(here))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout, out.stdout[-3000:]
    skips = [line for line in out.stdout.splitlines() if line.startswith("SKIPPED")]
    assert all("bf16 activation" in line for line in skips), skips  # only bf16, which has no AVX2 path


def near_tie_model():
    """The odd-width model with its LM head in pairs of rows one ulp apart in one weight: wherever greedy decoding
    picks one of a pair, the choice rests on the last bit of two logits, so a verification that rounds any row
    differently from one-token decoding changes the output."""
    model = make_model("llama", seed=7, layers=6, **NEAR_TIE)
    with torch.no_grad():
        w = model.lm_head.weight  # (V, d)
        pairs = w.shape[0] // 2
        w[1:2 * pairs:2] = w[0:2 * pairs:2]
        w[1:2 * pairs:2, 0] = torch.nextafter(w[0:2 * pairs:2, 0], torch.tensor(math.inf))
    return model


def drafter_cases(layers: int) -> dict[str, tuple[str, dict]]:
    """Every registered drafter's examples but plain decoding's (the reference)."""
    return {case: c for case, c in example_cases(ExampleModel(layers)).items() if c[0] != "autoregressive"}


def test_every_drafter_equals_plain_decoding_at_near_ties():
    _module()
    runner = Runner.from_model(near_tie_model())
    config = DecodeConfig(max_new_tokens=40)
    prompts = [[5, 17, 99, 3, 44, 120, 7], list(range(60, 90))]
    plain = [Engine(runner, build_drafter("autoregressive", runner)).generate(p, config).tokens for p in prompts]
    for case, (name, options) in drafter_cases(runner.num_layers).items():
        drafted = 0
        for prompt, ref in zip(prompts, plain, strict=True):
            result = Engine(runner, build_drafter(name, runner, options)).generate(prompt, config)
            assert result.tokens == ref, (case, prompt[:3])
            drafted += result.stats.drafted
        assert drafted > 0, case
    kernel_everywhere(runner)


def _warned(build) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()
    return [str(w.message) for w in caught if issubclass(w.category, ExactnessWarning)]


def test_no_warning_inside_the_contract():
    _module()
    for name in ODD:
        assert _warned(lambda name=name: _runner(name)) == [], name


def test_the_portable_path_warns_once_at_load():
    said = _warned(lambda: _runner("HqD102", kernel="torch"))
    assert len(said) == 1 and "portable path" in said[0] and "near-ties" in said[0], said


def test_bf16_at_an_odd_width_warns_naming_it():
    module = _module()
    if not module.supports_bf16():
        pytest.skip("this CPU has no AVX512_BF16: bf16 runs on torch's matmul (the documented near-tie rule)")
    said = _warned(lambda: _runner("d63", torch.bfloat16))
    assert any("self_attn.q/k/v_proj (110 x 63, bfloat16)" in s and "near-ties" in s for s in said), said
    assert any("mlp.gate/up_proj (256 x 63, bfloat16)" in s for s in said), said
    assert any("lm_head (320 x 63, bfloat16)" in s for s in said), said
    assert not any("o_proj" in s or "down_proj" in s for s in said), said  # their inputs (66, 128) are even


def test_a_head_dim_past_the_row_attention_warns():
    _module()
    said = _warned(lambda: Runner.from_model(make_model("llama", hidden_size=64, num_attention_heads=1,
                                                        num_key_value_heads=1, head_dim=272)))
    assert len(said) == 1 and "head dim 272" in said[0], said
