"""Sliding attention windows (honoured per layer: decoding runs past the window with the model's output) and models the
runner cannot decode as they are: weights that are not all loaded on one device (meta, offloaded or sharded by a
``device_map``: one clear error before anything is copied or decoded)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from infer import hf_generate, load_model
from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter
from infer.model.runner import Runner
from layerskip_core.errors import UserError
from tiny_models import byte_tokenizer, make_model

WINDOW = 8
PROMPT = [5, 17, 99, 3]


def tiny_mistral(window: int | None = WINDOW) -> MistralForCausalLM:
    config = MistralConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           sliding_window=window, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # peaked logits, as the other tiny models'
            if p.dim() == 2:
                p.mul_(4.0)
    return model


def test_a_sliding_window_decides_outputs_past_it():
    """Why windows matter: past the window, the model's own logits are not full attention's."""
    ids = torch.randint(0, 320, (3 * WINDOW,), generator=torch.Generator().manual_seed(0))
    slides, full = tiny_mistral(), tiny_mistral(window=None)
    with torch.no_grad():
        a, b = slides(ids[None]).logits[0], full(ids[None]).logits[0]  # same weights (same seed)
    torch.testing.assert_close(a[:WINDOW], b[:WINDOW])
    assert not torch.allclose(a[WINDOW:], b[WINDOW:], atol=1e-3)


def test_a_mistral_window_is_honoured_past_it_without_a_cap(capfd):
    """Issue 47: the runner attends over each layer's window, so decoding runs past it with transformers' output
    (tests/infer/test_families*.py cover every family and drafter); nothing is said at load, nothing capped."""
    model = tiny_mistral()
    runner = Runner.from_model(model)
    assert capfd.readouterr().err.strip() == ""
    assert runner.spec.sliding_window is None and runner.spec.max_position_embeddings == 512
    new = 4 * WINDOW
    ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=new, do_sample=False)[0, len(PROMPT):].tolist()
    for name, options in [("autoregressive", {}), ("early_exit", {"exit_layer": 1, "num_draft": 3})]:
        engine = Engine(runner, build_drafter(name, runner, options))
        assert engine.generate(PROMPT, DecodeConfig(max_new_tokens=new, stop_at_eos=False)).tokens == ref, name
    out = model.generate(torch.tensor([PROMPT]), custom_generate=hf_generate(), max_new_tokens=new)
    assert out[0, len(PROMPT):].tolist() == ref


def test_which_configs_slide():
    windows = lambda model: Runner.from_model(model).spec.layer_windows  # noqa: E731
    assert windows(make_model("llama", layers=2)) == (None, None)
    assert windows(make_model("qwen2", layers=2, sliding_window=WINDOW)) == (None, None)  # no use_sliding_window
    qwen = make_model("qwen2", layers=2, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    assert windows(qwen) == (None, WINDOW)  # its layer 1 slides
    assert windows(tiny_mistral()) == (WINDOW,) * 3  # Mistral: every layer


def test_a_model_on_the_meta_device_is_refused_before_decoding():
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    with pytest.raises(UserError, match="weights are not loaded .*meta device.*load it whole on one device"):
        Runner.from_model(model)
    with pytest.raises(UserError, match="meta device"):
        load_model(model, byte_tokenizer(), device="cpu")
    with pytest.raises(UserError, match="meta device"):
        hf_generate("early_exit", exit_layer=1)(model, torch.tensor([PROMPT]))


def test_a_model_spread_by_a_device_map_is_refused():
    model = make_model("llama", layers=2)
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "lm_head": 1}
    with pytest.raises(UserError, match=r"spread over several devices \(0, 1\)"):
        Runner.from_model(model)
    model.hf_device_map = {"model": "cpu", "lm_head": "disk"}
    with pytest.raises(UserError, match="not loaded"):
        Runner.from_model(model)
    model.hf_device_map = {"": "cpu"}
    assert Runner.from_model(model).device == torch.device("cpu")
