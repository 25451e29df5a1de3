"""Strict configs: every shipped YAML loads, bad keys are refused early and clearly, overrides work."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import train.model
from layerskip_core.errors import UserError
from layerskip_core.options import field_docs
from train import layerskip
from train.config import TrainConfig
from train.recipe import build, describe, dump_config, load_config

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
ACCELERATE_CONFIGS = sorted((REPO / "configs").rglob("*.yaml"))


def test_there_are_recipes_and_configs():
    names = {p.name for p in RECIPES}
    assert {"cpu-demo-stdlib.yaml", "cpu-demo-gsm8k-lora.yaml"} <= names
    assert len(RECIPES) >= 4 and len(ACCELERATE_CONFIGS) >= 5


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads_and_round_trips(path, tmp_path):
    cfg = load_config(path)
    assert isinstance(cfg, TrainConfig)
    text = path.read_text()
    assert "accelerate launch" in text or "python train/layerskip.py" in text, "header must hold the launch command"
    assert "Expected" in text or "expected" in text, "header must state the expected result"
    dump_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == cfg


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_every_accelerate_config_loads(path):
    from accelerate.commands.config.config_args import ClusterConfig

    cfg = ClusterConfig.from_yaml_file(str(path))  # refuses unknown keys
    assert cfg.num_processes >= 1
    assert "accelerate launch" in path.read_text()


def test_cpu_ddp_config_starts_two_processes():
    from accelerate.commands.config.config_args import ClusterConfig

    cfg = ClusterConfig.from_yaml_file(str(REPO / "configs/accelerate/cpu-ddp.yaml"))
    assert cfg.num_processes == 2 and cfg.use_cpu and cfg.distributed_type.value == "MULTI_GPU"


def test_unknown_key_names_the_nearest_valid_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  lerning_rate: 1e-4\n")
    with pytest.raises(UserError, match=r"unknown config key 'optim.lerning_rate'.*did you mean 'optim.lr'"):
        load_config(bad)
    bad.write_text("optimizer:\n  lr: 1e-4\n")
    with pytest.raises(UserError, match=r"unknown config key 'optimizer'.*did you mean 'optim'"):
        load_config(bad)
    bad.write_text("data:\n  sources:\n    - type: files\n      paht: x\n")
    with pytest.raises(UserError, match=r"'data.sources\[0\].paht'.*did you mean 'data.sources\[0\].path'"):
        load_config(bad)
    with pytest.raises(UserError, match=r"did you mean 'early_exit.exits'"):
        load_config(None, ["early_exit.exit=[1]"])


def test_bad_values_are_refused():
    with pytest.raises(UserError, match=r"'cosin'.*did you mean 'cosine'"):
        load_config(None, ["optim.schedule=cosin"])
    with pytest.raises(UserError, match="expected an integer"):
        load_config(None, ["optim.max_steps=1.5"])
    with pytest.raises(UserError, match=r"p_max must be in \[0, 1\]"):
        load_config(None, ["layer_dropout.p_max=1.5"])
    with pytest.raises(UserError, match="warmup_steps"):
        load_config(None, ["optim.warmup_steps=-1"])
    with pytest.raises(UserError, match="prompt_set sources"):
        load_config(None, ["data.sources=[{type: prompt_set, path: gsm8k}]"])
    with pytest.raises(UserError, match="not of the form"):
        load_config(None, ["optim.lr"])


def test_overrides_and_yaml_numbers():
    cfg = load_config(None, ["optim.lr=3e-4", "early_exit.exits=[8, 16]", "data.sources.0.max_documents=5",
                             "layer_dropout.layers=null", "lora.enabled=true"])
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.early_exit.exits == [8, 16]
    assert cfg.data.sources[0].type == "stdlib" and cfg.data.sources[0].max_documents == 5
    assert cfg.lora.enabled


def test_every_field_has_a_docstring():
    def walk(cls):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
            tp = typing.get_type_hints(cls)[f.name]
            inner = typing.get_args(tp)[0] if typing.get_origin(tp) is list else tp
            if dataclasses.is_dataclass(inner):
                walk(inner)

    walk(TrainConfig)
    lines = describe()
    assert any(line.startswith("optim.lr (float, default 0.0003)") for line in lines)


def test_build_rejects_non_mappings():
    with pytest.raises(UserError, match="expected a mapping"):
        build(TrainConfig, {"optim": [1, 2]})


def test_bad_key_refused_before_any_model_is_loaded(tmp_path, monkeypatch, capsys):
    def boom(*args, **kwargs):
        raise AssertionError("the model must not be loaded for a bad config")

    monkeypatch.setattr(train.model, "load_model", boom)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name_or_path: /nonexistent\noptim:\n  max_step: 3\n")
    assert layerskip.main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did you mean 'optim.max_steps'" in err[0]


def test_cli_error_is_one_line_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("early_exit:\n  scale: quadratic\n")
    proc = subprocess.run([sys.executable, str(REPO / "train/layerskip.py"), "--config", str(bad)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "early_exit.scale" in lines[0] and "'uniform', 'linear', 'sum'" in lines[0]
    missing = subprocess.run([sys.executable, str(REPO / "train/layerskip.py"), "--config", str(tmp_path / "no.yaml")],
                             capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr


def test_help_config_and_print_config(capsys):
    assert layerskip.main(["--help-config"]) == 0
    out = capsys.readouterr().out
    assert "layer_dropout.p_max" in out and "early_exit.curriculum" in out
    assert layerskip.main(["--print-config", "optim.lr=0.01"]) == 0
    assert "lr: 0.01" in capsys.readouterr().out


def test_command_line_overrides_are_blamed_on_the_command_line(capsys, tmp_path):
    recipe = REPO / "recipes" / "cpu-demo-stdlib.yaml"
    for override, expected in [("optim.max_steps=x", "command-line override optim.max_steps=x"),
                               ("optim.max_steps=0", "command-line overrides: optim.max_steps=0")]:
        assert layerskip.main(["--config", str(recipe), override]) == 2
        err = capsys.readouterr().err.strip()
        assert expected in err and "cpu-demo-stdlib.yaml" not in err, err
    bad = tmp_path / "recipe.yaml"  # the file's own mistakes still name the file
    bad.write_text(recipe.read_text().replace("max_steps: 200", "max_steps: x", 1))
    with pytest.raises(UserError, match=r"recipe\.yaml: optim\.max_steps: expected an integer"):
        load_config(bad, ["optim.lr=0.1"])


@pytest.mark.parametrize("key,suggested", [("output_dir", "checkpoint.output_dir"),
                                           ("optim.output_dir", "checkpoint.output_dir"),
                                           ("max_steps", "optim.max_steps"), ("save_steps", "checkpoint.save_every")])
def test_unknown_key_suggests_the_section_qualified_key(key, suggested, tmp_path):
    with pytest.raises(UserError, match=f"did you mean '{suggested}'"):
        load_config(None, [f"{key}=3"])
    recipe = tmp_path / "r.yaml"
    top, _, leaf = key.rpartition(".")
    recipe.write_text(f"{top}:\n  {leaf}: 3\n" if top else f"{leaf}: 3\n")
    with pytest.raises(UserError, match=f"did you mean '{suggested}'"):
        load_config(recipe)


def test_recipe_that_is_not_utf8_or_is_a_directory_is_one_line(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_bytes(b"optim:\n  lr: 'caf\xe9'\n")
    with pytest.raises(UserError, match=r"r\.yaml: not UTF-8 text \(line 2\)"):
        load_config(bad)
    with pytest.raises(UserError, match="is a directory"):
        load_config(tmp_path)


def test_fsdp2_config_is_fsdp_version_2():
    from accelerate.commands.config.config_args import ClusterConfig

    cfg = ClusterConfig.from_yaml_file(str(REPO / "configs/accelerate/fsdp2.yaml"))
    assert cfg.distributed_type.value == "FSDP" and cfg.fsdp_config["fsdp_version"] == 2
    assert cfg.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"  # one whole HF folder at the end


def test_zero3_refuses_layer_dropout_and_lora():
    """Checked before any model loads, with the stage accelerate's DeepSpeed plugin reports."""
    base = load_config(REPO / "recipes/cpu-demo-stdlib.yaml")
    with_dropout = dataclasses.replace(base, layer_dropout=dataclasses.replace(base.layer_dropout, p_max=0.2),
                                       lora=dataclasses.replace(base.lora, enabled=False))
    with pytest.raises(UserError, match=r"layer dropout .*ZeRO-3.*p_max=0"):
        layerskip.check_zero_stage(with_dropout, 3)
    layerskip.check_zero_stage(with_dropout, 2)  # ZeRO-2 and no DeepSpeed take it
    layerskip.check_zero_stage(with_dropout, None)
    with_lora = dataclasses.replace(with_dropout, layer_dropout=dataclasses.replace(base.layer_dropout, p_max=0.0),
                                    lora=dataclasses.replace(base.lora, enabled=True))
    with pytest.raises(UserError, match="LoRA with DeepSpeed ZeRO-3"):
        layerskip.check_zero_stage(with_lora, 3)


# ---------------------------------------------------------------- issue 49: numbers that are no settings, keys twice
NON_FINITE = ["keep_final:\n  kl_weight: .inf\n", "keep_final:\n  kl_weight: 1.0e+308\n", "optim:\n  lr: .inf\n",
              "optim:\n  lr: .nan\n", "early_exit:\n  e_scale: .inf\n", "early_exit:\n  e_scale: -.inf\n",
              "optim:\n  eps: 1e999\n", "lora:\n  alpha: 1.0e+39\n", "seed: 100000000000000000000000\n"]


@pytest.mark.parametrize("text", NON_FINITE)
def test_non_finite_and_overflowing_recipe_numbers_are_refused(text, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    with pytest.raises(UserError, match="finite|float32|2\\*\\*63"):
        load_config(recipe)


@pytest.mark.parametrize("override", ["keep_final.kl_weight=.inf", "keep_final.kl_weight=1e308", "optim.lr=.inf",
                                      "early_exit.e_scale=1e400", "data.val_fraction=.nan",
                                      "source.dedup_threshold=.nan"])
def test_non_finite_overrides_are_refused(override):
    if override.startswith("source."):
        override = "data.sources=[{type: stdlib, dedup_threshold: .nan}]"
    with pytest.raises(UserError, match="finite|float32"):
        load_config(None, [override])


def test_non_finite_numbers_are_refused_in_python_too():
    from train.config import EarlyExitConfig, KeepFinalConfig, OptimConfig

    for make in (lambda: KeepFinalConfig(kl_weight=float("inf")), lambda: OptimConfig(lr=float("nan")),
                 lambda: EarlyExitConfig(e_scale=1e300), lambda: OptimConfig(betas=[0.9, float("nan")])):
        with pytest.raises(UserError, match="finite|float32"):
            make()


def test_non_finite_recipe_is_one_line_on_the_command_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("keep_final: {kl_weight: .inf}\n")
    proc = subprocess.run([sys.executable, str(REPO / "train/layerskip.py"), "--config", str(recipe)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "kl_weight" in proc.stderr and "finite" in proc.stderr


@pytest.mark.parametrize("text, key", [
    ("optim:\n  lr: 1.0e-4\n  lr: 2.0e-4\n", "'lr'"),
    ("optim:\n  lr: 1.0e-4\nseed: 1\noptim:\n  max_steps: 3\n", "'optim'"),
    ("data:\n  sources:\n    - {type: stdlib, dedup: exact, dedup: near}\n", "'dedup'"),
])
def test_a_key_or_section_given_twice_is_refused(text, key, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    with pytest.raises(UserError, match=f"{key} is given twice"):
        load_config(recipe)


def test_an_override_holding_a_key_twice_is_refused():
    with pytest.raises(UserError, match="given twice"):
        load_config(None, ["data.sources=[{type: stdlib, dedup: exact, dedup: near}]"])


def test_a_deeply_nested_recipe_is_one_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(UserError, match="nested too deeply"):
        load_config(recipe)
