"""The one strict reader of the project's JSON files: every kind of file refuses deep nesting, non-finite numbers and
fractional or boolean indices in one line naming the file (issue 27)."""

import json
import subprocess
import sys

import pytest

from infer.model.plan import PLAN_FORMAT, LayerPlan, PlanFile
from layerskip_cli.main import main
from layerskip_core import jsonfile
from layerskip_core.draft_vocab import DraftVocab, TokenCounts
from layerskip_core.errors import UserError

DEEP = "[" * 100_000 + "]" * 100_000
MODEL = {"model_type": "llama", "num_layers": 4, "hidden_size": 8, "vocab_size": 320, "weight_fingerprint": "x"}


def plan_text(plan: str = '{"num_layers": 4, "skip_attn": [1], "skip_mlp": [2]}') -> str:
    return f'{{"format": "{PLAN_FORMAT}", "model": {json.dumps(MODEL)}, "plan": {plan}}}'


def vocab_text(ids: str = "[1, 2, 3]") -> str:
    return f'{{"format": "layerskip-draft-vocab/1", "model": {json.dumps(MODEL)}, "ids": {ids}}}'


def counts_text(rows: str = "[[1, 5, 0], [2, 3, 1]]") -> str:
    return (f'{{"format": "layerskip-token-counts/1", "model": {json.dumps(MODEL)}, "special_ids": [0], '
            f'"counts": {rows}}}')


LOADERS = {"plan file": PlanFile.load, "draft vocabulary file": DraftVocab.load, "token counts file": TokenCounts.load}


@pytest.mark.parametrize("text", [DEEP, '{"a": ' * 5000 + "1" + "}" * 5000])
def test_deep_nesting_is_refused_before_parsing(text):
    with pytest.raises(ValueError, match="nested more than"):
        jsonfile.parse(text)


@pytest.mark.parametrize("text", ["NaN", "[Infinity]", '{"a": -Infinity}', "1e999", "[-1e999]"])
def test_non_finite_numbers_are_refused(text):
    with pytest.raises(ValueError, match="finite numbers only"):
        jsonfile.parse(text)


def test_brackets_inside_strings_do_not_count_as_nesting():
    assert jsonfile.parse(json.dumps({"s": "[" * 1000 + '\\"{'})) == {"s": "[" * 1000 + '\\"{'}


@pytest.mark.parametrize("value", [3.7, 3.0, True, "3", None])
def test_an_integer_field_refuses_what_is_not_an_integer(value):
    with pytest.raises(ValueError, match="must be an integer"):
        jsonfile.integer(value, "n")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), True, "0.7"])
def test_a_number_field_refuses_what_is_not_a_finite_number(value):
    with pytest.raises(ValueError, match="n "):
        jsonfile.number(value, "n")


@pytest.mark.parametrize("kind", list(LOADERS))
@pytest.mark.parametrize("content", [DEEP, '{"format": NaN}', '{"model": {"num_layers": 1e999}}'])
def test_every_file_kind_refuses_deep_or_non_finite_json_in_one_line(tmp_path, kind, content):
    path = tmp_path / "f.json"
    path.write_text(content)
    with pytest.raises(UserError, match=f"{path} is not a valid {kind}: not JSON") as e:
        LOADERS[kind](path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind,text", [
    ("plan file", plan_text('{"num_layers": 4, "skip_attn": [3.7, 2.2]}')),
    ("plan file", plan_text('{"num_layers": 4, "skip_mlp": [true]}')),
    ("plan file", plan_text('{"num_layers": 4.0, "skip_mlp": [1]}')),
    ("plan file", plan_text('{"num_layers": true}')),
    ("draft vocabulary file", vocab_text("[1.5, 2]")),
    ("draft vocabulary file", vocab_text("[true, 2]")),
    ("token counts file", counts_text("[[1, 5.5, 0]]")),
    ("token counts file", counts_text("[[false, 5, 0]]")),
])
def test_fractional_or_boolean_integers_are_refused_not_rounded(tmp_path, kind, text):
    path = tmp_path / "f.json"
    path.write_text(text)
    with pytest.raises(UserError, match=f"{path} is not a valid {kind}"):
        LOADERS[kind](path)


def test_a_good_plan_file_still_loads(tmp_path):
    path = tmp_path / "f.json"
    path.write_text(plan_text())
    assert PlanFile.load(path).plan == LayerPlan(4, frozenset({1}), frozenset({2}))


@pytest.mark.parametrize("attn", [[True], [1.5], ["1"], 3])
def test_layer_plan_refuses_booleans_fractions_and_strings(attn):
    with pytest.raises(ValueError):
        LayerPlan(4, attn)


def test_a_folder_given_as_a_file_says_so(tmp_path):
    with pytest.raises(UserError, match="is a folder"):
        PlanFile.load(tmp_path)


@pytest.mark.parametrize("content,message", [
    ('{"attention": [3.7, 5.2]}', "must be an integer, not 3.7"),
    ('{"mlp": [true]}', "must be an integer, not true"),
    (DEEP, "nested more than"),
    ('{"attention": [NaN]}', "finite numbers only"),
])
def test_plan_import_refuses_what_it_used_to_round(tmp_path, capsys, content, message):
    source = tmp_path / "skip.json"
    source.write_text(content)
    code = main(["plan", "import", "--from", str(source), "--out", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and str(source) in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("content", [DEEP, plan_text('{"num_layers": 4, "skip_attn": [true]}'), plan_text("[1]")])
def test_plan_show_refuses_a_bad_plan_in_one_line(tmp_path, capsys, content):
    path = tmp_path / "p.json"
    path.write_text(content)
    code = main(["plan", "show", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and f"{path} is not a valid plan file" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("marker", ['{"files": {"model.safetensors": [1]}}', '{"files": {"a": {"size": NaN}}}', DEEP,
                                    '{"files": []}'])
def test_a_damaged_model_marker_is_a_problem_not_a_crash(tmp_path, marker):
    from layerskip_core.models import COMPLETE_FILE, converted_folder_problem

    (tmp_path / COMPLETE_FILE).write_text(marker)
    assert "completion marker" in converted_folder_problem(tmp_path)


CUT_OFF = ['{"prompt": "' + "x" * 200_000, '{"a": "' + "word " * 40_000, '["' + '\\"' * 100_000,
           "[" * 60 + '"' + "[{" * 100_000, '{"a": "' + "ab\\" * 50_000, '{"a": "x\\u00' * 20_000]
"""Long texts whose last string is never closed."""


def test_cut_off_strings_are_refused_in_linear_time(tmp_path):
    """A string that is never closed once took exponential time in the depth count; a child process with a
    deadline, so a regression fails instead of hanging the suite."""
    for i, text in enumerate(CUT_OFF):
        (tmp_path / f"{i}.json").write_text(text)
    probe = ("import sys; from pathlib import Path; from layerskip_core import jsonfile, errors\n"
             "for path in sorted(Path(sys.argv[1]).glob('*.json')):\n"
             "    try:\n        jsonfile.read(path, 'plan file')\n    except errors.UserError:\n        continue\n"
             "    sys.exit(f'accepted the cut-off string in {path}')\n")
    proc = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("text", ['{"a": 1, "a": 2}', '{"m": {"num_layers": 4, "num_layers": 8}}',
                                  '[{"x": 1}, {"y": [{"k": 1, "k": 1}]}]'])
def test_duplicate_keys_are_refused_at_any_depth(text):
    with pytest.raises(ValueError, match="appears twice"):
        jsonfile.parse(text)


def test_equal_keys_in_different_objects_are_fine():
    assert jsonfile.parse('[{"a": 1}, {"a": 2}, {"b": {"a": 3}}]') == [{"a": 1}, {"a": 2}, {"b": {"a": 3}}]


@pytest.mark.parametrize("kind", list(LOADERS))
@pytest.mark.parametrize("data,message", [
    (b"\xef\xbb\xbf" + plan_text().encode(), "byte order mark"),
    (plan_text().replace('"x"', '"\xe9"').encode("latin-1"), "not UTF-8 text"),
    (plan_text().replace('"format"', '"format": 1, "format"').encode(), "appears twice"),
])
def test_every_file_kind_refuses_a_bom_non_utf8_or_duplicate_keys_in_one_line(tmp_path, kind, data, message):
    path = tmp_path / "f.json"
    path.write_bytes(data)
    with pytest.raises(UserError, match=message) as e:
        LOADERS[kind](path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
