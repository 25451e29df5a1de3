"""Lossy early-exit decoding: `generate --drafter autoregressive --exit-layer E` and bench `autoregressive:E=N`."""

import json

import torch
from transformers import AutoModelForCausalLM

from infer.cli import main
from infer.loading import load_model


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def generate(capsys, model_dir, *extra):
    code, out, err = run_cli(capsys, "generate", "--model", str(model_dir), "--prompt", "def add(a, b):", "--json",
                             "--max-new-tokens", "12", "--ignore-eos", "--device", "cpu", *extra)
    assert code == 0, err
    return json.loads(out), err


def test_exit_at_the_last_layer_is_plain_decoding(capsys, tiny_model_dir):
    plain, _ = generate(capsys, tiny_model_dir)
    full, err = generate(capsys, tiny_model_dir, "--exit-layer", "4")  # the tiny model has 4 layers
    assert full["tokens"] == plain["tokens"]
    assert full["stats"]["lossy"] is False and "lossy" not in err


def test_early_exit_decodes_with_the_first_layers_only(capsys, tiny_model_dir):
    """E < L: the output is a truncated model's greedy output (checked against transformers with E layers)."""
    out, err = generate(capsys, tiny_model_dir, "--exit-layer", "2")
    assert out["stats"]["lossy"] is True
    assert "lossy early exit" in err and "exit layer 2" in err
    truncated = AutoModelForCausalLM.from_pretrained(tiny_model_dir, num_hidden_layers=2).eval()
    ids = torch.tensor([load_model(str(tiny_model_dir)).encode("def add(a, b):")])
    with torch.no_grad():
        ref = truncated.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert out["tokens"] == ref
    plain, _ = generate(capsys, tiny_model_dir)
    assert out["tokens"] != plain["tokens"]  # a real model's exit 2 of 4 is not the full model


def test_exit_layer_only_for_autoregressive_and_in_range(capsys, tiny_model_dir):
    for extra, message in ((["--exit-layer", "0"], "out of range"), (["--exit-layer", "5"], "out of range")):
        code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--prompt", "hi", *extra)
        assert code == 2 and message in err


def test_bench_reports_quality_next_to_speed(tiny_model_dir, tmp_path, capsys):
    """A lossy row is present, is not counted as an exactness bug, and carries agreement and answer accuracy."""
    data = tmp_path / "qa.jsonl"
    rows = [{"prompt": "What is 2 + 3?", "reference": "2 + 3 = 5\n#### 5"},
            {"prompt": "What is 4 * 4?", "reference": "#### 16"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    code = main(["bench", "--model", str(tiny_model_dir), "--drafters", "autoregressive,autoregressive:E=2",
                 "--peers", "none", "--data", str(data), "--n", "2", "--max-new-tokens", "8", "--repeats", "1",
                 "--out", str(out), "--quiet", "--device", "cpu"])
    assert code == 0, capsys.readouterr().err
    summary = {r["method"]: r for r in json.loads((out / "results.json").read_text())["summary"]}
    lossy, ar = summary["autoregressive:E=2"], summary["autoregressive"]
    assert lossy["lossy"] is True and ar["lossy"] is False
    assert 0.0 <= lossy["prefix_agreement"] <= lossy["agreement"] < 1.0
    assert ar["agreement"] is None and ar["mismatches"] == 0
    for row in (lossy, ar):
        assert row["answer_accuracy"] is not None and 0.0 <= row["answer_accuracy"] <= 1.0
    md = (out / "results.md").read_text()
    assert "| lossy |" in md and "answer acc" in md and "agree (prefix)" in md


def test_lossy_method_is_never_recommended():
    from infer.bench import Summary, recommend

    def row(method, tps, lossy=False):
        return Summary("m", "t", method, 1, 8, tps, [tps], None, None, None, None, None, None, None, None, None, 0,
                       lossy=lossy)

    rows = [row("autoregressive", 10.0), row("autoregressive:E=2", 30.0, lossy=True), row("hf_generate", 50.0)]
    assert recommend(rows) == {("m", "t"): "autoregressive"}
