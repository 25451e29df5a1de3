"""Step timing: a CPU run keeps the engine's own perf_counter split; the clock observes cycles, patching nothing."""

import torch

from infer.decode.batch import BatchEngine
from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter
from infer.measure.timing import StepClock, observing, timed_batch, timed_generate
from infer.model.runner import Runner
from tiny_models import make_model


def test_step_clock_observes_every_cycle_of_an_engine_and_of_a_batch():
    runner = Runner.from_model(make_model("llama", seed=0, layers=4))
    engine = Engine(runner, build_drafter("early_exit", runner, {"exit_layer": 2, "num_draft": 3}))
    clock = StepClock(torch.device("cpu"))
    with observing(engine, clock):
        result = engine.generate([5, 6, 7], DecodeConfig(max_new_tokens=12, stop_at_eos=False))
    cycles = result.stats.verify_calls
    assert len(clock.spans["draft"]) == len(clock.spans["verify"]) == cycles > 0 and not engine.observers
    assert len(clock.outcomes[id(result.stats)]) == cycles and clock.seconds("verify") > 0
    assert clock.seconds("other") == 0
    with BatchEngine(runner, lambda: build_drafter("early_exit", runner, {"exit_layer": 2}), 2) as batch:
        results, verified, wall = timed_batch(batch, [[5, 6, 7], [8, 9], [10]], DecodeConfig(max_new_tokens=8))
    assert [len(v) for v in verified] == [len(r.tokens) for r in results] and wall > 0 and not batch.observers


def test_timed_generate_on_a_cpu_is_the_engines_own_run():
    runner = Runner.from_model(make_model("llama", seed=0, layers=4))
    engine = Engine(runner, build_drafter("early_exit", runner, {"exit_layer": 2, "num_draft": 3}))
    gen = DecodeConfig(max_new_tokens=12, stop_at_eos=False)
    result, verified = timed_generate(engine, [5, 6, 7, 8, 9], gen)
    assert result.tokens == engine.generate([5, 6, 7, 8, 9], gen).tokens == verified  # lossless: it emits its argmax
    assert result.stats.draft_time > 0 and result.stats.verify_time > 0
    assert "propose" not in vars(engine.drafter) and "step" not in vars(engine) and not engine.observers
