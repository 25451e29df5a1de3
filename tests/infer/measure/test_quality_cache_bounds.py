"""Issue 49 item 7: a verifier quality cache edited to an absurd score (``nats: 1e308``) or another token count is
recomputed, never reported."""

import json

import pytest

from infer.loading import load_model
from infer.measure.quality import QualityConfig, verifier_quality

TEXTS = ["def mean(xs):\n    return sum(xs) / len(xs)\n", "The rain in Spain stays mainly in the plain."]


@pytest.mark.parametrize("edit", [{"nats": 1e308}, {"nats": 1e300}, {"tokens": 61}, {"tokens": 10**30}])
def test_an_edited_quality_cache_is_recomputed(tiny_model_dir, tmp_path, edit):
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": t, "reference": t[::-1]}) + "\n" for t in TEXTS))
    model = load_model(tiny_model_dir, device="cpu", dtype="fp32")
    cfg = QualityConfig(str(held_out), blocks=1, block_size=32)
    first = verifier_quality(model, cfg, set())
    [path] = (tmp_path / "toolkit-cache" / "quality").iterdir()
    path.write_text(json.dumps(json.loads(path.read_text()) | edit))
    again = verifier_quality(model, cfg, set())
    assert again["cache"] == "computed" and "damaged cache recomputed" in again["note"]
    assert again["loss"] == pytest.approx(first["loss"], abs=1e-9)
