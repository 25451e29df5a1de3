"""Skip plans: `layerskip plan import/show` (published skip sets become plan files tied to a model; bad plan files are
one line), the one search space and uniform-plan builder shared by `layerskip search` and SWIFT."""

import json
import random

import pytest

from infer.drafters.swift_search import LayerSetSearch
from infer.model.plan import LayerPlan, PlanFile, PlanSpace, uniform_plan
from layerskip_cli.main import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err, message):
    assert code == 2 and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def generate(capsys, model_dir, *drafter):
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--prompt", "def add(a, b):",
                         "--max-new-tokens", "24", "--threads", "1", "--json", *drafter)
    assert code == 0, err
    return json.loads(out)["tokens"]


def test_imported_plan_round_trip_decodes_losslessly_with_self_sd(capsys, tiny_model_dir, tmp_path):
    out = tmp_path / "p.json"
    code, stdout, err = run(capsys, "plan", "import", "--model", str(tiny_model_dir), "--attn", "1,2", "--mlp", "3",
                            "--out", str(out))
    assert code == 0, err
    assert stdout.strip() == str(out)
    plan_file = PlanFile.load(out)
    assert plan_file.plan == LayerPlan(4, frozenset({1, 2}), frozenset({3})) and plan_file.source == "import"
    code, shown, _ = run(capsys, "plan", "show", str(out))
    assert code == 0 and "attn[1,2] mlp[3]" in shown and "llama with 4 layers" in shown
    plain = generate(capsys, tiny_model_dir)
    assert generate(capsys, tiny_model_dir, "--drafter", "self_sd", "--plan", str(out)) == plain


def test_import_from_self_sd_and_swift_style_json(capsys, tiny_model_dir, tmp_path):
    self_sd = tmp_path / "skip_layers.json"
    sets = {"tiny-a": {"attention": [0, 3], "mlp": [2]}, "tiny-b": {"attention": [1], "mlp": []}}
    self_sd.write_text(json.dumps(sets))
    out = tmp_path / "a.json"
    imp = ("plan", "import", "--model", str(tiny_model_dir))
    code, _, err = run(capsys, *imp, "--from", str(self_sd), "--out", str(out))
    one_line_error(code, err, "--entry tiny-a")
    assert run(capsys, "plan", "import", "--model", str(tiny_model_dir), "--from", str(self_sd), "--entry", "tiny-b",
               "--out", str(out))[0] == 0
    assert PlanFile.load(out).plan == LayerPlan(4, frozenset({1}))
    swift = tmp_path / "swift.json"
    swift.write_text(json.dumps({"attn_skip_layer_id_set": [2], "mlp_skip_layer_id_set": [1, 2]}))
    code, _, err = run(capsys, *imp, "--from", str(swift), "--out", str(out))
    one_line_error(code, err, "exists; pass --force")  # nothing silently overwritten
    assert run(capsys, "plan", "import", "--model", str(tiny_model_dir), "--from", str(swift), "--out", str(out),
               "--force")[0] == 0
    assert PlanFile.load(out).plan == LayerPlan(4, frozenset({2}), frozenset({1, 2}))


@pytest.mark.parametrize("args,message", [
    (["--attn", "1,9"], "out of range"),
    (["--attn", "1,x"], "comma-separated layer numbers"),
    ([], "nothing to import"),
    (["--attn", "1", "--from", "x.json"], "not both"),
    (["--from", "/no/such.json"], "does not exist"),
])
def test_import_bad_input_is_one_clear_line(capsys, tiny_model_dir, tmp_path, args, message):
    code, _, err = run(capsys, "plan", "import", "--model", str(tiny_model_dir), "--out", str(tmp_path / "p.json"),
                       *args)
    one_line_error(code, err, message)
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("content,message", [
    ("[1, 2]", "JSON list, not an object"),
    (json.dumps({"format": "layerskip-plan/1", "model": "smollm2", "plan": {"num_layers": 4}}), "'model' must be"),
    (json.dumps({"format": "layerskip-plan/1", "model": {}, "plan": [1]}), "'plan' must be"),
    ("{oops", "not a valid plan file"),
])
def test_bad_plan_files_are_one_line_everywhere(capsys, tiny_model_dir, tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    code, _, err = run(capsys, "plan", "show", str(path))
    one_line_error(code, err, message)
    for drafter in ("self_sd", "swift"):
        code, _, err = run(capsys, "generate", "--model", str(tiny_model_dir), "--prompt", "hi",
                           "--max-new-tokens", "4", "--drafter", drafter, "--plan", str(path))
        one_line_error(code, err, message)


# --------------------------------------------------------------------------- search space and uniform plans
@pytest.mark.parametrize("num_layers,n_skip,kinds", [(10, 7, ("attn", "mlp")), (30, 25, ("attn", "mlp")),
                                                     (12, 4, ("attn",)), (12, 10, ("mlp",))])
def test_uniform_plan_spreads_skips_evenly_and_keeps_the_ends(num_layers, n_skip, kinds):
    plan = uniform_plan(num_layers, n_skip, kinds)
    assert plan.num_skipped == n_skip and not ({0, num_layers - 1} & (plan.skip_attn | plan.skip_mlp))
    if "attn" not in kinds:
        assert not plan.skip_attn
    if "mlp" not in kinds:
        assert not plan.skip_mlp
    slots = [(kind, layer) for layer in range(1, num_layers - 1) for kind in kinds]
    chosen = [j for j, (kind, layer) in enumerate(slots)
              if layer in (plan.skip_attn if kind == "attn" else plan.skip_mlp)]
    gaps = {b - a for a, b in zip(chosen, chosen[1:], strict=False)}
    assert max(gaps) - min(gaps) <= 1  # evenly spread


def test_swift_optimises_in_the_search_space_of_layerskip_search():
    """One encoding: a SWIFT candidate's optuna parameters are `layerskip search`'s, restricted to layers 1..L-2."""
    swift = LayerSetSearch(num_layers=10, skip_ratio=0.45, bo_interval=3, seed=0)
    full = PlanSpace(10)
    assert isinstance(swift.space, PlanSpace) and set(swift.space.names) < set(full.names)
    assert not {"attn.0", "mlp.0", "attn.9", "mlp.9"} & set(swift.space.names)
    rng = random.Random(0)
    for _ in range(20):
        plan, trial = swift.propose()
        params = swift.space.params(plan)
        assert swift.space.decode(params) == plan and full.decode(full.params(plan)) == plan
        assert all(full.params(plan)[name] == value for name, value in params.items())
        swift.record(plan, trial, rng.random())
    assert all(set(t.params) == set(swift.space.names) for t in swift.study.trials)


@pytest.mark.parametrize("everything", [False, True])
def test_exact_count_repair_never_skips_the_kept_ends(everything):
    space = PlanSpace(8, keep_ends=True, n_skip=5)
    plan = space.decode(dict.fromkeys(space.names, everything))
    assert plan.num_skipped == 5 and not ({0, 7} & (plan.skip_attn | plan.skip_mlp))
