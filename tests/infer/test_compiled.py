"""The compiled static forwards (torch.compile with inductor; on CPU here, as CI has a C++ compiler) equal the
eager path token for token for every drafter, compile a bounded number of graphs once, and launch fewer
operators per layer; the capture policy and the executor's public counters."""

import pytest
import torch
from executor_cases import SIX, drafter_cases, fake_capture, run_drafter

from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter
from infer.model.graphs import PLAN_CAPTURE_AFTER, StaticExecutor, StaticSpan
from infer.model.plan import LayerPlan
from infer.model.program import ONCE, Program, Rows
from infer.model.runner import Runner
from tiny_models import make_model
from tools.gpu.counts import kernels_per_layer

L = SIX
PROMPTS = [[5, 6, 7, 8, 9], [42] * 12 + [7, 8]]


@pytest.fixture(scope="module")
def compiled(model):
    return Runner.from_model(model, executor="static", compile=True)


def test_compiled_equals_eager_for_every_drafter(eager, compiled, tmp_path):
    assert compiled.static.compile and compiled.executor == "static"
    for prompt in PROMPTS:
        ref = run_drafter(eager, "autoregressive", {}, prompt, 20).tokens
        for name, options in drafter_cases(eager, tmp_path):
            a = run_drafter(eager, name, options, prompt, 20)
            b = run_drafter(compiled, name, options, prompt, 20)
            assert b.tokens == a.tokens == ref, (name, options, prompt)
    # one graph per sublayer kind, recompiled at most once per kind with dynamic sizes: not one per layer,
    # row bucket or cache length
    assert 0 < compiled.static.compiles <= 6
    before = compiled.static.counts()
    for prompt in PROMPTS:
        run_drafter(compiled, "early_exit", {"exit_layer": 2, "num_draft": 4}, prompt, 20)
    assert compiled.static.counts() == before  # warm: nothing is built, captured or compiled again


def test_compiled_forwards_launch_fewer_operators_per_layer(model, compiled):
    plain = Runner.from_model(model, executor="static", compile=False)
    fused, unfused = kernels_per_layer(compiled), kernels_per_layer(plain)
    assert 0 < fused < unfused / 2, (fused, unfused)


def test_every_compiled_runner_compiles_its_own_graphs(compiled):
    """Dynamo keeps graphs and a recompile limit per code object: runners sharing one would make later ones
    silently eager. Each executor compiles (and runs fused) on its own."""
    runners = [compiled] + [Runner.from_model(make_model("llama", seed=s, layers=2), executor="static", compile=True)
                            for s in (1, 2)]
    for runner in runners:
        before = runner.static.compiles
        fused = kernels_per_layer(runner)
        assert runner.static.compiles >= (1 if runner is not compiled else before), runner.static.counts()
        assert fused < kernels_per_layer(Runner.from_model(make_model("llama", seed=0, layers=2), executor="static"))


def test_compile_defaults_to_cuda_only(model):
    assert not Runner.from_model(model, executor="static").static.compile  # CPU: compiling does not pay here
    assert Runner.from_model(model, executor="eager").static is None


def test_plan_forwards_are_captured_only_after_a_few_uses(model, monkeypatch):
    """A forward without a plan is captured on its first use; a skip-plan forward (SWIFT drafting with a plan
    for a step or two) stays static until its PLAN_CAPTURE_AFTER-th use."""
    monkeypatch.setattr(StaticSpan, "capture", fake_capture)
    runner = Runner.from_model(model, executor="eager")
    runner.static = StaticExecutor(runner, capture=True)
    cache = runner.new_cache(256)
    ids = torch.arange(3, 13)
    runner.run(Program(0, L), Rows.one(cache, runner.embed(ids), torch.arange(10), kind=ONCE))
    one = runner.embed(ids[:1])
    plan = LayerPlan(L, frozenset({2}), frozenset({3}))
    captures = []
    for _ in range(PLAN_CAPTURE_AFTER + 1):
        runner.run(Program(0, L, logits=True), Rows.one(cache, one, [10]))  # no plan
        runner.run(Program(0, L, 1, plan, logits=True), Rows.one(cache, one, [10]))  # a plan's draft step
        cache.rollback(10)
        captures.append(runner.static.captures)
    assert captures == [1] * (PLAN_CAPTURE_AFTER - 1) + [2, 2]
    assert runner.static.counts() == {"builds": 2, "captures": 2, "compiles": 0}


def test_the_span_limit_drops_plan_forwards_first(model):
    runner = Runner.from_model(model, executor="static")
    runner.static.max_spans = 3
    cache = runner.new_cache(256)
    ids = torch.arange(3, 13)
    runner.run(Program(0, L), Rows.one(cache, runner.embed(ids), torch.arange(10), kind=ONCE))
    one, two = runner.embed(ids[:1]), runner.embed(ids[:2])
    runner.run(Program(0, L, logits=True), Rows.one(cache, one, [10]))  # plain draft/verify shapes: kept
    runner.run(Program(0, L, logits=True), Rows.one(cache, two, [10, 11]))
    cache.rollback(10)
    for skip in (2, 3, 4):  # three plans tried in turn
        runner.run(Program(0, L, 1, LayerPlan(L, frozenset({skip})), logits=True), Rows.one(cache, one, [10]))
        cache.rollback(10)
    keys = [s.key for s in runner.static.spans(cache)]
    assert [k.plan for k in keys] == [None, None, ((4,), ())] and runner.static.builds == 5


def test_swift_captures_at_most_one_forward_per_plan_change_in_timed_runs(monkeypatch):
    """After a warm-up, fresh SWIFT drafters (as bench repeats make) capture only the drafting forward of a plan
    first used in the timed run: one per plan, and nothing else."""
    monkeypatch.setattr(StaticSpan, "capture", fake_capture)
    runner = Runner.from_model(make_model("llama", seed=0, layers=8), executor="eager")
    runner.static = StaticExecutor(runner, capture=True)
    prompts = [[5, 6, 7, 8, 9] * 3, [(7 * i) % 300 + 3 for i in range(40)]]
    options = {"context_window": 8, "opt_budget": 0.95, "fallback_opt_budget": 0.95}
    config = DecodeConfig(max_new_tokens=32, stop_at_eos=False)
    Engine(runner, build_drafter("swift", runner, options)).warm_up(prompts, config)
    warm = {id(s) for s in runner.static.spans() if s.graph is not None}
    captures = runner.static.captures
    engine = Engine(runner, build_drafter("swift", runner, options))
    for prompt in prompts:
        engine.generate(prompt, config)
    timed = [s.key for s in runner.static.spans() if s.graph is not None and id(s) not in warm]
    assert runner.static.captures - captures == len(timed)
    assert all(k.plan is not None for k in timed) and len({k.plan for k in timed}) == len(timed)


def test_runners_sharing_a_step_cache_compile_each_step_once():
    """Rows (1..k+1) and cache capacity (256, 512) are dynamic from the first compile, the engine runs in one grad
    mode whatever its caller's, and a second runner of the same geometry reuses the first's graphs: two graphs in
    all (the cheap 'eager' backend counts them in seconds)."""
    from infer.model.compiled import StepCache

    steps = StepCache("eager")
    config = DecodeConfig(max_new_tokens=12, stop_at_eos=False)
    for seed in (0, 1):
        runner = Runner.from_model(make_model("llama", seed=seed, layers=4), executor="static", compile=steps)
        for name, options in (("autoregressive", {}), ("early_exit", {"exit_layer": 2, "num_draft": 3})):
            engine = Engine(runner, build_drafter(name, runner, options))
            engine.generate([5, 6, 7], config)  # a 256-slot cache
            engine.generate([9] * 230, config)  # a 512-slot one
    assert list(steps.counts().values()) == [2] and steps.compiles == 2
