"""Self-speculative decoding with layer skipping: one draft-verify engine, interchangeable drafters.

The Python API (stable names; the README's "Python API" runs them):

    from infer import DecodeConfig, SamplingConfig, load_model

    model = load_model("default")                  # a folder, a hub id, "default", or (hf_model, tokenizer=...)
    out = model.generate("def fib(n):", "early_exit", DecodeConfig(max_new_tokens=32), exit_layer=24)
    print(out.text, out.stats.tokens_per_second, out.stats.acceptance_rate)

The names below load on first use (PEP 562), so importing ``infer`` or a torch-free module of it (the
command line's argument checks use some) does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "load_model": "infer.loading",
    "LoadedModel": "infer.loading",
    "Engine": "infer.decode.engine",
    "BatchEngine": "infer.decode.batch",
    "DecodeConfig": "infer.decode.engine",
    "GenerationResult": "infer.decode.engine",
    "GenerationStats": "infer.decode.engine",
    "SamplingConfig": "infer.model.sampling",
    "DRAFTERS": "infer.drafters",
    "build_drafter": "infer.drafters",
    "parse_spec": "infer.drafters",
    "Runner": "infer.model.runner",
    "DraftVocab": "layerskip_core.draft_vocab",
    "hf_generate": "infer.hf.decoding",
}
"""Public name -> the module that defines it."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'infer' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
