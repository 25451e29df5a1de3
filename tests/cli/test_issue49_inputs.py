"""Issue 49: refusals and kept results for the probes of user input that hung, mixed or raised a traceback, each with
its neighbours on the other commands and the Python API."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from layerskip_cli.main import main
from layerskip_core.errors import UserError

REPO = Path(__file__).resolve().parents[2]


def refused(capsys, argv, message):
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse refuses a flag's value itself
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


# ---------------------------------------------------------------- duplicate options in drafter specs (item 5)
@pytest.mark.parametrize("text", ["early_exit:E=2:E=3", "early_exit:E=2:exit_layer=3", "early_exit:k=2:num_draft=3",
                                  "dynamic_exit:exits=8/16:exits=24", "autoregressive:target_exit=8:target_exit=4"])
def test_a_spec_option_given_twice_is_refused(text):
    from infer.drafters.spec import parse_spec

    with pytest.raises(UserError, match="twice"):
        parse_spec(text)


def test_a_spec_option_given_twice_is_refused_by_the_bench_and_the_python_api(capsys, tmp_path, tiny_model_dir):
    from infer.drafters.spec import drafter_spec
    from infer.loading import load_model

    refused(capsys, ["bench", "--drafters", "early_exit:E=2:exit_layer=3", "--out", str(tmp_path / "b")], "twice")
    with pytest.raises(UserError, match="exit_layer twice"):
        drafter_spec("early_exit", {"E": 2, "exit_layer": 3})
    model = load_model(str(tiny_model_dir), threads=1)
    with pytest.raises(UserError, match="twice"):
        model.engine("early_exit", {"E": 2}, exit_layer=3)


def test_the_documented_comma_between_exits_works_in_bench_drafters():
    from infer.measure.methods import parse_methods, split_drafters

    assert split_drafters("dynamic_exit:exits=1,2,early_exit:E=2:k=3") == ["dynamic_exit:exits=1,2",
                                                                           "early_exit:E=2:k=3"]
    methods = {m.label: m for m in parse_methods("dynamic_exit:exits=1,2", "")}
    assert methods["dynamic_exit:exits=1,2"].spec.config.exits == "1,2"


# ---------------------------------------------------------------- tracebacks on user input (item 6)
@pytest.mark.parametrize("exits", ["²", "1/²", "٣"])
def test_exits_that_are_not_ascii_digits_are_one_line(capsys, exits, tiny_model_dir):
    refused(capsys, ["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--drafter", "dynamic_exit",
                     "--exits", exits, "--max-new-tokens", "2"], "exits must be layer numbers")


def test_a_deeply_nested_training_config_beside_a_model_is_ignored(tmp_path):
    from infer.drafters.dynamic_exit import trained_exits

    folder = tmp_path / "final"
    folder.mkdir()
    (tmp_path / "config.yaml").write_text("early_exit: " + "[" * 20000 + "]" * 20000 + "\n")
    runner = type("R", (), {"config": type("C", (), {"name_or_path": str(folder)})(), "num_layers": 4})()
    assert trained_exits(runner) is None
    (tmp_path / "config.yaml").write_text("early_exit:\n  exits: [1, 2]\nearly_exit:\n  exits: [3]\n")
    assert trained_exits(runner) is None  # a section twice: not a config this project wrote


BAD_TEXT = ["\udcff\udcfe abc", "a\ud800b"]


@pytest.mark.parametrize("text", BAD_TEXT)
def test_a_prompt_that_is_not_text_is_one_line(capsys, text, tiny_model_dir, tmp_path):
    refused(capsys, ["generate", "--model", str(tiny_model_dir), "--prompt", text], "is not text")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": text}) + "\n")  # JSON escapes the surrogate: \ud800
    refused(capsys, ["generate", "--model", str(tiny_model_dir), "--prompts-file", str(prompts)], "is not text")
    refused(capsys, ["bench", "--model", str(tiny_model_dir), "--data", str(prompts), "--n", "1",
                     "--quality-data", "none", "--out", str(tmp_path / "b"), "--quiet"], "is not text")


def test_a_prompt_that_is_not_text_is_one_line_in_the_python_api(tiny_model_dir):
    from infer.loading import load_model

    model = load_model(str(tiny_model_dir), threads=1)
    for text in BAD_TEXT:
        with pytest.raises(UserError, match="is not text"):
            model.generate(text)
        with pytest.raises(UserError, match="is not text"):
            model.generate(["fine", text])


def test_a_prompt_that_is_not_utf8_bytes_is_one_line_from_a_shell(tiny_model_dir):
    proc = subprocess.run([sys.executable, "-m", "layerskip_cli", "generate", "--model", str(tiny_model_dir),
                           "--prompt", os.fsdecode(b"\xff\xfe abc")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "is not text" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- limits before work (items 4, 7)
def test_batch_size_zero_and_huge_in_the_python_api(tiny_model_dir):
    from infer.decode.engine import DecodeConfig
    from infer.loading import load_model

    model = load_model(str(tiny_model_dir), threads=1)
    with pytest.raises(UserError, match="batch size must be an integer >= 1"):
        model.generate(["a", "b"], batch_size=0)
    made = []
    real = model.batch_engine

    def spy(*args, **kwargs):
        made.append(kwargs["batch_size"])
        return real(*args, **kwargs)

    model.batch_engine = spy
    results = model.generate(["a", "bc"], config=DecodeConfig(max_new_tokens=3), batch_size=10**9)
    assert made == [2] and len(results) == 2  # capped by the prompts: no slot built for rows that cannot exist


def test_a_huge_batch_size_is_capped_by_the_prompts_on_the_command_line(capsys, tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "bc"}\n')
    code = main(["generate", "--model", str(tiny_model_dir), "--prompts-file", str(prompts), "--json",
                 "--max-new-tokens", "3", "--batch-size", "1000000000"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert sorted(json.loads(line)["stats"]["batch_size"] for line in out.splitlines()) == [2, 2]


def test_a_bench_batch_size_above_its_prompts_is_refused_before_loading(capsys, tmp_path):
    refused(capsys, ["bench", "--batch-size", "100000000", "--n", "2", "--out", str(tmp_path / "b")],
            "more than the 2 prompts per task")


# ---------------------------------------------------------------- streamed output survives an interruption (item 2)
def _default_sigint() -> None:
    """In the child, Ctrl-C as a terminal delivers it: a pytest-xdist worker ignores SIGINT, and an ignored signal is
    inherited across exec (Python then installs no KeyboardInterrupt handler, and the run would not stop)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig, batch", [(signal.SIGINT, "3"), (signal.SIGTERM, "3"), (signal.SIGTERM, "1")])
def test_an_interrupted_json_generation_keeps_every_finished_row(tiny_model_dir, tmp_path, sig, batch):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": "x" * (1 + i % 7)}) + "\n" for i in range(400)))
    proc = subprocess.Popen([sys.executable, "-m", "layerskip_cli", "generate", "--model", str(tiny_model_dir),
                             "--prompts-file", str(prompts), "--json", "--batch-size", batch, "--max-new-tokens",
                             "40", "--ignore-eos", "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, preexec_fn=_default_sigint)
    first = proc.stdout.readline()  # a row is out while the others decode
    proc.send_signal(sig)
    rest, _ = proc.communicate(timeout=120)
    rows = [json.loads(line) for line in (first + rest).splitlines()]
    assert 1 <= len(rows) < 400 and len({r["id"] for r in rows}) == len(rows)
    assert all(len(r["tokens"]) == 40 for r in rows)
    assert proc.returncode != 0


# ---------------------------------------------------------------- non-finite numbers on every command (item 1)
@pytest.mark.parametrize("argv", [
    ["search", "--data", "humaneval", "--out", "{tmp}/p.json", "--timeout", "inf"],
    ["search", "--data", "humaneval", "--out", "{tmp}/p.json", "--skip-ratio", "nan"],
    ["search", "--data", "humaneval", "--out", "{tmp}/p.json", "--timeout", "1e999"],
    ["generate", "--prompt", "hi", "--drafter", "early_exit", "--confidence", "nan"],
    ["generate", "--prompt", "hi", "--drafter", "swift", "--opt-budget", ".inf"],
    ["generate", "--prompt", "hi", "--drafter", "dynamic_exit", "--min-speedup", "1e400"],
    ["bench", "--sample", "--temperature", "inf", "--out", "{tmp}/b"],
    ["bench", "--drafters", "early_exit:confidence=.inf", "--out", "{tmp}/b"],
    ["bench", "--drafters", "early_exit:confidence=1e999", "--out", "{tmp}/b"],
])
def test_a_number_that_is_not_finite_is_refused_by_every_command(capsys, tmp_path, argv):
    refused(capsys, [a.replace("{tmp}", str(tmp_path)) for a in argv], "finite number")


def test_a_script_budget_that_is_not_finite_is_refused():
    proc = subprocess.run([sys.executable, "-m", "tools.gpu.gpu_lease", "check", "--budget-s", "inf"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "finite number" in proc.stderr and proc.stderr.count("\n") == 1


def test_a_search_config_that_is_not_finite_is_refused_in_python():
    from infer.selfsd.search import SearchConfig

    for bad in ({"timeout": float("inf")}, {"skip_ratio": float("nan")}):
        with pytest.raises(UserError, match="finite number"):
            SearchConfig(**bad)
