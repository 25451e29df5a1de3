"""The fused layer span (``infer.model.fused_span``, ``layer_span.cpp``): bitwise the Python layer loop.

Against ``infer.model.loop`` (the eager executor: ``Runner.run`` without the fused one): the stream at ``split`` and
after ``end``, every K/V row of the cache, the cache lengths and the layer counters, in fp32 and bf16 (where the CPU has
AVX512_BF16), for T in 1-5, 8, 16, with and without a token-tree mask, under skip plans (attention, MLP, both
skipped), from start > 0 to end < depth, over layers whose caches have different lengths; on random small Llama
configs (head dims 16, 24 and 40, MLP widths off the 16-lane vectors) and on the default model. Runners that do not
qualify (``kernel='torch'``) keep the Python loop; every family and packed rows: test_fused_families.py."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from torch import Tensor

from infer import kernels
from infer.model import fused_span
from infer.model.plan import LayerPlan
from infer.model.program import BULK, ONCE, Declined, Program, Rows
from infer.model.runner import Runner
from tiny_models import family_model, make_model

DTYPES = [torch.float32, torch.bfloat16]
SIZES = (1, 2, 3, 4, 5, 8, 16)
CONFIGS = {  # name: LlamaConfig overrides (6 layers)
    "d64-D16": dict(),
    "d96-D24": dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=1, intermediate_size=200),
    "d80-D40": dict(hidden_size=80, num_attention_heads=2, num_key_value_heads=2, head_dim=40, intermediate_size=72),
}
DEFAULT_MODEL = Path(os.environ.get("LAYERSKIP_CACHE", Path.home() / ".cache" / "layerskip")) / "models" / \
    "smollm2-135m-instruct"


def _need_kernel(dtype: torch.dtype):
    module = kernels.load()
    if module is None or module.path() != "avx512":
        pytest.skip("the fused layer span runs on the kernel's AVX-512 path only (here: the Python loop)")
    if not kernels.supports(module, dtype):
        pytest.skip("this CPU has no AVX512_BF16: bf16 runs on torch's matmul and the Python loop")


def _tiny_runner(name: str, dtype: torch.dtype) -> Runner:
    _need_kernel(dtype)
    model = make_model("llama", seed=11, layers=6, **CONFIGS[name])
    with torch.no_grad():  # norm weights off 1, so the norms' products matter
        gen = torch.Generator().manual_seed(5)
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    return Runner.from_model(model, dtype=dtype)


def _clone(cache):
    other = copy.copy(cache)
    other.k, other.v, other.lengths = cache.k.clone(), cache.v.clone(), list(cache.lengths)
    return other


def _python_span(runner: Runner, cache, hidden, pos, start, split, end, plan, mask):
    """The program on the Python loop (the runner without its fused executor): (exact, out)."""
    loop = copy.copy(runner)
    loop.fused = None
    out = loop.run(Program(start, end, split, plan), Rows.one(cache, hidden, pos, mask))
    return out.exact, out.hidden


def _fused_span(runner: Runner, cache, hidden, pos, start, split, end, plan, mask):
    """The program on a fused executor of its own (the runner advancing lengths and counters): (exact, out)."""
    fused = fused_span.for_runner(runner)
    assert fused is not None
    program, rows = Program(start, end, split, plan), Rows.one(cache, hidden, pos, mask)
    assert fused.declines(program, rows) is None, "the fused span refused the call"
    alone = copy.copy(runner)
    alone.fused = fused
    out = alone.run(program, rows)
    return out.exact, out.hidden


def _check_same(runner: Runner, cache, T: int, start: int, split: int, end: int, plan, mask, label) -> None:
    """One span on the Python loop and fused, from clones of ``cache``: every output bit, cache row, length and
    counter the same."""
    hidden = runner.embed(torch.arange(7, 7 + T) * 3)  # (T, d)
    pos = list(range(cache.lengths[0], cache.lengths[0] + T))
    results = []
    for span in (_python_span, _fused_span):
        c = _clone(cache)
        runner.counters.reset()
        exact, out = span(runner, c, hidden, pos, start, split, end, plan, mask)
        results.append((exact, out, c, list(runner.counters.layer_tokens)))
    (e0, o0, c0, n0), (e1, o1, c1, n1) = results
    assert torch.equal(e0, e1) and torch.equal(o0, o1), label
    assert torch.equal(c0.k, c1.k) and torch.equal(c0.v, c1.v), label
    assert c0.lengths == c1.lengths and n0 == n1, label


def _uneven_cache(runner: Runner, context: int):
    """A cache with ``context`` tokens in every layer and 3 more in the first two (an early exit's shallow layers run
    ahead): the span's layers start from different slots."""
    cache = runner.new_cache(96)
    runner.forward(cache, torch.arange(3, 3 + context))
    hidden = runner.embed(torch.tensor([40, 41, 42]))
    runner.run(Program(0, 2), Rows.one(cache, hidden, torch.arange(context, context + 3), kind=ONCE))
    return cache


PLANS = {"none": (frozenset(), frozenset()), "attn": (frozenset({1, 4}), frozenset()),
         "mlp": (frozenset(), frozenset({2, 4})), "both": (frozenset({3}), frozenset({3, 5}))}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CONFIGS)
def test_fused_span_is_the_python_loop_bitwise(name, dtype):
    runner = _tiny_runner(name, dtype)
    cache = _uneven_cache(runner, 20)
    for T in SIZES:
        tree = torch.rand(T, T + 4, generator=torch.Generator().manual_seed(T)) < 0.6
        tree[:, -T:] |= torch.eye(T, dtype=torch.bool)  # each row sees itself
        for mask in (None, tree):
            for plan_name, (attn, mlp) in PLANS.items():
                plan = LayerPlan(6, attn, mlp)
                for start, split, end in ((0, 6, 6), (0, 2, 6), (1, 3, 5), (2, 2, 4)):
                    label = (name, dtype, T, mask is not None, plan_name, start, split, end)
                    _check_same(runner, cache, T, start, split, end, plan, mask, label)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_token_into_an_empty_cache_and_skipped_layers(dtype):
    """One row from slot 0 (the row attention over its own key), and a span whose every sublayer is skipped (the
    stream passes through; nothing written, no counter moves)."""
    runner = _tiny_runner("d64-D16", dtype)
    cache = runner.new_cache(32)
    _check_same(runner, cache, 1, 0, 6, 6, None, None, "empty cache")
    everything = LayerPlan(6, frozenset(range(6)), frozenset(range(6)))
    _check_same(runner, _uneven_cache(runner, 9), 4, 0, 0, 6, everything, None, "all skipped")


@pytest.mark.parametrize("dtype", DTYPES)
def test_default_model_fused_span_is_the_python_loop_bitwise(dtype):
    if not (DEFAULT_MODEL / "config.json").is_file():
        pytest.skip(f"the default model is not at {DEFAULT_MODEL}")
    _need_kernel(dtype)
    runner = Runner.from_pretrained(DEFAULT_MODEL, dtype=dtype)
    L = runner.num_layers
    cache = runner.new_cache(64)
    runner.run(Program(0, L), Rows.one(cache, runner.embed(torch.arange(100, 130)), torch.arange(30), kind=BULK))
    plan = LayerPlan(L, frozenset({5, 9, 17}), frozenset({9, 12, 20, 25}))
    for T in (1, 4, 16):
        tree = torch.ones(T, T, dtype=torch.bool).tril()
        tree[T // 2:, :T // 4] = False  # another branch's rows hidden
        for mask in (None, tree):
            for start, split, end in ((0, L, L), (0, 4, L), (3, 10, 24)):
                label = (dtype, T, mask is not None, start, split, end)
                _check_same(runner, cache, T, start, split, end, plan, mask, label)


def test_calls_the_fused_span_does_not_take_are_refused_untouched():
    """More than MAX_TOKENS rows, T > 1 rows from an empty layer (causal SDPA), a float mask, autograd, two
    segments over one cache, a BLAS prefill: declined with the reason, and the cache and counters as they were."""
    runner = _tiny_runner("d64-D16", torch.float32)
    fused = fused_span.for_runner(runner)
    cache = _uneven_cache(runner, 40)
    before = _clone(cache)
    counted = list(runner.counters.layer_tokens)
    rows = fused_span.MAX_TOKENS + 1
    every = Program(0, 6)
    two = runner.embed(torch.arange(2))
    calls = {
        "fused: not 1 to": Rows.one(cache, runner.embed(torch.arange(rows)), list(range(43, 43 + rows))),
        "fused: causal rows from an empty layer": Rows.one(runner.new_cache(32), two, [0, 1]),
        "fused: a mask that is not": Rows.one(cache, two, [43, 44], torch.ones(2, 2)),
        "fused: two segments over one cache": Rows(two, [Rows.one(cache, two[:1], [43]).segments[0]] * 2),
        "fused: a prompt prefill": Rows.one(cache, two, [43, 44], kind=BULK),
    }
    for reason, given in calls.items():
        out = fused.run(every, given)
        assert isinstance(out, Declined) and out.reason.startswith(reason), (reason, out)
    with torch.enable_grad():
        out = fused.run(every, Rows.one(cache, two.requires_grad_(True), [43, 44]))
        assert isinstance(out, Declined) and out.reason.startswith("fused: autograd"), out
    assert torch.equal(cache.k, before.k) and cache.lengths == before.lengths
    assert runner.counters.layer_tokens == counted


def test_errors_are_the_python_loops():
    """A full cache and a mask wider than the slots raise as the Python loop does (RuntimeError, ValueError)."""
    runner = _tiny_runner("d64-D16", torch.float32)
    fused = fused_span.for_runner(runner)
    cache = runner.new_cache(8)
    runner.forward(cache, torch.arange(3, 9))
    with pytest.raises(RuntimeError, match="KV cache full: layer 0 needs 10 slots, capacity 8"):
        fused.run(Program(0, 6), Rows.one(cache, runner.embed(torch.arange(4)), [6, 7, 8, 9]))
    with pytest.raises(ValueError, match="mask covers 12 slots but only 7 exist"):
        wide = torch.ones(1, 12, dtype=torch.bool)
        fused.run(Program(0, 6), Rows.one(cache, runner.embed(torch.arange(1)), [6], wide))


@pytest.mark.parametrize("kind", ["qwen3", "gemma3_text", "mistral_window", "qwen2_window", "smollm3"])
def test_every_family_takes_the_fused_span(kind):
    """q/k norms, Gemma's norms and GELU, sliding windows, biases, layers without RoPE: fused
    (tests/infer/test_fused_families.py: bitwise the loop)."""
    _need_kernel(torch.float32)
    assert fused_span.unfit(Runner.from_model(family_model(kind, seed=1))) is None


def test_the_torch_path_keeps_the_python_loop():
    _need_kernel(torch.float32)
    assert fused_span.for_runner(Runner.from_model(make_model("qwen2", seed=1))) is not None
    runner = Runner.from_model(make_model("llama", seed=1), kernel="torch")
    assert fused_span.for_runner(runner) is None
    assert fused_span.unfit(runner) == "fused: no AVX-512 kernel for the runner's dtype on a CPU"
    assert fused_span.for_runner(Runner.from_model(make_model("llama", seed=1))) is not None


class Recording:
    """A fused executor that records the (start, exact_until, end) of each program it runs."""

    name = "fused"

    def __init__(self, fused, calls: list):
        self.fused, self.calls = fused, calls

    def run(self, program, rows):
        out = self.fused.run(program, rows)
        if not isinstance(out, Declined):
            self.calls.append((program.start, program.exact_until, program.end))
        return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_runner_takes_the_fused_span_and_computes_what_the_loop_does(dtype):
    """``Runner.run`` of one sequence's decoding step and of a one-off forward run fused (once per call), and a
    verification with a tree mask and a draft under a skip plan give the loop's logits, cache rows, lengths and counters
    bitwise."""
    runner = _tiny_runner("d96-D24", dtype)
    assert runner.fused is not None
    loop = copy.copy(runner)
    loop.fused = None  # the same weights on the Python loop
    calls = []
    runner.fused = Recording(runner.fused, calls)
    plan = LayerPlan(6, frozenset({2}), frozenset({1, 4}))
    results = []
    for r in (runner, loop):
        cache = _uneven_cache(r, 12)
        r.counters.reset()
        calls.clear()
        tree = torch.ones(4, 4, dtype=torch.bool).tril()
        tree[3, 1] = False
        verified = r.forward(cache, torch.tensor([9, 8, 7, 6]), mask=tree)  # fused from slot 12
        draft = r.run(Program(0, 6, 3, plan, logits=True), Rows.one(cache, r.embed(torch.tensor([5])), [16]))
        results.append((verified, draft.exact, draft.hidden, draft.logits, cache.k, cache.v, cache.lengths,
                        list(r.counters.layer_tokens)))
        assert calls == ([(0, 6, 6), (0, 3, 6)] if r is runner else [])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b) if isinstance(a, Tensor) else a == b


def test_runners_that_do_not_qualify_have_no_fused_span():
    _need_kernel(torch.float32)
    assert Runner.from_model(make_model("llama", seed=1), kernel="torch").fused is None
    runner = Runner.from_model(make_model("llama", seed=1))
    assert runner.fused is not None
    adapter = runner.over_layers(runner.layers[:2], runner.final_norm)  # its own stack, over its own layers
    assert adapter.fused is not None and adapter.fused is not runner.fused
