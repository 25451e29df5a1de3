"""Every registered drafter names its example options in its own file, and the registry gathers them: the one
source of the drafters that the tests running every drafter and the GPU check run."""

import pytest

from infer.drafters import DRAFTERS, ExampleModel, build_drafter, example_cases
from infer.drafters import registry as registry_module
from infer.drafters.early_exit import EarlyExitDrafter
from infer.model.runner import Runner
from tiny_models import make_model


def test_every_drafter_has_a_main_example_under_its_name():
    cases = example_cases(ExampleModel(6))
    main = example_cases(ExampleModel(6), main_only=True)
    assert list(main) == list(DRAFTERS) and all(main[name][0] == name for name in DRAFTERS)
    assert set(main) <= set(cases) and {name for name, _ in cases.values()} == set(DRAFTERS)
    assert all(case == name or case.startswith(f"{name}_") for case, (name, _) in cases.items())


def test_examples_follow_the_model():
    """The exit, the skip plan and the exit adapter come from the model the examples are for."""
    small, adapted = example_cases(ExampleModel(4, exit_layer=1)), example_cases(ExampleModel(6, adapter="a"))
    assert small["early_exit"][1]["exit_layer"] == 1 and small["self_sd"][1]["plan"].num_layers == 4
    assert "early_exit_adapter" not in small and adapted["early_exit_adapter"][1]["adapter"] == "a"
    small["early_exit"][1]["num_draft"] = 99  # a caller's change stays its own
    assert example_cases(ExampleModel(4, exit_layer=1))["early_exit"][1]["num_draft"] != 99


def test_every_example_builds_on_a_model_of_that_depth():
    runner = Runner.from_model(make_model("llama", seed=0, layers=6))
    for case, (name, options) in example_cases(ExampleModel(6)).items():
        assert build_drafter(name, runner, options).name == name, case


def test_a_drafter_without_examples_of_its_own_is_refused(monkeypatch):
    """A registered subclass that inherits its parent's examples would run the parent's options under its name."""
    class Quiet(EarlyExitDrafter):
        name = "quiet"

    monkeypatch.setattr(registry_module, "DRAFTERS", DRAFTERS | {"quiet": Quiet})
    with pytest.raises(TypeError, match="'quiet'.*no examples of its own"):
        example_cases(ExampleModel(6))
