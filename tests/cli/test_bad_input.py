"""Bad input from the command line is one line and exit code 2, before any model loads (issue 27's probes and their
neighbours)."""

import pytest

from layerskip_cli.main import main
from train import layerskip

KERNEL_BUILD_NOTE = "layerskip: building the small-matmul CPU kernel"
"""A progress note printed once per machine (the first run that needs the kernel), whichever test that is."""


def refused(capsys, argv, message, entry=main):
    try:
        code = entry(list(argv))
    except SystemExit as e:  # argparse refuses a flag's value itself (exit 2, one line)
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    lines = [line for line in err.strip().splitlines() if not line.startswith(KERNEL_BUILD_NOTE)]
    assert "Traceback" not in err and len(lines) == 1, err  # the one-time kernel build note may come first


@pytest.mark.parametrize("flags,message", [
    (["--temperature", "nan"], "--temperature: must be a finite number"),
    (["--temperature", "inf"], "--temperature: must be a finite number"),
    (["--temperature", "1e400"], "--temperature: must be a finite number"),
    (["--top-p", "nan"], "--top-p: must be a finite number"),
    (["--seed", "99999999999999999999999"], "seed must be in [0, 2**64)"),
    (["--seed", "-1"], "seed must be in [0, 2**64)"),
    (["--drafter", "early_exit", "--draft-vocab", "²"], "is neither a size"),
    (["--drafter", "early_exit", "--draft-vocab", "٣"], "is neither a size"),
    (["--drafter", "swift", "--plan", "."], "is a folder; give the path of a plan file"),
    (["--drafter", "self_sd", "--plan", "."], "is a folder; give the path of a plan file"),
])
def test_generate_refuses_in_one_line(capsys, flags, message):
    refused(capsys, ["generate", "--prompt", "hi", *flags], message)


@pytest.mark.parametrize("device", ["cuda:²", "cuda:x"])
def test_a_device_index_must_be_ascii_digits(capsys, device):
    refused(capsys, ["generate", "--prompt", "hi", "--device", device], "device")


@pytest.mark.parametrize("content", ["", "# only a comment\n", "\n\n"])
def test_an_empty_recipe_is_refused_not_trained_with_the_defaults(capsys, tmp_path, content):
    recipe = tmp_path / "empty.yaml"
    recipe.write_text(content)
    refused(capsys, ["--config", str(recipe)], f"config file {recipe} is empty", entry=layerskip.main)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("seed", ["99999999999999999999999", "-1"])
def test_a_training_seed_out_of_range_is_refused(capsys, tmp_path, seed):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"seed: {seed}\n")
    refused(capsys, ["--config", str(recipe)], "seed must be in [0, 2**63)", entry=layerskip.main)


def test_an_override_list_index_must_be_ascii_digits(capsys, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("early_exit:\n  exits: [1, 2]\n")
    refused(capsys, ["--config", str(recipe), "early_exit.exits.²=3"], "address them by index", entry=layerskip.main)


@pytest.mark.parametrize("seed", ["99999999999999999999999", "-1"])
def test_a_search_seed_out_of_range_is_refused(capsys, tmp_path, seed):
    refused(capsys, ["search", "--data", "humaneval", "--out", str(tmp_path / "p.json"), "--seed", seed],
            "--seed must be in [0, 2**31)")


@pytest.mark.parametrize("layers", [12, 40])
def test_swift_refuses_a_plan_for_another_depth_on_the_real_model(capsys, tmp_path, default_model_path, layers):
    """A plan tied to this model's identity but for another depth (hand-edited, or SWIFT-style imported elsewhere):
    refused before decoding, and --save-plan never writes it back."""
    from infer.loading import load_model
    from infer.model.plan import LayerPlan, PlanFile

    identity = load_model(str(default_model_path), threads=1).runner.identity()
    plan, out = tmp_path / "p.json", tmp_path / "out.json"
    PlanFile(LayerPlan(layers, frozenset({1}), frozenset({2})), identity, source="import").save(plan)
    refused(capsys, ["generate", "--model", str(default_model_path), "--prompt", "def f():", "--threads", "1",
                     "--drafter", "swift", "--plan", str(plan), "--save-plan", str(out)],
            f"plan for {layers} layers; the model has {identity['num_layers']}")
    assert not out.exists()


def test_a_corrupted_gate_memory_does_not_break_the_real_model(capsys, tmp_path, default_model_path):
    """early_exit --adaptive writes its gate memory; a '"gate"' holding a list is reported naming the file, the output
    stays plain decoding's, and the file is rewritten sane."""
    import json

    from infer.drafters import gate

    argv = ["generate", "--model", str(default_model_path), "--prompt", "def add(a, b):", "--threads", "1",
            "--max-new-tokens", "8", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)["tokens"]
    method = argv + ["--drafter", "early_exit", "--exit-layer", "24", "--adaptive"]
    assert main(method) == 0
    capsys.readouterr()
    (path,) = (gate.cache_root() / "gate").glob("early_exit-*.json")
    path.write_text(json.dumps({"format": gate.MEMORY_FORMAT, "gate": [1, 2]}))
    assert main(method) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["tokens"] == plain
    assert f"{path} is not a valid gate memory" in err and "starting afresh" in err
    gate.check_memory(json.loads(path.read_text()))


@pytest.mark.parametrize("line", ["[" * 100_000 + "]" * 100_000, '{"prompt": NaN}'])
def test_a_prompts_file_line_nested_too_deep_or_non_finite_is_one_line(capsys, tmp_path, line):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(line + "\n")
    refused(capsys, ["generate", "--prompts-file", str(prompts)], f"{prompts}:1: not valid JSON")


def test_a_folder_as_draft_vocab_says_it_is_a_folder(capsys, tmp_path):
    refused(capsys, ["generate", "--prompt", "hi", "--drafter", "early_exit", "--draft-vocab", str(tmp_path)],
            "is a folder; give a file made by `layerskip draft-vocab`")


@pytest.mark.parametrize("entry,argv", [
    (main, ["generate", "--prompt", "hi", "--drafter", "swift", "--fallback", "false"]),  # not --fallback-opt-budget
    (main, ["bench", "--drafters", "swift", "--out", "runs/x", "--max-new", "8"]),  # not --max-new-tokens
    (layerskip.main, ["--config", "recipes/cpu-demo-stdlib.yaml", "--over"]),  # not --overwrite
])
def test_a_prefix_of_an_option_is_not_taken_for_the_option(capsys, entry, argv):
    with pytest.raises(SystemExit) as done:
        entry(argv)
    assert done.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_every_entry_point_builds_its_parser_without_abbreviations():
    """`layerskip_core.cli.Parser` is the one parser class (allow_abbrev=False), in every entry point."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    direct = [str(p.relative_to(repo)) for folder in ("layerskip_cli", "layerskip_core", "infer", "train", "scripts")
              for p in (repo / folder).rglob("*.py")
              if "argparse.ArgumentParser(" in p.read_text(encoding="utf-8")]
    assert direct == []
