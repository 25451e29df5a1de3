"""The tie-flip classifier: constructed logits rows, and a divergence planted in a tiny model's output."""

import pytest
import torch

from infer.drafters import build_drafter
from infer.engine import Engine, GenerationConfig
from infer.exactness import ULPS, classify_divergence, classify_logits, first_divergence, ulp
from infer.runner import Runner
from tiny_models import make_model


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2
    assert first_divergence([], []) is None


def test_ulp_matches_the_dtype_spacing():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for x in (1.0, 3.0, 20.0, 100.0):
            t = torch.tensor(x, dtype=dtype)
            assert ulp(x, dtype) == float(torch.nextafter(t, torch.tensor(1e9, dtype=dtype)) - t)


def _row(values: dict[int, float], vocab: int = 16) -> torch.Tensor:
    row = torch.full((vocab,), -5.0)
    for i, v in values.items():
        row[i] = v
    return row


def test_bf16_near_tie_is_a_tie_flip():
    # 20 and 20 - 1 bf16 ulp (0.125 at this magnitude): one rounding apart
    margin, resolution, tie = classify_logits(_row({3: 20.0, 7: 19.875}), 3, 7, torch.bfloat16)
    assert margin == pytest.approx(0.125) and resolution == pytest.approx(ULPS * 0.125)
    assert tie


def test_real_mismatch_is_not_a_tie_flip():
    margin, resolution, tie = classify_logits(_row({3: 20.0, 7: 17.0}), 3, 7, torch.bfloat16)
    assert margin == pytest.approx(3.0) and not tie
    # the same 0.125 gap that is a tie in bf16 is a real mismatch in fp32
    margin, resolution, tie = classify_logits(_row({3: 20.0, 7: 19.875}), 3, 7, torch.float32)
    assert resolution < 1e-4 and not tie


def test_classify_divergence_on_a_tiny_model():
    runner = Runner.from_model(make_model("llama", seed=0, layers=4))
    prompt = [5, 6, 7, 8, 9]
    engine = Engine(runner, build_drafter("autoregressive", runner))
    ref = engine.generate(prompt, GenerationConfig(max_new_tokens=12)).tokens
    assert classify_divergence(runner, prompt, ref, list(ref)) is None
    pos = 6
    full = runner.forward(runner.new_cache(32), torch.tensor(prompt + ref[:pos]))[-1]  # (V,)
    second = int(full.topk(2).indices[1])
    out = ref[:pos] + [second] + ref[pos + 1:]
    div = classify_divergence(runner, prompt, ref, out)
    assert (div.position, div.ref_token, div.out_token) == (pos, ref[pos], second)
    assert div.margin == pytest.approx(float(full[ref[pos]] - full[second]), abs=1e-4)
    assert div.margin > 0 and not div.tie_flip  # fp32: a different token is a bug, never a tie
    short = classify_divergence(runner, prompt, ref, ref[:4])
    assert short.position == 4 and short.out_token == -1 and not short.tie_flip
