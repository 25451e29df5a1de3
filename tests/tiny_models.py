"""Tiny seeded fp32 models and a byte-level tokenizer for fast, exact unit tests.

The builders live in ``infer.measure.seeded_models`` (``scripts/gpu_check.py`` uses them too); this module keeps the
tests' names for them.
"""

from __future__ import annotations

from pathlib import Path

from infer.measure.seeded_models import BYTE_VOCAB, CHAT_TEMPLATE, byte_tokenizer, tiny_model

__all__ = ["BYTE_VOCAB", "CHAT_TEMPLATE", "byte_tokenizer", "make_model", "save_tiny"]


def make_model(kind: str = "llama", seed: int = 0, vocab_size: int = 320, layers: int = 4, **overrides):
    """A seeded random model in fp32 eval mode; Qwen2 gets non-zero qkv biases."""
    return tiny_model(kind, seed, vocab_size, layers, **overrides)


def save_tiny(path: Path, kind: str = "llama", seed: int = 0, layers: int = 4, **overrides) -> Path:
    """Write a tiny model + byte tokenizer as a plain HF folder; returns the folder."""
    model = make_model(kind, seed=seed, layers=layers, **overrides)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path
