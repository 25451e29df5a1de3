"""The `transformers` peers ``layerskip bench`` times beside our drafters: plain ``generate`` (dynamic or static
cache), its early-exit assistant, and prompt lookup, on the same device and dtype as ours."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infer.measure.methods import BenchConfig, Method


class Peer:
    """`transformers` generate, plain / with its early-exit assistant / with prompt lookup."""

    def __init__(self, path: Path, dtype, device):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # generate() warns about its own assistant's kwargs
        hf_logging.disable_progress_bar()
        self.torch = torch
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()

    def generate(self, method: Method, ids: list[int], cfg: BenchConfig,
                 eos: tuple[int, ...]) -> tuple[list[int], float]:
        from transformers import GenerationConfig

        kwargs: dict = {}
        if method.name == "hf_early_exit":
            kwargs["assistant_early_exit"] = method.spec.exit_layer
            kwargs["num_assistant_tokens"] = method.spec.num_draft or 5
        elif method.name == "prompt_lookup":
            kwargs["prompt_lookup_num_tokens"] = method.spec.num_draft or 10
        elif method.name == "hf_static":  # a fixed-size cache; on CUDA generate() compiles the forward
            kwargs["cache_implementation"] = "static"
        s = cfg.sampling
        sampling = not s.greedy
        hf_config = GenerationConfig(max_new_tokens=cfg.max_new_tokens, do_sample=sampling,
                               temperature=s.temperature if sampling else None,
                               top_k=s.top_k or None, top_p=s.top_p if sampling else None,
                               eos_token_id=list(eos) if cfg.stop_at_eos and eos else None,
                               pad_token_id=eos[0] if eos else 0, **kwargs)
        # generate() falls back to the model's own generation_config.eos_token_id when ours is None;
        # with stop_at_eos off every method must run to max_new_tokens, so clear it for this call.
        self.model.generation_config.eos_token_id = list(eos) if cfg.stop_at_eos and eos else None
        x = self.torch.tensor([ids], device=self.device)
        # An explicit mask: without one, generate() infers it from pad_token_id, and SmolLM2's pad is
        # its <|im_end|>, which every chat prompt contains, so those prompt tokens would be masked out.
        mask = self.torch.ones_like(x)
        t0 = time.perf_counter()
        with self.torch.no_grad():
            out = self.model.generate(x, attention_mask=mask, generation_config=hf_config)
            tokens = out[0, len(ids):].tolist()  # reads the result: the GPU has finished when the clock stops
        return tokens, time.perf_counter() - t0
