"""Typed validation at the Python API's entry: a wrong type is one UserError naming the argument, never a traceback
from deep inside or a silent coercion (issue 27)."""

import pytest
import torch

from infer import DecodeConfig, SamplingConfig, load_model
from infer.decode.engine import Engine
from infer.drafters import build_config
from infer.model.runner import Runner
from layerskip_core.errors import UserError
from tiny_models import make_model


@pytest.mark.parametrize("make,message", [
    (lambda: DecodeConfig(max_new_tokens="5"), "max_new_tokens must be int, got '5'"),
    (lambda: DecodeConfig(max_new_tokens=2.5), "max_new_tokens must be int, got 2.5"),
    (lambda: DecodeConfig(max_new_tokens=True), "max_new_tokens must be int, got True"),
    (lambda: DecodeConfig(target_exit=8.0), "target_exit must be int or null, got 8.0"),
    (lambda: DecodeConfig(sampling={"temperature": 0.7}), "sampling must be SamplingConfig"),
    (lambda: DecodeConfig(stop_strings="abc"), "stop_strings must be"),
    (lambda: SamplingConfig(temperature="0.7"), "temperature must be float, got '0.7'"),
    (lambda: SamplingConfig(temperature=float("nan")), "temperature must be a finite number, got nan"),
    (lambda: SamplingConfig(top_p=float("inf")), "top_p must be a finite number"),
    (lambda: SamplingConfig(top_k=2.5), "top_k must be int, got 2.5"),
    (lambda: SamplingConfig(seed=99999999999999999999999), "seed must be in [0, 2**64)"),
    (lambda: SamplingConfig(seed=-1), "seed must be in [0, 2**64)"),
    (lambda: build_config("early_exit", {"exit_layer": True}), "early_exit: exit_layer must be int, got True"),
    (lambda: build_config("early_exit", {"exit_layer": 8.5}), "early_exit: exit_layer must be int, got 8.5"),
    (lambda: build_config("early_exit", {"confidence": "0.5x"}), "confidence"),
    (lambda: build_config("swift", {"skip_ratio": float("nan")}), "swift: skip_ratio must be a finite number"),
    (lambda: build_config("swift", {"num_draft": 2.0}), "swift: num_draft must be int"),
    (lambda: build_config("self_sd", {"plan": 3}), "self_sd: plan must be"),
    (lambda: build_config("self_sd", {"plan": "p.json", "adapt_confidence": 1}), "adapt_confidence must be bool"),
])
def test_configs_refuse_wrong_types_naming_the_field(make, message):
    with pytest.raises(UserError) as e:
        make()
    assert message in str(e.value)


def test_well_typed_configs_still_build():
    assert DecodeConfig(max_new_tokens=5, stop_strings=("x",)).max_new_tokens == 5
    assert SamplingConfig(temperature=1, seed=2**64 - 1).temperature == 1  # an int is a number
    assert build_config("early_exit", {"exit_layer": 3, "E": None}).exit_layer == 3
    assert build_config("early_exit", {"exit_layer": "3"}).exit_layer == 3  # text is converted (the CLI's path)


@pytest.mark.parametrize("prompt,message", [
    ("text", "prompt_ids must be a list of token ids, not str"),
    (123, "prompt_ids must be a list of token ids, not int"),
    ([1, 2.5], "must hold integer token ids; got 2.5"),
    ([True, 2], "must hold integer token ids; got True"),
    (torch.tensor([1.0, 2.0]), "1-D integer tensor"),
    (torch.tensor([[1, 2]]), "1-D integer tensor"),
])
def test_engine_generate_refuses_what_is_not_token_ids(prompt, message):
    from infer.drafters import build_drafter

    runner = Runner.from_model(make_model("llama", seed=0))
    engine = Engine(runner, build_drafter("autoregressive", runner))
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace(".", r"\.")):
        engine.generate(prompt, DecodeConfig(max_new_tokens=2))
    with pytest.raises(UserError, match="config must be a DecodeConfig"):
        engine.generate([1, 2], {"max_new_tokens": 2})
    assert len(engine.generate(torch.tensor([1, 2]), DecodeConfig(max_new_tokens=2)).tokens) == 2


@pytest.fixture(scope="module")
def tiny_loaded(tiny_model_dir):
    return load_model(str(tiny_model_dir), threads=1)


@pytest.mark.parametrize("call,message", [
    (lambda m: m.generate(123), "prompt must be text (a str) or a non-empty list of texts, not int"),
    (lambda m: m.generate([]), "prompt must be text (a str) or a non-empty list of texts, not list"),
    (lambda m: m.generate(["a", 1]), "must be text"),
    (lambda m: m.generate("hi", {"max_new_tokens": 3}), "drafter must be a drafter name"),
    (lambda m: m.generate("hi", DecodeConfig(max_new_tokens=3)), "drafter must be a drafter name"),
    (lambda m: m.generate("hi", "autoregressive", "fast"), "config must be a DecodeConfig"),
    (lambda m: m.generate("hi", "autoregressive", {"max_new_tokens": 3}), "config must be a DecodeConfig"),
    (lambda m: m.generate("hi", "early_exit", exit_layer=True), "exit_layer must be int, got True"),
    (lambda m: m.generate("hi", "early_exit", exit_layer=8.5), "exit_layer must be int, got 8.5"),
])
def test_the_python_api_refuses_wrong_types_in_one_line(tiny_loaded, call, message):
    with pytest.raises(UserError) as e:
        call(tiny_loaded)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_real_model_refuses_wrong_types_too(default_model_path):
    model = load_model(str(default_model_path), threads=1)
    for call, message in [(lambda: model.generate(123), "prompt must be text"),
                          (lambda: model.engine("autoregressive").generate("text"), "prompt_ids must be a list"),
                          (lambda: model.generate("def f():", "early_exit", exit_layer=24.0), "must be int")]:
        with pytest.raises(UserError, match=message):
            call()
    out = model.generate("def f():", "early_exit", DecodeConfig(max_new_tokens=4), exit_layer=24)
    assert len(out.tokens) == 4
