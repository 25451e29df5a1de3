"""Tiny seeded fp32 models and a byte-level tokenizer for fast, exact unit tests."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models
from tokenizers.pre_tokenizers import ByteLevel
from transformers import PreTrainedTokenizerFast

from core.seeded_models import tiny_model

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
BYTE_VOCAB = 259  # <unk>, <s>, </s> + 256 byte symbols


def make_model(kind: str = "llama", seed: int = 0, vocab_size: int = 320, layers: int = 4, **overrides):
    """A seeded random model in fp32 eval mode; Qwen2 gets non-zero qkv biases."""
    return tiny_model(kind, seed, vocab_size, layers, **overrides)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A real fast tokenizer (byte-level, no merges) whose ids fit a tiny model's vocabulary."""
    alphabet = sorted(ByteLevel.alphabet())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {c: i + 3 for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny(path: Path, kind: str = "llama", seed: int = 0, layers: int = 4, **overrides) -> Path:
    """Write a tiny model + byte tokenizer as a plain HF folder; returns the folder."""
    model = make_model(kind, seed=seed, layers=layers, **overrides)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path
