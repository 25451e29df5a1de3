"""Issue 67 item 11: damaged model weights or a config that does not fit them are refused in one line naming the file
and the field (they decoded garbage with exit code 0, ran a truncated model, or ended in a traceback or an error
blamed on the tokenizer); the weights' scan is paid once per folder stamp."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer import hf_generate, load_model
from infer.model import checks
from infer.model.runner import Runner
from layerskip_cli.main import main
from layerskip_core.errors import UserError
from tiny_models import family_model, make_model, save_tiny


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny") / "model")  # llama, 4 layers, 4 heads of 16, 2 KV heads


def variant(base: Path, where: Path, config=None, weights=None) -> Path:
    """A copy of ``base`` with its config.json changed by ``config(dict)`` and its weights by ``weights(state)``."""
    shutil.copytree(base, where)
    if config is not None:
        values = json.loads((where / "config.json").read_text())
        config(values)
        (where / "config.json").write_text(json.dumps(values))
    if weights is not None:
        state = load_file(where / "model.safetensors")
        weights(state)
        save_file(state, where / "model.safetensors", metadata={"format": "pt"})
    return where


def poke(value: float):
    def change(state):
        state["model.layers.1.self_attn.k_proj.weight"][0, 3] = value
    return change


CASES = {
    "no model_type": (lambda c: c.pop("model_type"), None, "config.json has no model_type"),
    "a string layer count": (lambda c: c.update(num_hidden_layers="4"), None,
                             "config.json: num_hidden_layers must be a positive integer, got '4'"),
    "rms_norm_eps 'abc'": (lambda c: c.update(rms_norm_eps="abc"), None,
                           "config.json: rms_norm_eps must be a number above 0, got 'abc'"),
    "zero heads": (lambda c: c.update(num_attention_heads=0), None,
                   "config.json: num_attention_heads must be a positive integer, got 0"),
    "heads not a multiple of the KV heads": (lambda c: c.update(num_key_value_heads=3), None,
                                             "must be a multiple of num_key_value_heads (3)"),
    "fewer layers than the weights": (lambda c: c.update(num_hidden_layers=2), None,
                                      "model.safetensors holds layers up to 3"),
    "more layers than the weights": (lambda c: c.update(num_hidden_layers=6), None,
                                     "have no tensor 'layers.4.input_layernorm.weight'"),
    "KV heads that do not fit the weights": (lambda c: c.update(num_key_value_heads=4), None,
                                             "tensor 'layers.0.self_attn.k_proj.weight' is (32, 64)"),
    "a hidden size that does not fit": (lambda c: c.update(intermediate_size=96), None,
                                        "'layers.0.mlp.gate_proj.weight' is (128, 64)"),
    "Mistral's sliding_window -4": (lambda c: c.update(model_type="mistral", architectures=["MistralForCausalLM"],
                                                       sliding_window=-4), None,
                                    "config.json: sliding_window must be a positive integer"),
    "layer_types of another length": (lambda c: c.update(layer_types=["full_attention"] * 3), None,
                                      "config.json: layer_types must list"),
    "a NaN in a projection": (None, poke(float("nan")),
                              "model.safetensors: tensor 'layers.1.self_attn.k_proj.weight' holds NaN or infinite"),
    "an infinity in a projection": (None, poke(float("-inf")), "holds NaN or infinite values"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_damaged_config_or_weights_is_one_line_naming_the_file_and_field(base, tmp_path, capsys, case):
    config, weights, says = CASES[case]
    folder = variant(base, tmp_path / "m", config, weights)
    code = main(["generate", "--model", str(folder), "--prompt", "hi", "--max-new-tokens", "2", "--threads", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and says in err[0] and str(folder) in err[0], err
    assert "tokenizer" not in err[0] and "Traceback" not in err[0]
    with pytest.raises(UserError, match="config.json|model.safetensors"):  # the Python API and the runner alike
        Runner.from_pretrained(folder)


def test_the_scan_of_a_folder_is_paid_once_per_stamp(base, tmp_path, monkeypatch):
    """A clean scan is recorded under the cache, keyed by the folder's stamp: the next load skips it; changed weights
    (another mtime) or another config scan again, and a NaN written since is found."""
    monkeypatch.setenv("LAYERSKIP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(checks, "RECORD_MIN_BYTES", 0)
    scans = []
    real = checks.nonfinite_tensor
    monkeypatch.setattr(checks, "nonfinite_tensor", lambda state: scans.append(1) or real(state))
    folder = variant(base, tmp_path / "m")
    Runner.from_pretrained(folder, kernel="torch")  # the kernel would be built again under this cache
    Runner.from_pretrained(folder, kernel="torch")
    assert len(scans) == 1 and len(list((tmp_path / "cache" / "checked-weights").glob("*.json"))) == 1
    state = load_file(folder / "model.safetensors")
    poke(float("nan"))(state)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="holds NaN"):
        Runner.from_pretrained(folder, kernel="torch")
    assert len(scans) == 2


def test_the_default_model_loads_and_skips_its_scan_the_second_time(default_model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERSKIP_CACHE", str(tmp_path / "cache"))
    scans = []
    real = checks.nonfinite_tensor
    monkeypatch.setattr(checks, "nonfinite_tensor", lambda state: scans.append(1) or real(state))
    for _ in range(2):
        Runner.from_pretrained(default_model_path, kernel="torch")
    assert len(scans) == 1


def _nan_model(kind: str = "llama"):
    model = make_model(kind, seed=3) if kind == "llama" else family_model(kind, layers=2)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[1, 2] = float("nan")
    return model


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
def test_a_model_object_with_a_nan_weight_is_refused_by_the_api_and_hf_generate(kind):
    """load_model(model_object) and hf_generate built their runner on a NaN weight without a word."""
    from tiny_models import byte_tokenizer

    model = _nan_model(kind)
    with pytest.raises(UserError, match=r"tensor 'layers\.0\.mlp\.down_proj\.weight' holds NaN"):
        load_model(model, byte_tokenizer(), device="cpu")
    with pytest.raises(UserError, match="holds NaN"):
        model.generate(torch.tensor([[5, 6, 7]]), custom_generate=hf_generate("early_exit", exit_layer=1),
                       max_new_tokens=4)


def test_the_scan_finds_what_a_sum_hides_and_passes_what_overflows():
    """A sum is non-finite for any NaN or infinity; a sum that overflows on finite values is not a refusal."""
    big = {"a": torch.full((4,), 3e38), "b": torch.zeros(3, dtype=torch.bfloat16)}
    assert checks.nonfinite_tensor(big) is None
    half = {"w": torch.full((1000,), 60000.0, dtype=torch.float16)}  # its fp16 sum would overflow
    assert checks.nonfinite_tensor(half) is None
    half["w"][7] = float("inf")
    assert checks.nonfinite_tensor(half | {"x": torch.ones(2)}) == "w"
    assert checks.nonfinite_tensor({"ids": torch.arange(3)}) is None  # integer tensors are not scanned


def _bin_folder(base: Path, where: Path, layers: int | None = None, nan: bool = False) -> Path:
    """``base`` as a ``.bin`` checkpoint (torch.save of its state dict), its config cut to ``layers``."""
    folder = variant(base, where, None if layers is None else (lambda c: c.update(num_hidden_layers=layers)))
    state = load_file(folder / "model.safetensors")
    if nan:
        poke(float("nan"))(state)
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    return folder


def test_a_bin_checkpoint_is_checked_as_safetensors_are(base, tmp_path):
    assert Runner.from_pretrained(_bin_folder(base, tmp_path / "ok"), kernel="torch").spec.num_layers == 4
    with pytest.raises(UserError, match=r"bin weights do not fit its config.json \(unexpected keys: model\.layers\.2"):
        Runner.from_pretrained(_bin_folder(base, tmp_path / "cut", layers=2), kernel="torch")
    with pytest.raises(UserError, match="'layers.1.self_attn.k_proj.weight' holds NaN"):
        Runner.from_pretrained(_bin_folder(base, tmp_path / "nan", nan=True), kernel="torch")


def test_training_refuses_a_config_that_does_not_fit_its_weights(base, tmp_path):
    """Training loaded through transformers, which drops the layers beyond the config's (and would train the cut
    model) or stops on a shape with its own RuntimeError; both are one line naming the folder."""
    from train.model import load_model as load_for_training

    assert load_for_training(str(base))[0].config.num_hidden_layers == 4
    cut = variant(base, tmp_path / "cut", lambda c: c.update(num_hidden_layers=2))
    with pytest.raises(UserError, match=r"weights do not fit its config.json \(unexpected keys: model\.layers\.2"):
        load_for_training(str(cut))
    wide = variant(base, tmp_path / "wide", lambda c: c.update(num_key_value_heads=4))
    with pytest.raises(UserError, match="weights do not fit its config.json"):
        load_for_training(str(wide))
