"""`layerskip eval-exits` on a tiny model: per-exit metrics equal a direct computation with transformers."""

import json
import math
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from infer.loading import load_model
from layerskip_cli.main import main

REPO = Path(__file__).resolve().parents[2]
TEXTS = [{"prompt": "def add(a, b):\n", "reference": "    return a + b\n"},
         {"prompt": "The quick brown fox ", "reference": "jumps over the lazy dog."}]


def test_eval_exits_metrics_json_and_plot(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps(t) + "\n" for t in TEXTS))
    out = tmp_path / "exits"
    code = main(["eval-exits", "--model", str(tiny_model_dir), "--data", str(data), "--exits", "1,2",
                 "--device", "cpu", "--dtype", "fp32", "--out", str(out), "--batch-size", "1"])
    assert code == 0, capsys.readouterr().err
    result = json.loads((out / "exits.json").read_text())
    assert (out / "exits.png").stat().st_size > 1000
    assert result["device"] == "cpu" and result["dtype"] == "fp32" and result["examples"] == 2
    assert list(result["agreement"]) == ["1", "2", "4"]  # the final layer is always included
    assert result["agreement"]["4"] == 1.0
    for e, loss in result["loss"].items():
        assert math.isclose(result["perplexity"][e], math.exp(loss), rel_tol=1e-9)

    # the same numbers straight from transformers: exit E = hidden state after E layers -> final norm -> head
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = load_model(str(tiny_model_dir)).tokenizer
    agree = {1: 0, 2: 0}
    loss = {1: 0.0, 2: 0.0}
    n = 0
    for t in TEXTS:
        ids = torch.tensor([tok(t["prompt"] + t["reference"])["input_ids"]])
        with torch.no_grad():
            hidden = hf(ids, output_hidden_states=True).hidden_states
            final = hf.lm_head(hidden[-1])[0, :-1].argmax(-1)
            for e in (1, 2):
                logits = hf.lm_head(hf.model.norm(hidden[e]))[0, :-1]
                agree[e] += int((logits.argmax(-1) == final).sum())
                loss[e] += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        n += ids.shape[1] - 1
    for e in (1, 2):
        assert math.isclose(result["agreement"][str(e)], agree[e] / n, abs_tol=1e-9)
        assert math.isclose(result["loss"][str(e)], loss[e] / n, rel_tol=1e-4)


def test_eval_exits_bad_input(tiny_model_dir, tmp_path, capsys):
    for argv, message in ((["--data", "gsm8k", "--exits", "9"], "1..4"),
                          (["--data", "gsm8k", "--exits", "a"], "expected comma-separated integers"),
                          (["--data", str(tmp_path / "missing.jsonl")], "missing.jsonl")):
        code = main(["eval-exits", "--model", str(tiny_model_dir), "--device", "cpu", *argv])
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_script_is_the_same_command():
    proc = subprocess.run([sys.executable, "scripts/eval_exits.py", "--help"], capture_output=True, text=True,
                          cwd=REPO)
    assert proc.returncode == 0 and "--data" in proc.stdout and "--device" in proc.stdout
    assert "sys.path" not in (REPO / "scripts" / "eval_exits.py").read_text()
