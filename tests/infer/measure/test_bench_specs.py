"""bench checks every model x drafter spec before timing anything, names models apart, and marks rows whose speed-up
measures no drafting (never drafted, too few samples); generate's text output says when no step drafted."""

import json
import shutil

import pytest

from infer.decode.engine import Engine, GenerationStats
from infer.measure.bench import Record
from infer.measure.methods import model_labels
from infer.measure.report import markdown_table, recommend, summarize
from infer.model.plan import LayerPlan, PlanFile
from infer.model.runner import Runner
from layerskip_cli.main import main
from layerskip_core.errors import UserError


@pytest.fixture
def two_finals(tiny_model_dir, tmp_path):
    """Two copies of the tiny model in folders that share their last name, as two training runs' final/."""
    a, b = tmp_path / "runs" / "a" / "final", tmp_path / "runs" / "b" / "final"
    shutil.copytree(tiny_model_dir, a)
    shutil.copytree(tiny_model_dir, b)
    return a, b


def bench(models, prompts_file, out, drafters):
    argv = ["bench", "--drafters", drafters, "--peers", "none", "--data", str(prompts_file), "--n", "1",
            "--max-new-tokens", "6", "--repeats", "1", "--out", str(out), "--quiet"]
    for m in models:
        argv += ["--model", str(m)]
    return main(argv)


def test_models_whose_folders_share_a_name_get_rows_of_their_own(two_finals, prompts_file, tmp_path):
    a, b = two_finals
    assert model_labels([str(a), str(b)]) == ["a/final", "b/final"]
    assert model_labels(["default", f"trained={a}"]) == ["default", "trained"]
    assert model_labels([f"final={b}", str(a)]) == ["final", "a/final"]
    with pytest.raises(UserError, match="both named 'x'"):
        model_labels([f"x={a}", f"x={b}"])
    assert bench([a, b], prompts_file, tmp_path / "out", "autoregressive") == 0
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["summary"]
    assert sorted(r["model"] for r in rows) == ["a/final", "b/final"]


def test_a_plan_that_fits_one_model_only_is_refused_before_anything_is_timed(two_finals, prompts_file, tmp_path,
                                                                              monkeypatch, capsys):
    a, b = two_finals
    plans = tmp_path / "plans"
    plans.mkdir()
    identity = Runner.from_pretrained(a).identity()
    PlanFile(LayerPlan(4, frozenset({2}), frozenset({3})), identity, task="t").save(plans / "a.json")
    generated = []
    monkeypatch.setattr(Engine, "generate", lambda self, *a, **k: generated.append(1))
    drafters = f"autoregressive,self_sd:plan={plans}/{{model}}.json"
    code = bench([f"a={a}", f"b={b}"], prompts_file, tmp_path / "out", drafters)
    err = capsys.readouterr().err
    assert code == 2 and "model 'b'" in err and "b.json does not exist" in err
    assert not generated and not (tmp_path / "out" / "results.json").exists()  # nothing ran, nothing written


def records(method: str, drafted: int, n: int) -> list[Record]:
    stats = dict(new_tokens=10, wall_time=1.0, verify_calls=9, drafted=drafted, accepted=drafted // 2)
    return [Record("m", "t", method, str(i), 0, GenerationStats(**stats)) for i in range(n)]


def test_rows_that_never_drafted_or_have_too_few_samples_are_marked_not_ranked():
    recs = records("autoregressive", 0, 4) + records("swift", 0, 4) + records("early_exit:E=2", 8, 4) + \
        records("self_sd:plan=p", 8, 1)
    rows = {r.method: r for r in summarize(recs)}
    assert rows["swift"].note == "never drafted" and rows["autoregressive"].note is None
    assert rows["self_sd:plan=p"].note == "too few samples" and rows["early_exit:E=2"].note is None
    table = markdown_table(list(rows.values()))
    assert "| m | swift | 10.0 | 1.00x (never drafted) |" in table  # the measured ratio beside the note
    assert "| 1.00x (too few samples) |" in table
    swift_row = next(line for line in table.splitlines() if "| swift |" in line).split(" | ")
    assert swift_row[9] == "–"  # no expected speed-up from a cost model of plain steps
    assert recommend(list(rows.values())) == {("m", "t"): "autoregressive"}  # equal speed; marked rows not ranked


def test_the_baseline_with_too_few_samples_is_marked_like_its_peers():
    rows = {r.method: r for r in summarize(records("autoregressive", 0, 1) + records("early_exit:E=2", 8, 1))}
    assert rows["autoregressive"].note == rows["early_exit:E=2"].note == "too few samples"


def test_generate_says_when_no_step_drafted(tiny_model_dir, capsys):
    code = main(["generate", "--model", str(tiny_model_dir), "--prompt", "def add(a, b):", "--drafter", "swift",
                 "--max-new-tokens", "3", "--threads", "1"])
    err = capsys.readouterr().err
    assert code == 0 and "never drafted: every step was a plain step" in err


def test_quant_self_beside_an_early_exit_gets_the_default_peers():
    """quant_self's exit is unset (the model's depth): the default peers name transformers' assistant at the early
    exits that were given only (before: sorting None beside 8 raised a TypeError, so the bench could not start)."""
    from infer.measure.methods import parse_methods

    labels = [m.label for m in parse_methods("quant_self,early_exit:E=8:k=4", None)]
    assert "hf_early_exit:E=8" in labels and not any("None" in label for label in labels)
