"""Damaged exit adapter files are one line naming the file, in decoding (ExitAdapter) and in evaluation
(eval_adapter's reader) alike, before anything is loaded; eval_adapter never writes NaN (issue 37)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deadline import deadline
from infer.assets.adapter import ExitAdapter
from infer.model.runner import Runner
from layerskip_core.errors import UserError
from tiny_models import make_model
from train.adapter import AdapterLM, adapter_eval
from train.config import AdapterConfig

L = 6


@pytest.fixture(scope="module")
def model():
    return make_model("llama", seed=0, layers=L)


@pytest.fixture(scope="module")
def good(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("adapter") / "good.safetensors"
    AdapterLM(model, AdapterConfig(enabled=True, exit_layer=2, mlp_size=8)).save(path, {"test": True})
    model.requires_grad_(True)
    return path


def contents(path):
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def rewrite(good, path, shape=None, tensors=None):
    meta, state = contents(good)
    if shape is not None:
        meta["shape"] = json.dumps(json.loads(meta["shape"]) | shape)
    save_file(tensors(state) if tensors else state, str(path), metadata=meta)


def nan_in(state):
    state["q_proj.weight"][0, 0] = float("nan")
    return state


def no_mlp_tensor(state):
    del state["down_proj.weight"]
    return state


def extra_tensor(state):
    return state | {"stray.weight": torch.zeros(3)}


def ints(state):
    return state | {"out_norm.weight": state["out_norm.weight"].to(torch.int32)}


DAMAGE = {
    "cut off": (lambda good, p: p.write_bytes(good.read_bytes()[:good.stat().st_size // 2]), "not a readable"),
    "empty": (lambda good, p: p.write_bytes(b""), "not a readable"),
    "header bytes corrupted": (lambda good, p: p.write_bytes(good.read_bytes()[:8] + b"\xff" * 40
                                                             + good.read_bytes()[48:]), "not a readable"),
    "a folder": (lambda good, p: p.mkdir(), "is a folder"),
    "a header that lies about the head layout": (
        lambda good, p: rewrite(good, p, shape={"num_heads": 8, "num_kv_heads": 4, "head_dim": 8}),
        "head layout is not the model's"),
    "NaN weights": (lambda good, p: rewrite(good, p, tensors=nan_in), "NaN or infinite"),
    "integer weights": (lambda good, p: rewrite(good, p, tensors=ints), "torch.int32 values"),
    "a tensor missing": (lambda good, p: rewrite(good, p, tensors=no_mlp_tensor), "disagrees with its tensors"),
    "a stray tensor": (lambda good, p: rewrite(good, p, tensors=extra_tensor), "disagrees with its tensors"),
    "header names no MLP": (lambda good, p: rewrite(good, p, shape={"mlp_size": 0}), "disagrees with its tensors"),
    "another exit past the model": (lambda good, p: rewrite(good, p, shape={"exit_layer": 9}), "1 <= E < 6"),
}


def load_for_decoding(model, path):
    return ExitAdapter.load(path, Runner.from_model(model))


def load_for_evaluation(model, path):
    return AdapterLM.from_file(model, path)


@pytest.mark.parametrize("reader", [load_for_decoding, load_for_evaluation], ids=["decoding", "evaluation"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_adapter_file_is_one_line_naming_it(model, good, tmp_path, reader, damage):
    make, message = DAMAGE[damage]
    path = tmp_path / "adapter.safetensors"
    make(good, path)
    with deadline(60), pytest.raises(UserError, match=message) as e:
        reader(model, path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("reader", [load_for_decoding, load_for_evaluation], ids=["decoding", "evaluation"])
def test_a_good_adapter_file_loads_in_both(model, good, reader):
    assert reader(model, good) is not None


def test_an_adapter_for_another_model_is_refused_in_both(good):
    other = make_model("llama", seed=1, layers=L)
    for reader in (load_for_decoding, load_for_evaluation):
        with pytest.raises(UserError, match="for another model"):
            reader(other, good)


def test_eval_adapter_refuses_a_nan_result_instead_of_writing_it(model, good, monkeypatch):
    monkeypatch.setattr(AdapterLM, "evaluate", lambda self, *a: torch.tensor([float("nan"), 1.0, 1.0, 1.0, 4.0]))
    with pytest.raises(UserError, match="not a finite number"):
        adapter_eval(model, good, [], 0)
    monkeypatch.setattr(AdapterLM, "evaluate", lambda self, *a: torch.zeros(5))
    with pytest.raises(UserError, match="no token to score"):
        adapter_eval(model, good, [], 0)
