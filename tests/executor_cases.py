"""What the executor tests (static, compiled) share: the layer count of their seeded model, and the drafter cases
every executor must decode exactly as the eager path does."""

from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import ExampleModel, build_drafter, example_cases
from infer.model.plan import LayerPlan, PlanFile

SIX = 6
"""Layers of the executor tests' model."""


def plan_path(runner, tmp_path, name: str, plan: LayerPlan) -> str:
    path = tmp_path / f"{name}.json"
    PlanFile(plan, runner.identity(), task="test").save(path)
    return str(path)


def drafter_cases(runner, tmp_path, *extra: tuple[str, dict]) -> list[tuple[str, dict]]:
    """Every registered drafter's examples with a skip plan over layers 2-4 (a plan file), early exit also at exit 5
    with a confidence stop, and ``extra``."""
    plan = plan_path(runner, tmp_path, "plan", LayerPlan(SIX, frozenset({2, 4}), frozenset({3})))
    return [*example_cases(ExampleModel(SIX, plan=plan)).values(),
            ("early_exit", {"exit_layer": 5, "num_draft": 3, "confidence": 0.3}), *extra]


def run_drafter(runner, name: str, options: dict, prompt: list[int], n: int):
    engine = Engine(runner, build_drafter(name, runner, options))
    return engine.generate(prompt, DecodeConfig(max_new_tokens=n))


def fake_capture(self, cache, steps, pool=None):
    """Stands in for CUDA-graph capture on CPU: replay recomputes into the same output buffers."""
    self.outputs = self.compute(cache, steps)
    span = self

    class Replay:
        def replay(self):
            for buf, value in zip(span.outputs, span.compute(cache, steps), strict=True):
                if buf is not None:
                    buf.copy_(value)

    self.graph = Replay()
