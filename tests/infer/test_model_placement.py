"""Models the runner cannot decode as they are: a sliding attention window (decoding capped at the window, where the
runner's full attention is the model's, and said in one line at load) and weights that are not all loaded on one
device (meta, offloaded or sharded by a ``device_map``: one clear error before anything is copied or decoded)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from infer import hf_generate, load_model
from infer.drafters import build_drafter
from infer.engine import DecodeConfig, Engine
from infer.runner import Runner
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
    """Why the cap: past the window, the model's own logits are not full attention's (the runner's)."""
    ids = torch.randint(0, 320, (3 * WINDOW,), generator=torch.Generator().manual_seed(0))
    slides, full = tiny_mistral(), tiny_mistral(window=None)
    with torch.no_grad():
        a, b = slides(ids[None]).logits[0], full(ids[None]).logits[0]  # same weights (same seed)
    torch.testing.assert_close(a[:WINDOW], b[:WINDOW])
    assert not torch.allclose(a[WINDOW:], b[WINDOW:], atol=1e-3)


def test_a_mistral_window_caps_decoding_with_one_line_at_load(capfd):
    model = tiny_mistral()
    runner = Runner.from_model(model)
    note = capfd.readouterr().err.strip().splitlines()
    assert len(note) == 1 and f"sliding window of {WINDOW} tokens" in note[0] and "capped" in note[0]
    assert (runner.spec.sliding_window, runner.spec.max_position_embeddings) == (WINDOW, WINDOW)
    new = WINDOW - len(PROMPT)
    ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=new, do_sample=False)[0, len(PROMPT):].tolist()
    for name, options in [("autoregressive", {}), ("early_exit", {"exit_layer": 1, "num_draft": 3})]:
        engine = Engine(runner, build_drafter(name, runner, options))
        assert engine.generate(PROMPT, DecodeConfig(max_new_tokens=new, stop_at_eos=False)).tokens == ref, name
        with pytest.raises(UserError, match=f"exceeds the model's sliding window of {WINDOW} tokens"):
            engine.generate(PROMPT, DecodeConfig(max_new_tokens=new + 1))
    out = model.generate(torch.tensor([PROMPT]), custom_generate=hf_generate(), max_new_tokens=new)
    assert out[0, len(PROMPT):].tolist() == ref
    with pytest.raises(UserError, match="sliding window"):
        model.generate(torch.tensor([PROMPT]), custom_generate=hf_generate(), max_new_tokens=new + 1)


def test_which_configs_slide():
    assert Runner.from_model(make_model("llama", layers=2)).spec.sliding_window is None
    assert Runner.from_model(make_model("qwen2", layers=2, sliding_window=WINDOW)).spec.sliding_window is None
    qwen = make_model("qwen2", layers=2, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    assert Runner.from_model(qwen).spec.max_position_embeddings == WINDOW  # its layer 1 slides
    wide = tiny_mistral(window=4096)  # wider than the context: nothing slides
    assert Runner.from_model(wide).spec.max_position_embeddings == 512


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
