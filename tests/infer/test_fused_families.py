"""The fused executor (``infer.model.fused_span``, ``layer_span.cpp``) on every family and on packed rows of several
sequences: bitwise the Python layer loop, and each packed row bitwise its sequence alone.

For each family of ``tests/tiny_models.py`` (Llama; Mistral and Qwen2 with sliding windows, Qwen2's q/k/v biases;
Qwen3's q/k norms at head dim 24, off the bf16 row norm's 16-lane rows; Gemma 3's (1 + w), q/k and post norms,
GELU-tanh, local and global RoPE tables and windows, the attention scale; SmolLM3's layers without RoPE), fp32 and
bf16: programs (full, a skip plan after a cut, observed layers, the LM head; sub-ranges) over one sequence and over
B = 2 and 4 packed sequences of different lengths (contexts past the 48-token window, one cache uneven across
layers as an early exit leaves it), with token-tree masks whose rows sit at positions other than their slots, run
on the loop and fused from clones of the same caches: the streams, logits, every K/V row, the windowed layers' slot
positions, the cache lengths and the layer counters equal; and the fused packed rows equal the fused rows of each
sequence alone."""

from __future__ import annotations

import copy

import pytest
import torch

from infer import kernels
from infer.model import fused_span
from infer.model.loop import EagerExecutor
from infer.model.plan import LayerPlan
from infer.model.program import ONCE, Declined, Program, Rows, Segment
from infer.model.runner import Runner
from tiny_models import FAMILY_KINDS, TINY_WINDOW, family_model, make_model

L = 6
KINDS = ("llama", *FAMILY_KINDS)
DTYPES = [torch.float32, torch.bfloat16]
CONTEXTS = (60, 75, 53, 90)  # past the window (48), different per sequence
PLAN = LayerPlan(L, frozenset({3}), frozenset({2, 5}))
PROGRAMS = {  # name: Program
    "full": Program(0, L, logits=True),
    "plan": Program(0, L, exact_until=2, plan=PLAN, observe=(1, 4), logits=True),
    "draft": Program(0, 3, logits=True),
    "middle": Program(2, 5, observe=(3,)),
}
_RUNNERS: dict = {}


def _need_kernel(dtype: torch.dtype) -> None:
    module = kernels.load()
    if module is None or module.path() != "avx512":
        pytest.skip("the fused executor runs on the kernel's AVX-512 path only")
    if not kernels.supports(module, dtype):
        pytest.skip("this CPU has no AVX512_BF16")


def _runner(kind: str, dtype: torch.dtype) -> Runner:
    _need_kernel(dtype)
    if (kind, dtype) not in _RUNNERS:
        if kind == "llama":
            model = make_model("llama", seed=3, layers=L)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "norm" in name:
                        p.normal_(1.0, 0.2)
        else:
            model = family_model(kind, seed=3, layers=L)
        _RUNNERS[kind, dtype] = Runner.from_model(model, dtype=dtype)
    return _RUNNERS[kind, dtype]


def _caches(runner: Runner) -> list:
    """One cache per context, prefilled on the loop; the first has 3 rows more in layers 0 and 1 (an early exit's
    shallow layers run ahead), so its layers start from different slots."""
    out = []
    for n, context in enumerate(CONTEXTS):
        cache = runner.new_cache(256)
        runner.forward(cache, (torch.arange(context) * (7 + n)) % 300 + 3)
        out.append(cache)
    extra = runner.embed(torch.tensor([40, 41, 42]))
    runner.run(Program(0, 2), Rows.one(out[0], extra, [CONTEXTS[0] + i for i in range(3)], kind=ONCE))
    return out


def _clone(cache):
    other = copy.copy(cache)
    other.k, other.v, other.lengths = cache.k.clone(), cache.v.clone(), list(cache.lengths)
    other.pos = None if cache.pos is None else cache.pos.clone()
    return other


def _tree(T: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    """A token tree of T nodes: (its (T, T) visibility mask, each node's depth): node t hangs under a random earlier
    node, so siblings share a position."""
    gen = torch.Generator().manual_seed(seed)
    parent = [-1] + [int(torch.randint(0, t, (1,), generator=gen)) for t in range(1, T)]
    mask, depth = torch.eye(T, dtype=torch.bool), [0] * T
    for t in range(1, T):
        mask[t] |= mask[parent[t]]
        depth[t] = depth[parent[t]] + 1
    return mask, depth


def _segments(runner: Runner, caches: list, shape: list[tuple[int, int, bool]]) -> list[Segment]:
    """Segments of (sequence, T, tree?) after each sequence's last position (its layer 5's length; a tree's nodes
    at their depths)."""
    out = []
    for n, T, tree in shape:
        cache = caches[n]
        start = cache.lengths[L - 1]
        if tree:
            mask, depth = _tree(T, 31 * n + T)
            out.append(Segment(cache, [start + d for d in depth], mask))
        else:
            out.append(Segment(cache, list(range(start, start + T))))
    return out


def _run(runner: Runner, fused: bool, program: Program, hidden: torch.Tensor, segments: list[Segment]):
    """The program on the loop or fused, from clones of the segments' caches: (output, caches, counters)."""
    r = copy.copy(runner)
    r.fused = fused_span.for_runner(runner) if fused else None
    r.counters = copy.deepcopy(runner.counters)
    r.counters.reset()
    clones = [_clone(s.cache) for s in segments]
    segs = [Segment(c, s.positions, s.mask) for c, s in zip(clones, segments, strict=True)]
    out = r.run(program, Rows(hidden, segs))
    assert fused == (r.fused is not None and r.fused.runs == 1), "the fused executor did not run the program"
    return out, clones, list(r.counters.layer_tokens)


def _same_output(a, b, label, rows: slice = slice(None)) -> None:
    assert torch.equal(a.exact[rows], b.exact), label
    assert torch.equal(a.hidden[rows], b.hidden), label
    assert a.observed.keys() == b.observed.keys(), label
    for x in a.observed:
        assert torch.equal(a.observed[x][rows], b.observed[x]), (label, x)
    assert (a.logits is None) == (b.logits is None), label
    assert a.logits is None or torch.equal(a.logits[rows], b.logits), label


def _same_caches(a: list, b: list, label) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.k, y.k) and torch.equal(x.v, y.v), label
        assert x.lengths == y.lengths, label
        assert (x.pos is None) == (y.pos is None) and (x.pos is None or torch.equal(x.pos, y.pos)), label


SHAPES = {  # name: [(sequence, T, tree?)]
    "one": [(0, 1, False)],
    "one tree": [(1, 5, True)],
    "B=2": [(0, 1, False), (1, 4, True)],
    "B=4": [(0, 3, False), (1, 1, False), (2, 6, True), (3, 2, False)],
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_fused_is_the_loop_bitwise_alone_and_packed(kind, dtype):
    runner = _runner(kind, dtype)
    assert fused_span.unfit(runner) is None and runner.fused is not None
    caches = _caches(runner)
    for shape_name, shape in SHAPES.items():
        segments = _segments(runner, caches, shape)
        N = sum(s.size for s in segments)
        hidden = runner.embed((torch.arange(N) * 11) % 300 + 5)  # (N, d)
        for name, program in PROGRAMS.items():
            label = (kind, dtype, shape_name, name)
            loop, loop_caches, loop_counts = _run(runner, False, program, hidden, segments)
            out, fused_caches, counts = _run(runner, True, program, hidden, segments)
            _same_output(loop, out, label)
            _same_caches(loop_caches, fused_caches, label)
            assert loop_counts == counts, label
            if len(segments) == 1:
                continue
            a = 0
            for s in segments:  # each packed row bitwise its sequence alone
                alone, alone_caches, _ = _run(runner, True, program, hidden[a:a + s.size], [s])
                _same_output(out, alone, label + ("alone", a), slice(a, a + s.size))
                _same_caches(alone_caches, [fused_caches[segments.index(s)]], label + ("alone", a))
                a += s.size


@pytest.mark.parametrize("kind", ["mistral_window", "gemma3_text"])
def test_windows_hide_old_keys_in_the_fused_rows(kind):
    """A windowed model's fused rows differ from what they would be with the window ignored: the window is applied
    (its slots' positions recorded), not only matched by accident on short contexts."""
    runner = _runner(kind, torch.float32)
    windowed = [i for i in range(L) if runner.spec.window(i) is not None]
    assert windowed and all(runner.spec.window(i) == TINY_WINDOW for i in windowed)
    caches = _caches(runner)
    segments = _segments(runner, caches, [(3, 2, False)])
    hidden = runner.embed(torch.tensor([9, 10]))
    out, clones, _ = _run(runner, True, Program(0, L, logits=True), hidden, segments)
    start = caches[3].lengths[0]
    assert clones[0].pos[windowed[0], start:start + 2].tolist() == list(segments[0].positions)
    wide = copy.copy(runner)
    wide.spec = copy.copy(runner.spec)
    wide.spec.layer_windows = (None,) * L
    wide.fused, wide.eager = None, EagerExecutor(wide)
    unwindowed = wide.run(Program(0, L, logits=True), Rows(hidden, [Segment(_clone(caches[3]), segments[0].positions)]))
    assert not torch.equal(out.logits, unwindowed.logits)


def test_declined_calls_say_why_and_touch_nothing():
    runner = _runner("qwen2_window", torch.float32)
    fused = runner.fused
    caches = _caches(runner)
    before = [_clone(c) for c in caches]
    two = runner.embed(torch.arange(2))
    shared = Segment(caches[0], [70])
    calls = {
        "fused: two segments over one cache": Rows(two, [shared, Segment(caches[0], [70])]),
        "fused: causal rows from an empty layer": Rows.one(runner.new_cache(32), two, [0, 1]),
        "fused: not 1 to": Rows(two[:1], [Segment(caches[0], [70]), Segment(caches[1], [80])]),
    }
    for reason, rows in calls.items():
        out = fused.run(Program(0, L), rows)
        assert isinstance(out, Declined) and out.reason.startswith(reason), (reason, out)
    assert fused.runs == 0 or all(torch.equal(a.k, b.k) for a, b in zip(caches, before, strict=True))
    _same_caches(caches, before, "declined")
