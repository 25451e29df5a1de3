"""A forward described once (``infer.model.program``) and run by the runner's executors: the steps a program derives
from its range, cut and plan; observed streams equal to separate forwards cut at those layers, on every executor; the
reasons executors decline; the cache lengths and counters advanced once, whichever executor ran."""

import copy
import warnings

import pytest
import torch

from infer import kernels
from infer.model.plan import LayerPlan
from infer.model.program import BULK, ONCE, Declined, Program, Rows, Segment, Step
from infer.model.runner import Runner
from tiny_models import make_model

L = 6


def test_steps_follow_the_range_the_cut_and_the_plan():
    plan = LayerPlan(8, frozenset({1, 4}), frozenset({4, 5}))
    p = Program(1, 7, 3, plan)
    # layer 1 skips its attention only under the plan, which starts at 3; layer 4 skips both sublayers: no step
    assert p.steps == (Step(1, True, True), Step(2, True, True), Step(3, True, True), Step(5, True, False),
                       Step(6, True, True))
    assert p.attention_layers == (1, 2, 3, 5, 6) and p.layers_run == (1, 2, 3, 5, 6)
    assert p.walk == (Step(1, True, True), Step(2, True, True), 3, Step(3, True, True), Step(5, True, False),
                      Step(6, True, True))
    assert Program(0, 8, plan=plan).exact_until == 1  # the plan's exact prefix
    assert Program(2, 8, plan=plan).exact_until == 2  # ... within the range
    assert Program(0, 1, plan=plan).exact_until == 1 and Program(0, 1, plan=plan).plan is None  # nothing planned
    assert Program(0, 8).exact_until == 8 and Program(0, 8).walk[-1] == 8  # the stream after the last layer
    assert Program(0, 8, observe=(5, 2, 5)).observe == (2, 5) and Program(0, 8, observe=(5, 2)).cuts == (2, 5, 8)
    assert Program(0, 8, vocab="head").vocab is None  # no head asked: no draft head
    everything = LayerPlan(8, frozenset(range(8)), frozenset(range(8)))
    assert Program(0, 8, 0, everything).steps == () and Program(0, 8, 0, everything).walk == (0,)


def test_programs_out_of_range_are_refused():
    with pytest.raises(ValueError, match="start <= exact_until <= end"):
        Program(3, 2)
    with pytest.raises(ValueError, match="start <= exact_until <= end"):
        Program(0, 4, 5)
    with pytest.raises(ValueError, match=r"observed layers \[5\] outside"):
        Program(0, 4, observe=(5,))
    with pytest.raises(ValueError, match="unknown rows kind"):
        Rows(torch.zeros(1, 4), [], "prefill")


def _runners() -> dict[str, Runner]:
    """The same weights on each executor: the layer loop, the fused span (where the kernel runs it), static shapes."""
    model = make_model("llama", seed=3, layers=L)
    eager = Runner.from_model(model)
    loop = copy.copy(eager)
    loop.fused = None
    out = {"eager": loop, "static": Runner.from_model(model, executor="static")}
    if eager.fused is not None:
        out["fused"] = eager
    return out


def _prefilled(runner: Runner, n: int = 12):
    cache = runner.new_cache(64)
    runner.forward(cache, torch.arange(3, 3 + n))
    return cache


@pytest.mark.parametrize("executor", ["eager", "fused", "static"])
def test_observed_streams_equal_forwards_cut_there(executor):
    """One program observing layers 2 and 4 (under a plan from layer 3, a tree mask) returns, bitwise, the streams
    three forwards cut at those layers give, and leaves the same cache rows, lengths and counters."""
    runner = _runners().get(executor)
    if runner is None:
        pytest.skip("no fused span here (the kernel's AVX-512 path runs it)")
    plan = LayerPlan(L, frozenset({4}), frozenset({3}))
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    hidden = runner.embed(torch.tensor([7, 8, 9]))  # (3, d)
    results, caches = [], []  # the caches live on: the static forwards are kept per cache
    for cuts in ([(0, 6)], [(0, 2), (2, 4), (4, 6)]):
        cache = _prefilled(runner)
        caches.append(cache)
        runner.counters.reset()
        x, kept = hidden, {}
        for a, b in cuts:
            kept[a] = x
            program = Program(a, b, max(a, min(3, b)), plan, observe=(2, 4) if len(cuts) == 1 else ())
            out = runner.run(program, Rows.one(cache, x, [12, 13, 13], tree))
            kept |= out.observed
            x = out.hidden
        n = cache.lengths  # (slots past a layer's length are free: a static forward's padded rows write there)
        rows = [cache.k[i, :, :n[i]] for i in range(L)] + [cache.v[i, :, :n[i]] for i in range(L)]
        results.append((kept[2], kept[4], x, *rows, list(n), list(runner.counters.layer_tokens)))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    if executor == "static":
        assert {s.key.observe for s in runner.static.spans()} == {(2, 4), ()}  # the static forwards ran them


def test_the_exact_stream_is_the_one_at_exact_until():
    runner = _runners()["eager"]
    plan = LayerPlan(L, frozenset({3}), frozenset())
    cache = _prefilled(runner)
    hidden = runner.embed(torch.tensor([5]))
    out = runner.run(Program(0, L, 3, plan, observe=(3,)), Rows.one(cache, hidden, [12]))
    assert torch.equal(out.exact, out.observed[3])
    cache.rollback(12)
    assert torch.equal(runner.run(Program(0, 3), Rows.one(cache, hidden, [12])).hidden, out.exact)


def test_the_static_executor_declines_what_it_does_not_run():
    runner = Runner.from_model(make_model("llama", seed=3, layers=L), executor="static")
    static, every = runner.static, Program(0, L)
    caches = [_prefilled(runner), _prefilled(runner)]
    two = runner.embed(torch.tensor([5, 6]))
    cases = {
        "static: several sequences": Rows(two, [Segment(caches[0], [12]), Segment(caches[1], [12])]),
        "static: not a decoding step": Rows.one(caches[0], two, [12, 13], kind=ONCE),
        "static: more rows than": Rows.one(caches[0], runner.embed(torch.arange(40)), list(range(12, 52))),
        "static: a mask narrower": Rows.one(caches[0], two, [12, 13], torch.ones(2, 1, dtype=torch.bool)),
    }
    for reason, rows in cases.items():
        out = static.run(every, rows)
        assert isinstance(out, Declined) and out.reason.startswith(reason), (reason, out)
    assert static.builds == 0
    lengths = list(caches[0].lengths)
    runner.run(every, cases["static: several sequences"])  # the layer loop runs it
    assert caches[0].lengths == [n + 1 for n in lengths] and caches[1].lengths == caches[0].lengths
    assert runner.declines["static: several sequences (their shapes vary with the batch)"] == 1


def test_a_fused_runner_declines_bulk_prefill_to_the_loop_and_runs_several_sequences():
    module = kernels.load()
    if module is None or module.path() != "avx512":
        pytest.skip("the fused span runs on the kernel's AVX-512 path only")
    runner = Runner.from_model(make_model("llama", seed=3, layers=L))
    assert runner.fused is not None and [e.name for e in runner.executors] == ["fused", "eager"]
    caches = [runner.new_cache(32), _prefilled(runner), _prefilled(runner)]
    runner.declines.clear()  # (the prefills above: causal rows from an empty layer)
    runner.run(Program(0, L), Rows.one(caches[0], runner.embed(torch.arange(4)), torch.arange(4), kind=BULK))
    one = runner.embed(torch.tensor([5, 6]))
    runs = runner.fused.packed
    runner.run(Program(0, L), Rows(one, [Segment(caches[1], [12]), Segment(caches[2], [12])]))
    assert set(runner.declines) == {"fused: a prompt prefill on BLAS"} and runner.fused.packed == runs + 1
    assert caches[0].lengths == [4] * L and caches[1].lengths == caches[2].lengths == [13] * L


def test_a_broken_executor_is_dropped_with_one_warning():
    """An executor that cannot run anything any more (a failed CUDA graph capture) is warned about once and dropped;
    the forward runs on the next one."""
    runner = Runner.from_model(make_model("llama", seed=3, layers=L))

    class Broken:
        name = "graphs"

        def run(self, program, rows):
            return Declined("graphs: capture failed (no stream)", broken=True)

    cache = _prefilled(runner)
    runner.static = Broken()
    with pytest.warns(RuntimeWarning, match="capture failed"):
        runner.run(Program(0, L, logits=True), Rows.one(cache, runner.embed(torch.tensor([5])), [12]))
    assert runner.static is None and runner.executor == "eager"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner.run(Program(0, L, logits=True), Rows.one(cache, runner.embed(torch.tensor([6])), [13]))


def test_lengths_and_counters_advance_once_per_run():
    """Whichever executor runs a program, each segment's layers whose attention ran grow by its rows, and each layer
    that ran counts every row (a layer skipped entirely counts nothing), the head counting when asked."""
    plan = LayerPlan(L, frozenset({2, 4}), frozenset({4}))
    program = Program(0, L, 1, plan, logits=True)
    for name, runner in _runners().items():
        caches = [_prefilled(runner, 10), _prefilled(runner, 12)]
        runner.counters.reset()
        runner.run(program, Rows.one(caches[0], runner.embed(torch.tensor([5, 6])), [10, 11]))  # any executor
        assert caches[0].lengths == [12, 12, 10, 12, 10, 12], name
        assert runner.counters.layer_tokens == [2, 2, 2, 2, 0, 2] and runner.counters.lm_head_tokens == 2, name
        rows = Rows(runner.embed(torch.tensor([5, 6])), [Segment(caches[0], [12]), Segment(caches[1], [12])])
        runner.run(program, rows)  # several sequences: the fused executor where there is one, else the loop
        assert caches[0].lengths == [13, 13, 10, 13, 10, 13] and caches[1].lengths == [13, 13, 12, 13, 12, 13], name
        assert runner.counters.layer_tokens == [4, 4, 4, 4, 0, 4] and runner.counters.lm_head_tokens == 4, name
        assert not any(r.startswith("eager") for r in runner.declines)


def test_a_static_stream_kept_at_the_start_is_not_overwritten_by_the_next_call():
    """A program whose exact prefix is empty (a plan skipping layer 0's attention) keeps the stream entering its first
    layer: on the static executor that is the forward's own input buffer, which the next call of the same shape
    fills again; what a call returned must not change afterwards."""
    runner = _runners()["static"]
    plan = LayerPlan(L, frozenset({0}), frozenset())
    program = Program(0, L, plan=plan, logits=True)
    assert program.exact_until == 0
    cache = _prefilled(runner)
    first = runner.run(program, Rows.one(cache, runner.embed(torch.tensor([5])), [12]))
    kept = first.exact.clone()
    cache.rollback(12)
    runner.run(program, Rows.one(cache, runner.embed(torch.tensor([9])), [12]))
    assert {s.key.plan for s in runner.static.spans()} != {None}  # the static executor ran it
    assert torch.equal(first.exact, kept)
