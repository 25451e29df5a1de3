"""The layerskip CLI: JSON output schema and one-line errors for bad input."""

import json
import subprocess
import sys

import pytest

from layerskip_cli.main import main


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_schema(capsys, tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"id": "x", "prompt": "hello"}\n')
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--prompts-file", str(prompts),
                             "--drafter", "early_exit", "--exit-layer", "2", "--num-draft", "3", "--json",
                             "--max-new-tokens", "12", "--ignore-eos")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["id"] for r in rows] == ["0", "x"]
    for r in rows:
        assert len(r["tokens"]) == 12 and isinstance(r["text"], str)
        for key in ("tokens_per_second", "acceptance_rate", "tokens_per_verify", "verify_calls", "drafted",
                    "accepted"):
            assert key in r["stats"]
    code, out_ar, _ = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--prompts-file", str(prompts),
                              "--json", "--max-new-tokens", "12", "--ignore-eos")
    assert [json.loads(line)["tokens"] for line in out_ar.splitlines()] == [r["tokens"] for r in rows]


def test_generate_a_batch_equals_one_prompt_at_a_time(capsys, tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{text}"}}\n' for text in ["a", "def add(a, b): return a + b", "xy"]))
    common = ["generate", "--model", str(tiny_model_dir), "--prompts-file", str(prompts), "--json",
              "--max-new-tokens", "10", "--drafter", "early_exit", "--exit-layer", "2", "--num-draft", "3"]
    code, batched, err = run_cli(capsys, *common, "--batch-size", "2")
    assert code == 0, err
    code, alone, err = run_cli(capsys, *common)
    assert code == 0, err
    rows = sorted((json.loads(line) for line in batched.splitlines()), key=lambda r: r["id"])  # as they finish
    assert [r["tokens"] for r in rows] == [json.loads(line)["tokens"] for line in alone.splitlines()]
    assert [r["stats"]["batch_size"] for r in rows] == [2, 2, 2]


def test_generate_chat_and_sampling(capsys, tiny_model_dir):
    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--chat", "--json", "--temperature", "0.8",
            "--top-p", "0.9", "--seed", "3", "--max-new-tokens", "8"]
    code, out1, _ = run_cli(capsys, *argv)
    code2, out2, _ = run_cli(capsys, *argv)
    assert code == code2 == 0
    assert json.loads(out1)["tokens"] == json.loads(out2)["tokens"]  # seeded


@pytest.mark.parametrize("args,message", [
    (["--drafter", "nope"], "unknown drafter 'nope'"),
    (["--drafter", "early_exit", "--exit-layer", "9"], "exit layer 9 is out of range"),
    (["--drafter", "early_exit", "--exit-layer", "0"], "exit layer 0 is out of range"),
    (["--num-draft", "2"], "no --drafter was given"),  # a drafter's option: the drafters that take it are named
    (["--drafter", "autoregressive", "--num-draft", "2"], "does not apply to drafter 'autoregressive'"),
    (["--exit-layer", "5"], "--target-exit E"),  # refused: lossy early exit's one spelling is --target-exit 5
    (["--drafter", "autoregressive", "--exit-layer", "5"], "is spelled target_exit"),
    (["--stop", ""], "--stop needs a non-empty text"),
    (["--device", "cuda:x"], "bad device"),
    (["--prompt", "   "], "is empty"),
    (["--prompt", "x" * 600], "exceeds the model's context"),
    (["--model", "/definitely/not/here"], "does not exist"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--max-new-tokens", "0"], "max-new-tokens must be >= 1"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--batch-size", "2", "--stream"], "drop --stream or --batch-size"),
])
def test_bad_input_is_one_clear_line(capsys, tiny_model_dir, args, message):
    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "hello"] + args
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_malformed_prompts_file(capsys, tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{oops\n')
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--prompts-file", str(bad))
    assert code == 2 and "bad.jsonl:2: not valid JSON" in err
    missing = tmp_path / "nofield.jsonl"
    missing.write_text('{"text": "no prompt field"}\n')
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--prompts-file", str(missing))
    assert code == 2 and "no string 'prompt' field" in err


def test_not_a_model_folder(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "--model", str(tmp_path), "--prompt", "hi")
    assert code == 2 and "not a Hugging Face model folder" in err


def test_console_script_subprocess(tiny_model_dir):
    """The installed entry point: errors exit non-zero with one line and no traceback."""
    proc = subprocess.run([sys.executable, "-m", "layerskip_cli", "generate", "--model", str(tiny_model_dir),
                           "--prompt", "hi", "--drafter", "early_exit", "--exit-layer", "99"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("layerskip: error: exit layer 99")
    assert "Traceback" not in proc.stderr


def test_swift_stream_reports_a_summary(capsys, tiny_model_dir, tmp_path):
    prompts = tmp_path / "stream.jsonl"
    prompts.write_text("".join(f'{{"prompt": "def f{i}(x):"}}\n' for i in range(3)))
    plan = tmp_path / "best.json"
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--prompts-file", str(prompts),
                             "--drafter", "swift", "--stream", "--json", "--max-new-tokens", "24", "--ignore-eos",
                             "--context-window", "4", "--opt-budget", "0.9", "--save-plan", str(plan),
                             "--no-adaptive")  # no fallback: its timed plain steps would leave the optimiser a 3% share
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 4 and [r["kind"] for r in rows] == ["prompt"] * 3 + ["stream_summary"]
    assert all("stats" in r for r in rows)  # every object carries its stats (the README's contract)
    summary = rows[-1]["stats"]
    assert summary["prompts"] == 3 and summary["new_tokens"] == 72
    assert summary["matchness_trajectory"] and 0.0 <= summary["opt_time_share"] < 1.0
    assert plan.is_file()
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--prompt", "x", "--drafter", "swift",
                           "--skip-ratio", "1.5")
    assert code == 2 and "skip-ratio must be in (0, 1)" in err


def test_unwritable_save_plan_refused_before_generating(capsys, tiny_model_dir, tmp_path):
    """The path is checked first: no output is generated (and lost) before a traceback."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for bad in ("/proc/x/p.json", str(blocker / "p.json"), str(tmp_path)):
        code, out, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--prompt", "hi",
                                 "--drafter", "swift", "--save-plan", bad, "--max-new-tokens", "4")
        assert code == 2 and "--save-plan" in err and out == "", (bad, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_help_states_the_exactness_contract(capsys):
    for command in ("generate", "bench"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "identical in fp32; in bf16/fp16 a near-tie can flip" in text, command


def test_train_subcommand_is_train_layerskip(capsys, tmp_path):
    """`layerskip train ARGS` runs train/layerskip.py's main with ARGS (its --help and its one-line errors)."""
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0 and "--config" in capsys.readouterr().out
    code, _, err = run_cli(capsys, "train", "--config", str(tmp_path / "missing.yaml"))
    assert code == 2 and "missing.yaml" in err and "Traceback" not in err


def test_prompts_file_that_is_a_directory_is_named_as_such(capsys, tiny_model_dir, tmp_path):
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--prompts-file", str(tmp_path))
    assert code == 2 and out == "" and "is a folder" in err and len(err.strip().splitlines()) == 1


def test_compiled_static_forwards_on_the_default_model(capsys, default_model_path):
    """--compile (torch.compile of the static forwards' layers; the CUDA default) decodes the real model token for
    token as --no-compile and the eager executor do, with a drafter that verifies several rows."""
    argv = ["generate", "--model", str(default_model_path), "--prompt", "def fib(n):", "--json", "--ignore-eos",
            "--max-new-tokens", "10", "--drafter", "early_exit", "--exit-layer", "20", "--num-draft", "3",
            "--threads", "1"]
    tokens = []
    for extra in (["--executor", "static", "--compile"], ["--executor", "static", "--no-compile"],
                  ["--executor", "eager"]):
        code, out, err = run_cli(capsys, *argv, *extra)
        assert code == 0, err
        tokens.append(json.loads(out)["tokens"])
    assert tokens[0] == tokens[1] == tokens[2] and len(tokens[0]) == 10
