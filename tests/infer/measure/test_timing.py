"""Step timing: a CPU run keeps the engine's own perf_counter split; the clock sums what it wraps."""

import torch

from infer.drafters import build_drafter
from infer.engine import DecodeConfig, Engine
from infer.measure.timing import StepClock, timed_generate
from infer.runner import Runner
from tiny_models import make_model


def test_step_clock_sums_each_wrapped_span_on_a_cpu():
    clock = StepClock(torch.device("cpu"))
    draft = clock.timed("draft", lambda: sum(range(1000)))
    step = clock.timed("step", lambda: draft())
    for _ in range(3):
        step()
    assert len(clock.spans["draft"]) == 3 and 0 < clock.seconds("draft") <= clock.seconds("step")
    assert clock.seconds("other") == 0


def test_timed_generate_on_a_cpu_is_the_engines_own_run():
    runner = Runner.from_model(make_model("llama", seed=0, layers=4))
    engine = Engine(runner, build_drafter("early_exit", runner, {"exit_layer": 2, "num_draft": 3}))
    gen = DecodeConfig(max_new_tokens=12, stop_at_eos=False)
    result, verified = timed_generate(engine, [5, 6, 7, 8, 9], gen)
    assert result.tokens == engine.generate([5, 6, 7, 8, 9], gen).tokens == verified  # lossless: it emits its argmax
    assert result.stats.draft_time > 0 and result.stats.verify_time > 0
    assert "propose" not in vars(engine.drafter) and "step" not in vars(engine)  # nothing left wrapped
