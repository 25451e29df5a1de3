"""The verifier's quality beside its speed: the bench's held-out loss is transformers' cross-entropy (and training's
evaluation's), a worse verifier is flagged in the table and the JSON, the score is cached per model and a damaged
cache file is recomputed with a note."""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from infer.loading import load_model
from infer.measure import quality
from infer.measure.quality import QualityConfig, held_out_blocks, quality_table, verifier_quality
from layerskip_cli.main import main
from layerskip_core.errors import UserError
from tiny_models import save_tiny

TEXTS = ["def mean(xs):\n    return sum(xs) / len(xs)\n", "The rain in Spain stays mainly in the plain.",
         "import os\nprint(os.getcwd())\n", "Seventeen times twenty-three is three hundred and ninety-one."]


@pytest.fixture
def held_out(tmp_path):
    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps({"prompt": t, "reference": t[::-1]}) + "\n" for t in TEXTS))
    return path


@pytest.fixture(scope="module")
def worse_model_dir(tmp_path_factory):
    """The tiny model with its LM head scaled x8: confidently wrong, so its held-out loss is far higher."""
    path = save_tiny(tmp_path_factory.mktemp("worse"))
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    return path


def test_the_loss_is_transformers_cross_entropy_and_training_evaluations(tiny_model_dir, held_out):
    from train.config import EarlyExitConfig, LayerDropoutConfig
    from train.data import Examples
    from train.exit_eval import exit_metrics
    from train.model import LayerSkipLM

    cfg = QualityConfig(str(held_out), blocks=3, block_size=32)
    model = load_model(tiny_model_dir, device="cpu", dtype="fp32")
    blocks, _ = held_out_blocks(model, cfg, exclude=set())
    assert len(blocks) == 3 and all(len(b) == 32 for b in blocks)
    q = verifier_quality(model, cfg, exclude=set())
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(blocks)  # (B, T)
    with torch.no_grad():
        logits = hf(ids).logits[:, :-1]  # (B, T-1, V)
    expected = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).item()
    assert q["tokens"] == 3 * 31 and q["loss"] == pytest.approx(expected, abs=1e-5)
    assert q["perplexity"] == pytest.approx(torch.tensor(expected).exp().item(), rel=1e-5)
    lm = LayerSkipLM(hf, LayerDropoutConfig(), EarlyExitConfig(), max_steps=1)
    trained = exit_metrics(lm, Examples.from_lists(blocks, blocks), [4], batch_size=2, pad_id=0)
    assert trained["loss"][4] == pytest.approx(q["loss"], abs=1e-5)  # the same loss as training's evaluation


def test_timed_items_are_left_out_of_the_split(tiny_model_dir, held_out):
    model = load_model(tiny_model_dir, device="cpu", dtype="fp32")
    cfg = QualityConfig(str(held_out), blocks=100, block_size=16)
    everything, used = held_out_blocks(model, cfg, exclude=set())
    fewer, used_fewer = held_out_blocks(model, cfg, exclude={"0"})
    assert used == 4 and used_fewer == 3 and len(fewer) < len(everything)
    with pytest.raises(UserError, match="fewer than 16 tokens"):
        held_out_blocks(model, cfg, exclude={"0", "1", "2", "3"})


def test_a_second_run_reads_the_cache_and_a_damaged_one_is_recomputed(tiny_model_dir, held_out, tmp_path):
    model = load_model(tiny_model_dir, device="cpu", dtype="fp32")
    cfg = QualityConfig(str(held_out), blocks=2, block_size=32)
    first = verifier_quality(model, cfg, set())
    second = verifier_quality(model, cfg, set())
    assert (first["cache"], second["cache"]) == ("computed", "read") and second["loss"] == first["loss"]
    [path] = (tmp_path / "toolkit-cache" / "quality").iterdir()
    good = path.read_text()
    for damage in ('{"format": "layerskip-verifier-quality-1", "nats": 1', good.replace('"tokens": 62', '"tokens": -1'),
                   good.replace('"nats": ', '"nats": "x", "n": ')):
        path.write_text(damage)
        again = verifier_quality(model, cfg, set())
        assert again["cache"] == "computed" and "damaged cache recomputed" in again["note"], damage
        assert again["loss"] == pytest.approx(first["loss"], abs=1e-9)
        assert json.loads(path.read_text())["tokens"] == 62  # the damaged file replaced by a good one
    assert verifier_quality(model, cfg, set())["cache"] == "read"


def test_the_table_and_json_flag_a_worse_verifier(tiny_model_dir, worse_model_dir, prompts_file, held_out, tmp_path):
    out = tmp_path / "out"
    argv = ["bench", "--model", f"base={tiny_model_dir}", "--model", f"trained={worse_model_dir}",
            "--drafters", "autoregressive,early_exit:E=2:k=2", "--peers", "none", "--data", str(prompts_file),
            "--n", "2", "--max-new-tokens", "4", "--repeats", "1", "--quality-data", str(held_out),
            "--quality-blocks", "2", "--quiet"]
    assert main([*argv, "--out", str(out)]) == 0
    payload = json.loads((out / "results.json").read_text())
    base, trained = payload["quality"]["base"], payload["quality"]["trained"]
    assert base["delta_nats"] == 0 and base["verdict"] == "same" and base["cache"] == "computed"
    delta = trained["loss"] - base["loss"]
    assert delta > 0.5 and trained["delta_nats"] == pytest.approx(delta) and trained["verdict"] == "worse"
    flag = f"verifier worse by {delta:+.2f} nats"
    for row in payload["summary"]:
        assert row["verifier_loss"] == payload["quality"][row["model"]]["loss"]
        assert row["verifier_flag"] == (flag if row["model"] == "trained" else None)
    md = (out / "results.md").read_text()
    assert f"**{flag}**" in md and "| base | " in md and "0 (base)" in md
    assert "not scored: the prompts have no '#### N' reference answers" in md
    # the trained model as the base: now the original is better, and nothing is flagged; the scores are cached
    assert main([*argv, "--base", "trained", "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "results.json").read_text())
    assert {q["cache"] for q in again["quality"].values()} == {"read"}
    assert again["quality"]["base"]["verdict"] == "better" and not any(r["verifier_flag"] for r in again["summary"])


def test_a_model_not_measured_says_so(monkeypatch):
    from infer.measure.report import Summary

    row = Summary("m", "gsm8k", "autoregressive", 2, 8, 10.0, [10.0], 1.0, None, None, None, None, None, None,
                  None, None, None, answer_accuracy=0.0)
    table = quality_table({}, [row], ["m"])
    assert "| m | not measured | not measured |" in table and "gsm8k: 0.00 of 2 at 4 new tokens" in table
    assert quality.flag({"verdict": "same", "delta_nats": 0.0}) is None


def test_an_unknown_base_is_one_line(tiny_model_dir, prompts_file, tmp_path, capsys):
    code = main(["bench", "--model", f"a={tiny_model_dir}", "--base", "b", "--data", str(prompts_file),
                 "--out", str(tmp_path / "o")])
    assert code == 2 and "--base 'b' names no model; the models are a" in capsys.readouterr().err
