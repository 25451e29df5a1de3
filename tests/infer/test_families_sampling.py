"""The sampling matrix (``test_sampling_matrix.py``: every drafter samples from the exact target distribution) on a
new family: a tiny Gemma 3 (sandwich norms, (1 + w) norms, GELU-tanh, q/k norms, softcapped logits, local layers with
a window shorter than the sampled sequences), 5 tokens, 4 layers."""

from __future__ import annotations

import pytest
from lossless_stats import batch_sampling_pvalue, sampling_pvalue
from test_sampling_matrix import NEW_TOKENS, PROMPT, SAMPLES, STEPS, T1, check, options

from infer.decode.batch import BatchEngine
from infer.decode.engine import Engine
from infer.drafters import build_drafter, drafter_spec
from infer.model.runner import Runner
from tiny_models import family_model, noisy_adapter


@pytest.fixture(scope="module")
def model():
    model = family_model("gemma3_text", seed=7, layers=4, window=4, vocab_size=5)
    assert 4 in Runner.from_model(model).spec.layer_windows  # prompt + sampled tokens run past the window
    return model


@pytest.fixture(scope="module")
def runner(model):
    return Runner.from_model(model)


@pytest.fixture(scope="module")
def adapter_file(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("adapter") / "a.safetensors"
    noisy_adapter(model, path, 1, noise=0.3)
    return str(path)


FAMILY_CASES = ["early_exit-vocab-stop", "early_exit-adapter-stop", "dynamic_exit-stops", "self_sd", "swift-tree"]
"""One case per drafter (each with the option that touches the family most: the draft head's softcapped logits, the
adapter's layer); the whole matrix (``test_sampling_matrix.CASES``) passed on this model too, in about three minutes."""


@pytest.mark.slow
@pytest.mark.parametrize("case", FAMILY_CASES)
def test_every_drafter_samples_the_target(case, model, runner, adapter_file):
    name, opts = options(case, runner, adapter_file)
    engine = Engine(runner, build_drafter(name, runner, opts))
    check(*sampling_pvalue(engine, model, PROMPT, T1, STEPS, SAMPLES, seed=11, new_tokens=NEW_TOKENS))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["swift-tree"])
def test_batched_rows_sample_the_target(case, model, runner, adapter_file):
    name, opts = options(case, runner, adapter_file)
    resolved = drafter_spec(name, opts).resolve(runner, None)
    with BatchEngine(runner, lambda: resolved.build(runner), batch_size=8) as batch:
        check(*batch_sampling_pvalue(batch, model, PROMPT, T1, STEPS, SAMPLES, seed=13, new_tokens=NEW_TOKENS))
