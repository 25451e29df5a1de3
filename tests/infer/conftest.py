"""A seeded 6-layer model and its eager runner, for the executor tests (their cases: ``executor_cases``); a private
toolkit cache for tests whose drafters remember what they measured."""

import pytest
from executor_cases import SIX

from infer.model.runner import Runner
from tiny_models import make_model


@pytest.fixture(scope="module")
def model():
    return make_model("llama", seed=0, layers=SIX)


@pytest.fixture(scope="module")
def eager(model):
    return Runner.from_model(model, executor="eager")


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """The fallback gate's memory lives in the toolkit cache: keep each test's apart
    (``pytestmark = pytest.mark.usefixtures("private_cache")``)."""
    monkeypatch.setenv("LAYERSKIP_CACHE", str(tmp_path / "cache"))
