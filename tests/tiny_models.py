"""Tiny seeded fp32 models and a byte-level tokenizer for fast, exact unit tests."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models
from tokenizers.pre_tokenizers import ByteLevel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
BYTE_VOCAB = 259  # <unk>, <s>, </s> + 256 byte symbols


def tiny_config(kind: str = "llama", vocab_size: int = 320, layers: int = 4, **overrides):
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    common.update(overrides)
    return (Qwen2Config if kind == "qwen2" else LlamaConfig)(**common)


def make_model(kind: str = "llama", seed: int = 0, vocab_size: int = 320, layers: int = 4, **overrides):
    """A seeded random model in fp32 eval mode; Qwen2 gets non-zero qkv biases."""
    torch.manual_seed(seed)
    config = tiny_config(kind, vocab_size, layers, **overrides)
    model = (Qwen2ForCausalLM if kind == "qwen2" else LlamaForCausalLM)(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # larger weights than the 0.02 init: peaked, less tie-prone logits
            if p.dim() == 2:
                p.mul_(4.0)
        if kind == "qwen2":
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.1)
    return model


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
