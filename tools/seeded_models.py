"""Seeded random-init Llama-family models and a byte-level tokenizer, all built in code (no download).

The test suite and ``tools/gpu/gpu_check.py`` check exactness on the same tiny models (weights scaled
x4 so logits are peaked and near-ties rare; Qwen2 with non-zero q/k/v biases), and the GPU checks
time random-init models of real shapes (speed does not depend on the weights' values).
:func:`byte_tokenizer` is a real fast tokenizer (259 ids: three specials and the 256 bytes), so a
machine with no model cache and no network can still save, train and reload a checkpoint end to end.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models
from tokenizers.pre_tokenizers import ByteLevel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""The byte tokenizer's chat template: ``<|role|>content</s>`` per message."""
BYTE_VOCAB = 259
"""Ids of :func:`byte_tokenizer`: <unk>, <s>, </s> + 256 byte symbols."""


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


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A real fast tokenizer (byte-level, no merges, ``BYTE_VOCAB`` ids) whose ids fit a tiny model's vocabulary."""
    alphabet = sorted(ByteLevel.alphabet())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {c: i + 3 for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast
