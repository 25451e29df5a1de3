"""Bad input from the command line is one line and exit code 2, before any model loads (issue 27's probes and their
neighbours)."""

import pytest

from layerskip_cli.main import main
from train import layerskip


def refused(capsys, argv, message, entry=main):
    code = entry(list(argv))
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flags,message", [
    (["--temperature", "nan"], "temperature must be a finite number"),
    (["--temperature", "inf"], "temperature must be a finite number"),
    (["--top-p", "nan"], "top_p must be a finite number"),
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
