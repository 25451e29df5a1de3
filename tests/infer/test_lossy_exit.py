"""Lossy early-exit decoding: `generate --target-exit E` and bench `autoregressive:target_exit=N` (the old spellings
`--drafter autoregressive --exit-layer E`, `autoregressive:E=N` are refused), honoured by every way of building an
engine."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from infer.loading import load_model
from layerskip_cli.main import main


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def generate(capsys, model_dir, *extra):
    code, out, err = run_cli(capsys, "generate", "--model", str(model_dir), "--prompt", "def add(a, b):", "--json",
                             "--max-new-tokens", "12", "--ignore-eos", "--device", "cpu", *extra)
    assert code == 0, err
    return json.loads(out), err


def truncated_reference(model_dir, E: int, n: int = 12) -> list[int]:
    """transformers' greedy output of the model cut to its first E layers."""
    truncated = AutoModelForCausalLM.from_pretrained(model_dir, num_hidden_layers=E).eval()
    ids = torch.tensor([load_model(str(model_dir)).encode("def add(a, b):")])
    with torch.no_grad():
        return truncated.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()


def test_exit_at_the_last_layer_is_plain_decoding(capsys, tiny_model_dir):
    plain, _ = generate(capsys, tiny_model_dir)
    full, err = generate(capsys, tiny_model_dir, "--target-exit", "4")  # the tiny model has 4 layers
    assert full["tokens"] == plain["tokens"]
    assert full["stats"]["lossy"] is False and "lossy" not in err


def test_early_exit_decodes_with_the_first_layers_only(capsys, tiny_model_dir):
    """E < L: the output is a truncated model's greedy output (checked against transformers with E layers)."""
    out, err = generate(capsys, tiny_model_dir, "--target-exit", "2")
    assert out["stats"]["lossy"] is True and out["stats"]["target_exit"] == 2
    assert "lossy early exit" in err and "exit layer 2" in err
    assert out["tokens"] == truncated_reference(tiny_model_dir, 2)
    plain, _ = generate(capsys, tiny_model_dir)
    assert out["tokens"] != plain["tokens"]  # a real model's exit 2 of 4 is not the full model


def test_target_exit_in_range_and_only_for_plain_decoding(capsys, tiny_model_dir):
    for extra, message in ((["--target-exit", "0"], ">= 1"), (["--target-exit", "5"], "out of range"),
                           (["--exit-layer", "2"], "is spelled target_exit"),  # the old spelling: refused
                           (["--target-exit", "2", "--drafter", "early_exit", "--exit-layer", "1"], "autoregressive")):
        code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--prompt", "hi", *extra)
        assert code == 2 and message in err, (extra, err)


@pytest.mark.parametrize("spec", ["autoregressive:E=2", "autoregressive:exit_layer=2"])
def test_the_old_spec_spelling_is_refused_with_the_one_to_use(spec):
    from infer.drafters import parse_spec
    from layerskip_core.errors import UserError

    with pytest.raises(UserError, match="is spelled target_exit.*autoregressive:target_exit=E"):
        parse_spec(spec)
    assert parse_spec("autoregressive:target_exit=2").target_exit == 2


def test_every_engine_builder_honours_the_target_exit(tiny_model_dir, tmp_path, capsys):
    """The lossy target is the generation's: every path from a method spec to an engine decodes at depth E (the
    stats say lossy only when it really is): LoadedModel.method, bench, swift_stream, bench_independent."""
    from infer.decode.engine import DecodeConfig
    from script_modules import load_script as script

    ref = truncated_reference(tiny_model_dir, 2, 8)
    model = load_model(str(tiny_model_dir))
    engine, config = model.method("autoregressive:target_exit=2", DecodeConfig(max_new_tokens=8,
                                                                                    stop_at_eos=False))
    assert engine.generate(model.encode("def add(a, b):"), config).tokens == ref
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    common = ["--data", str(prompts), "--n", "1", "--max-new-tokens", "8", "--repeats", "1", "--device", "cpu"]
    assert main(["bench", "--model", str(tiny_model_dir), "--drafters", "autoregressive:target_exit=2", "--peers",
                 "none", "--quiet", "--out", str(tmp_path / "b"), *common]) == 0
    records = json.loads((tmp_path / "b" / "results.json").read_text())["records"]
    lossy = [r for r in records if r["method"] == "autoregressive:target_exit=2"]
    assert lossy and all(r["lossy"] and r["agree_total"] < 8 for r in lossy)
    assert script("swift_stream").main(["--model", str(tiny_model_dir), "--drafters", "autoregressive:target_exit=2",
                                        "--out", str(tmp_path / "s"), *common]) == 0
    stream = json.loads((tmp_path / "s" / "stream.json").read_text())
    assert stream[str(tiny_model_dir)]["exact"]["autoregressive:target_exit=2"][0] == 0  # not the full model
    assert script("bench_independent").main(["--model", str(tiny_model_dir), "--drafters",
                                             "autoregressive:target_exit=2", "--out", str(tmp_path / "i"),
                                             *common]) == 0
    rows = {r["method"]: r for r in json.loads((tmp_path / "i" / "independent.json").read_text())["rows"]}
    assert rows["autoregressive:target_exit=2"]["exact"] == "0/1"


def test_bench_reports_quality_next_to_speed(tiny_model_dir, tmp_path, capsys):
    """A lossy row is present, is not counted as an exactness bug, and carries agreement and answer accuracy."""
    data = tmp_path / "qa.jsonl"
    rows = [{"prompt": "What is 2 + 3?", "reference": "2 + 3 = 5\n#### 5"},
            {"prompt": "What is 4 * 4?", "reference": "#### 16"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    code = main(["bench", "--model", str(tiny_model_dir), "--drafters", "autoregressive,autoregressive:target_exit=2",
                 "--peers", "none", "--data", str(data), "--n", "2", "--max-new-tokens", "8", "--repeats", "1",
                 "--out", str(out), "--quiet", "--device", "cpu"])
    assert code == 0, capsys.readouterr().err
    summary = {r["method"]: r for r in json.loads((out / "results.json").read_text())["summary"]}
    lossy, ar = summary["autoregressive:target_exit=2"], summary["autoregressive"]
    assert lossy["lossy"] is True and ar["lossy"] is False
    assert 0.0 <= lossy["prefix_agreement"] <= lossy["agreement"] < 1.0
    assert ar["agreement"] is None and ar["mismatches"] == 0
    for row in (lossy, ar):
        assert row["answer_accuracy"] is not None and 0.0 <= row["answer_accuracy"] <= 1.0
    md = (out / "results.md").read_text()
    assert "| lossy |" in md and "answer acc" in md and "agree (prefix)" in md


def test_lossy_method_is_never_recommended():
    from infer.measure.report import Summary, recommend

    def row(method, tps, lossy=False):
        return Summary("m", "t", method, 1, 8, tps, [tps], None, None, None, None, None, None, None, None, None, 0,
                       lossy=lossy)

    rows = [row("autoregressive", 10.0), row("autoregressive:target_exit=2", 30.0, lossy=True),
            row("hf_generate", 50.0)]
    assert recommend(rows) == {("m", "t"): "autoregressive"}
