"""Shared fixtures: tiny seeded fp32 models (fast, exact) and the real default model when fetched."""

from __future__ import annotations

import os

import pytest
import torch

from infer.drafters import costs, gate
from infer.measure import quality
from layerskip_core import draft_vocab
from layerskip_core.models import default_model_dir, is_model_dir
from tiny_models import make_model, save_tiny


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def _session_cache(tmp_path_factory):
    """A toolkit cache shared by the session's tests for what is measured or built once per model and machine (the
    drafters' measured costs, draft vocabularies built from a model's generations), never the user's."""
    return tmp_path_factory.mktemp("session-toolkit-cache")


@pytest.fixture(autouse=True)
def _private_gate_memory(tmp_path, monkeypatch, _session_cache):
    """Each test starts with no remembered fallback-gate state or verifier quality and never writes the user's
    cache; measured costs and built draft vocabularies are kept for the session."""
    monkeypatch.setattr(gate, "cache_root", lambda: tmp_path / "toolkit-cache")
    monkeypatch.setattr(quality, "cache_root", lambda: tmp_path / "toolkit-cache")
    monkeypatch.setattr(costs, "cache_root", lambda: _session_cache)
    monkeypatch.setattr(draft_vocab, "cache_root", lambda: _session_cache)


@pytest.fixture(scope="session")
def tiny_llama():
    return make_model("llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2():
    return make_model("qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Llama + byte tokenizer saved as a HF folder (for CLI and training tests)."""
    return save_tiny(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_model_path():
    """The real SmolLM2 folder; skipped when it has not been fetched (CI fetches it)."""
    path = default_model_dir()
    if not is_model_dir(path):
        if os.environ.get("LAYERSKIP_REQUIRE_REAL_MODEL"):
            pytest.fail(f"default model missing at {path}; run `layerskip fetch-model`")
        pytest.skip("default model not fetched (run `layerskip fetch-model`)")
    return path
