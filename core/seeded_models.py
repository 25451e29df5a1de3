"""Seeded random-init Llama-family models: tiny ones for exactness checks, real shapes for speed.

The test suite and ``scripts/gpu_check.py`` check exactness on the same tiny models (weights scaled
x4 so logits are peaked and near-ties rare; Qwen2 with non-zero q/k/v biases), and the GPU checks
time random-init models of real shapes (speed does not depend on the weights' values).
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM


def tiny_config(kind: str = "llama", vocab_size: int = 320, layers: int = 4, **overrides):
    """A 64-wide, 4-head (2 KV heads) config of ``kind`` 'llama' or 'qwen2'."""
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    common.update(overrides)
    return (Qwen2Config if kind == "qwen2" else LlamaConfig)(**common)


def random_model(config, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    """A seeded random-init causal LM built directly on ``device`` in ``dtype`` (no CPU copy of large weights)."""
    cls = Qwen2ForCausalLM if config.model_type == "qwen2" else LlamaForCausalLM
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def tiny_model(kind: str = "llama", seed: int = 0, vocab_size: int = 320, layers: int = 4,
               device: torch.device | str = "cpu", **overrides):
    """The tests' tiny model: seeded, fp32, eval mode, weights x4; Qwen2 gets non-zero qkv biases."""
    model = random_model(tiny_config(kind, vocab_size, layers, **overrides), device, torch.float32, seed)
    with torch.no_grad():
        for p in model.parameters():  # larger weights than the 0.02 init: peaked, less tie-prone logits
            if p.dim() == 2:
                p.mul_(4.0)
        if kind == "qwen2":
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.1)
    return model
