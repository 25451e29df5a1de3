"""The `transformers` peers ``layerskip bench`` times beside our drafters: plain ``generate`` (dynamic or static
cache), its early-exit assistant, and prompt lookup, on the same device and dtype as ours."""

from __future__ import annotations

import time
from pathlib import Path

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

    def config(self, method: Method, cfg: BenchConfig, eos: tuple[int, ...]):
        """The GenerationConfig of ``method`` under the bench's settings (greedy or its sampling, max_new_tokens, EOS
        only with stop_at_eos); clears the model's own EOS fallback when the bench runs to max_new_tokens."""
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
        # generate() falls back to the model's own generation_config.eos_token_id when ours is None;
        # with stop_at_eos off every method must run to max_new_tokens, so clear it for this call.
        self.model.generation_config.eos_token_id = list(eos) if cfg.stop_at_eos and eos else None
        return GenerationConfig(max_new_tokens=cfg.max_new_tokens, do_sample=sampling,
                                temperature=s.temperature if sampling else None,
                                top_k=s.top_k or None, top_p=s.top_p if sampling else None,
                                eos_token_id=list(eos) if cfg.stop_at_eos and eos else None,
                                pad_token_id=eos[0] if eos else 0, **kwargs)

    def generate(self, method: Method, ids: list[int], cfg: BenchConfig,
                 eos: tuple[int, ...]) -> tuple[list[int], float]:
        """One prompt: (new tokens, wall seconds)."""
        hf_config = self.config(method, cfg, eos)
        x = self.torch.tensor([ids], device=self.device)
        # An explicit mask: without one, generate() infers it from pad_token_id, and SmolLM2's pad is
        # its <|im_end|>, which every chat prompt contains, so those prompt tokens would be masked out.
        mask = self.torch.ones_like(x)
        t0 = time.perf_counter()
        with self.torch.no_grad():
            out = self.model.generate(x, attention_mask=mask, generation_config=hf_config)
            tokens = out[0, len(ids):].tolist()  # reads the result: the GPU has finished when the clock stops
        return tokens, time.perf_counter() - t0

    def generate_batch(self, method: Method, prompts: list[list[int]], batch_size: int, cfg: BenchConfig,
                       eos: tuple[int, ...]) -> tuple[list[list[int]], list[float], float]:
        """``prompts`` in batches of ``batch_size``, each left-padded into one batched ``generate`` (plain or static
        cache: transformers' assisted decoding refuses batches): (new tokens per prompt, each prompt's latency = its
        batch's wall seconds, total wall seconds). With stop_at_eos a row's tokens end at its first EOS, as ours."""
        hf_config = self.config(method, cfg, eos)
        tokens, latency, total = [], [], 0.0
        for first in range(0, len(prompts), batch_size):
            rows = prompts[first:first + batch_size]
            width = max(len(p) for p in rows)
            x = self.torch.tensor([[hf_config.pad_token_id] * (width - len(p)) + p for p in rows], device=self.device)
            mask = self.torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=self.device)
            t0 = time.perf_counter()
            with self.torch.no_grad():
                out = self.model.generate(x, attention_mask=mask, generation_config=hf_config)[:, width:].tolist()
            wall = time.perf_counter() - t0
            total += wall
            tokens += [_until_eos(row, eos) if cfg.stop_at_eos else row for row in out]
            latency += [wall] * len(rows)
        return tokens, latency, total


def _until_eos(row: list[int], eos: tuple[int, ...]) -> list[int]:
    """A batched row's tokens up to its first EOS (kept): what follows is generate()'s padding."""
    end = next((i for i, t in enumerate(row) if t in eos), len(row) - 1)
    return row[:end + 1]
