"""Fixtures for the training tests: real text (standard-library source) and tiny training configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from accel_state import fresh_state
from train.data import stdlib_dir
from train.recipe import load_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh_accelerate_state():
    """Reset accelerate's singletons around a test that runs training in this process."""
    fresh_state()
    yield
    fresh_state()


@pytest.fixture(autouse=True)
def _no_tracking(monkeypatch):
    """wandb never reaches the network from a test (tests that want offline mode set it themselves)."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_SILENT", "true")


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory) -> Path:
    """24 small real text files: slices of the standard-library sources of this interpreter."""
    root = tmp_path_factory.mktemp("text")
    files = sorted(p for p in stdlib_dir().glob("*.py") if p.stat().st_size > 3000)[:24]
    for i, src in enumerate(files):
        text = src.read_text(encoding="utf-8", errors="replace")[:2500]
        sub = root / ("pkg" if i % 3 == 0 else "")
        sub.mkdir(exist_ok=True)
        (sub / src.name).write_text(text, encoding="utf-8")
    return root


@pytest.fixture
def tiny_recipe(tmp_path, tiny_model_dir, text_dir):
    """Build a TrainConfig for a tiny 4-layer model on ``text_dir``; keyword overrides are dotted keys."""

    def make(*overrides: str, output: str = "run"):
        base = [
            f"model.name_or_path={tiny_model_dir}",
            f"data.sources=[{{type: files, path: '{text_dir}'}}]",
            "data.block_size=32", "data.val_fraction=0.2", "data.max_val_examples=8",
            f"data.cache_dir={tmp_path / 'tokens'}",
            "optim.max_steps=6", "optim.micro_batch_size=2", "optim.grad_accum_steps=2", "optim.lr=3e-3",
            "optim.warmup_steps=1",
            "logging.log_every=1", "logging.eval_every=0", "logging.progress=false",
            f"checkpoint.output_dir={tmp_path / output}", "checkpoint.save_every=0",
            "threads=1",
        ]
        return load_config(None, base + list(overrides))

    return make


def pytest_configure(config):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
