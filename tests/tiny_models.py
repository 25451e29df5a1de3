"""Tiny seeded fp32 models and a byte-level tokenizer for fast, exact unit tests.

The builders live in ``tools.seeded_models`` (``tools/gpu/gpu_check.py`` uses them too); this module keeps the
tests' names for them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tools.seeded_models import BYTE_VOCAB, CHAT_TEMPLATE, byte_tokenizer, tiny_model

__all__ = ["BYTE_VOCAB", "CHAT_TEMPLATE", "FAMILY_KINDS", "TINY_WINDOW", "byte_tokenizer", "family_config",
           "family_model", "make_model", "save_family", "save_tiny"]


def make_model(kind: str = "llama", seed: int = 0, vocab_size: int = 320, layers: int = 4, **overrides):
    """A seeded random model in fp32 eval mode; Qwen2 gets non-zero qkv biases."""
    return tiny_model(kind, seed, vocab_size, layers, **overrides)


def save_tiny(path: Path, kind: str = "llama", seed: int = 0, layers: int = 4, **overrides) -> Path:
    """Write a tiny model + byte tokenizer as a plain HF folder; returns the folder."""
    model = make_model(kind, seed=seed, layers=layers, **overrides)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


FAMILY_KINDS = ("qwen3", "gemma3_text", "smollm3", "mistral_window", "qwen2_window")
"""The families of issue 47 (and the windowed Llama-family ones) that ``family_model`` builds."""
TINY_WINDOW = 48
"""Sliding window of the tiny windowed models: shorter than the tests' contexts, wider than any draft tree."""


def family_config(kind: str, vocab_size: int = 320, layers: int = 6, window: int = TINY_WINDOW, **overrides):
    """A tiny config of a family, from transformers' own config class (64 wide, 4 heads, 2 KV heads)."""
    from transformers import Gemma3TextConfig, MistralConfig, Qwen2Config, Qwen3Config, SmolLM3Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    if kind == "qwen3":  # explicit head_dim unlike hidden / heads; no window
        config = Qwen3Config(**common | dict(head_dim=24) | overrides)
    elif kind == "gemma3_text":  # local layers (window, local base) and global ones (scaled RoPE), capped logits
        types = ["sliding_attention", "sliding_attention", "full_attention"] * (layers // 3) + \
                ["sliding_attention"] * (layers % 3)
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0}}
        config = Gemma3TextConfig(**common | dict(head_dim=16, sliding_window=window, layer_types=types,
                                                  query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                                                  rope_parameters=rope, tie_word_embeddings=True) | overrides)
    elif kind == "smollm3":  # RoPE skipped on every fourth layer
        config = SmolLM3Config(**common | dict(no_rope_layer_interval=4) | overrides)
    elif kind == "mistral_window":
        config = MistralConfig(**common | dict(sliding_window=window) | overrides)
    elif kind == "qwen2_window":  # windows from max_window_layers on, as transformers reads use_sliding_window
        config = Qwen2Config(**common | dict(use_sliding_window=True, sliding_window=window,
                                             max_window_layers=layers // 2) | overrides)
    else:
        raise ValueError(f"unknown family kind {kind!r}")
    config._attn_implementation = "sdpa"
    return config


def family_model(kind: str, seed: int = 0, layers: int = 6, window: int = TINY_WINDOW, **overrides):
    """A seeded tiny fp32 model of a family in eval mode: matrices x4 (peaked logits), norm weights and q/k/v biases
    random, so the family's own parts (norm flavour, q/k norms, sandwich norms) all matter."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(kind, layers=layers, window=window, **overrides),
                                             dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(4.0)
            elif "norm" in name:
                p.normal_(0.0 if kind == "gemma3_text" else 1.0, 0.2)  # Gemma scales by 1 + w
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model.eval()


def save_family(path: Path, kind: str, seed: int = 0, layers: int = 6, **overrides) -> Path:
    """Write a tiny family model + byte tokenizer as a plain HF folder; returns the folder."""
    family_model(kind, seed=seed, layers=layers, **overrides).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def noisy_adapter(model, path: Path, exit_layer: int, noise: float = 0.0, seed: int = 0, mlp_size: int = 0,
                  frozen: bool = True):
    """Write an exit adapter file for ``model`` at ``exit_layer`` to ``path``: initialised as the plain exit, then
    perturbed by seeded noise (a stand-in for training that makes its drafts differ from the plain exit's and the
    target's). Returns the training module (``train.adapter.AdapterLM``); the model is left frozen (``requires_grad``
    off, as decoding takes it) unless ``frozen`` is False."""
    from train.adapter import AdapterLM
    from train.config import AdapterConfig

    lm = AdapterLM(model, AdapterConfig(enabled=True, exit_layer=exit_layer, mlp_size=mlp_size))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lm.adapter.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen))
    lm.save(path, {"test": True})
    model.requires_grad_(not frozen)
    return lm
