"""Self-SD plan search: search space, replay, planted optimum, reproducibility, resume, plan files, CLI errors."""

import dataclasses
import json
import random

import optuna
import pytest
import torch

from infer.drafters.chain import PlanForward
from infer.model.plan import LayerPlan, PlanFile, PlanSpace, weights_cost
from infer.model.runner import Runner
from infer.selfsd.search import SearchConfig, open_study, run_search, search_plan
from infer.selfsd.search_objectives import ModelObjective, calibration_set, measure_cost, replay
from layerskip_cli.main import main
from layerskip_core.errors import UserError
from tiny_models import make_model

PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 250, 17], [42] * 12 + [7, 8]]


@pytest.fixture(scope="module")
def runner():
    return Runner.from_model(make_model("llama", seed=0, layers=6))


def hamming_objective(target: LayerPlan):
    """A synthetic objective with its unique optimum at ``target``."""

    def evaluate(plan: LayerPlan):
        miss = len(plan.skip_attn ^ target.skip_attn) + len(plan.skip_mlp ^ target.skip_mlp)
        return -float(miss), {"miss": miss}

    return evaluate


def search(evaluate, num_layers, **cfg):
    cfg = SearchConfig(**cfg)
    study = open_study(None, cfg.study_settings())
    return run_search(evaluate, PlanSpace(num_layers, cfg.skip_ratio), cfg, study, progress=False), study


# --------------------------------------------------------------------------- space and replay
@pytest.mark.parametrize("ratio", [None, 0.25])
def test_enqueued_params_give_back_the_plan(ratio):
    space = PlanSpace(8, ratio)
    plans = space.uniform_plans()
    assert plans and len(set(plans)) == len(plans)
    study = optuna.create_study(direction="maximize")
    for plan in plans:
        study.enqueue_trial(space.params(plan))
    got = []
    study.optimize(lambda t: got.append(space.suggest(t)) or 0.0, n_trials=len(plans))
    assert got == plans
    for plan in plans:
        assert not plan.is_full and not ({0, 7} & (plan.skip_attn | plan.skip_mlp))  # first/last layers kept
        if ratio is not None:
            assert plan.num_skipped == 4


def test_uniform_plans_on_a_30_layer_model():
    plans = PlanSpace(30).uniform_plans()
    assert len(plans) == 9
    assert sorted({round(p.skip_ratio, 2) for p in plans}) == [0.15, 0.3, 0.45]
    assert any(not p.skip_mlp for p in plans) and any(not p.skip_attn for p in plans)


def test_skip_ratio_that_skips_nothing_is_refused():
    with pytest.raises(UserError, match="skips 0 of the 8 sublayers"):
        PlanSpace(4, 0.05)


def test_replay_of_chain_drafting():
    G = 13
    tokens, drafted, accepted, cycles = replay([True] * G, [1.0] * G, k=3, gamma=0.5)
    assert (tokens, drafted, accepted) == (12, 9, 9) and cycles == [(3, 4)] * 3
    tokens, drafted, accepted, cycles = replay([False] * G, [1.0] * G, k=3, gamma=0.5)
    assert tokens == 12 and accepted == 0 and len(cycles) == 12
    # below the threshold the token is still proposed, then the chain stops (Self-SD)
    tokens, drafted, accepted, cycles = replay([True] * G, [0.1] * G, k=3, gamma=0.5)
    assert cycles[0] == (1, 2) and accepted == drafted


# --------------------------------------------------------------------------- the optimiser
@pytest.mark.parametrize("target,ratio,trials", [
    (LayerPlan(8, frozenset({2, 5}), frozenset({1, 4, 6})), None, 80),  # 1 of 65536 plans
    (LayerPlan(6, frozenset({1, 4}), frozenset({0, 3})), 4 / 12, 60),  # 1 of the 495 plans that skip 4 of 12
], ids=["free", "skip-ratio"])
def test_search_finds_a_planted_optimum(target, ratio, trials):
    result, study = search(hamming_objective(target), target.num_layers, trials=trials, seed=0, skip_ratio=ratio)
    assert result.plan == target and result.value == 0.0
    assert result.completed == len(result.history) <= trials and result.proposals == len(study.trials)
    assert result.history == sorted(result.history) and result.history[-1] == 0.0
    if ratio is not None:
        assert all(len(t.user_attrs["plan"]["skip_attn"]) + len(t.user_attrs["plan"]["skip_mlp"]) == 4
                   for t in study.trials)


def test_search_is_reproducible_with_a_seed():
    target = LayerPlan(6, frozenset({1}), frozenset({3, 4}))
    runs = [search(hamming_objective(target), 6, trials=25, seed=s)[1] for s in (3, 3, 4)]
    params = [[t.params for t in study.trials] for study in runs]
    assert params[0] == params[1]
    assert params[0] != params[2]


def test_gp_sampler_runs_and_is_seeded():
    target = LayerPlan(4, frozenset({1}), frozenset({2}))
    a, sa = search(hamming_objective(target), 4, trials=14, seed=0, sampler="gp", warm_start=False)
    b, sb = search(hamming_objective(target), 4, trials=14, seed=0, sampler="gp", warm_start=False)
    assert [t.params for t in sa.trials] == [t.params for t in sb.trials]
    assert a.value >= -2


def test_identical_plans_are_evaluated_once():
    calls = []

    def evaluate(plan):
        calls.append(plan)
        return float(len(plan.skip_attn)), {}

    result, study = search(evaluate, 2, trials=16, seed=0, warm_start=False)  # all 16 plans of 2 layers
    assert len(calls) == len(set(calls)) == result.completed == 16
    assert result.proposals == len(study.trials) > 16  # the sampler repeated itself; repeats were free
    assert sum(1 for t in study.trials if t.user_attrs.get("repeat")) == result.proposals - 16


# --------------------------------------------------------------------------- the model objective
@pytest.fixture(scope="module")
def calibration(runner):
    return calibration_set(runner, PROMPTS, 20)


def test_teacher_forced_agreement_is_a_draft_on_exact_kv(runner, calibration):
    """Each position is scored as a real draft after a verification: exact KV for every earlier token."""
    objective = ModelObjective(runner, calibration, weights_cost(runner.spec, 5), 4)
    rng = random.Random(0)
    plans = [LayerPlan.full(6), LayerPlan(6, frozenset({0})), LayerPlan(6, frozenset({1, 2, 4}), frozenset({3}))] + [
        LayerPlan(6, frozenset(i for i in range(6) if rng.random() < 0.3),
                  frozenset(i for i in range(6) if rng.random() < 0.3))
        for _ in range(3)]
    item = calibration[0]
    seq = item.prompt + item.continuation
    n, w = len(seq) - 1, len(item.continuation)
    for plan in plans:
        agree, top1 = objective.agreement(plan)
        assert len(agree[0]) == len(top1[0]) == w and all(0 < x <= 1 for x in top1[0])
        for i in (0, w // 2, w - 1):  # window position i drafts seq[n - w + i] -> seq[n - w + i + 1]
            pos = n - w + i
            cache = runner.new_cache(128)
            runner.forward(cache, torch.tensor(seq[:pos]))  # the verified context, exact in every layer
            _, logits = PlanForward(runner, plan)(cache, torch.tensor([seq[pos]]), pos)  # (1, V)
            p, arg = torch.softmax(logits, -1).max(-1)
            assert top1[0][i] == pytest.approx(float(p), abs=1e-5)
            assert agree[0][i] == (int(arg) == seq[pos + 1])
    assert all(all(a) for a in objective.agreement(LayerPlan.full(6))[0])


def test_model_objective_values(runner, calibration):
    objective = ModelObjective(runner, calibration, weights_cost(runner.spec, 5), 4)
    value, metrics = objective(LayerPlan.full(6))  # exact but as costly as the model: no gain
    assert value == pytest.approx(1.0) and metrics["acceptance_rate"] == 1.0 and metrics["matchness"] == 1.0
    value, metrics = objective(LayerPlan(6, frozenset(range(6)), frozenset(range(6))))
    assert 0 < value < 1.0 and metrics["draft_cost"] < 0.5
    assert set(metrics) >= {"k", "gamma", "acceptance_rate", "tokens_per_verify", "expected_speedup"}


def test_measured_cost_model(runner):
    cost = measure_cost(runner, PROMPTS[2], 5, repeats=3)
    assert cost.source == "measured" and len(cost.verify) == 5 and cost.verify[0] == 1.0
    assert 0 < cost.base < 1 and cost.attn >= 0 and cost.mlp >= 0
    full = LayerPlan.full(6)
    assert cost.draft(LayerPlan(6, frozenset({1}))) <= cost.draft(full)


# --------------------------------------------------------------------------- search_plan: files, seeds, resume
CFG = dict(trials=12, seed=7, cost="weights", n_prompts=3, max_new_tokens=16, num_draft=4)


def test_search_on_a_tiny_model_is_reproducible_and_writes_the_plan(runner, tmp_path):
    cfg = SearchConfig(**CFG)
    r1, pf1 = search_plan(runner, PROMPTS, cfg, tmp_path / "a.json", "tiny", tmp_path / "a.study.log",
                          progress=False)
    r2, _ = search_plan(runner, PROMPTS, SearchConfig(**CFG), tmp_path / "b.json", "tiny", None, progress=False)
    assert (r1.plan, r1.value, r1.history) == (r2.plan, r2.value, r2.history)
    loaded = PlanFile.load(tmp_path / "a.json")
    loaded.check_model(runner.identity())
    assert loaded.plan == r1.plan and loaded.task == "tiny" and loaded.source == "self_sd"
    assert loaded.objective["name"] == "model" and loaded.objective["value"] == pytest.approx(r1.value)
    for key in ("sampler", "seed", "trials", "wall_time_s", "trial_time_s", "cost_model", "skip_ratio", "prompts"):
        assert key in loaded.search
    assert loaded.search["trials"] == 12 and loaded.search["seed"] == 7
    assert not list(tmp_path.glob(".*.tmp"))


def test_interrupted_search_resumes(runner, tmp_path):
    out, study = tmp_path / "p.json", tmp_path / "p.study.log"
    first, _ = search_plan(runner, PROMPTS, SearchConfig(**CFG | {"trials": 10}), out, "tiny", study, progress=False)
    assert first.completed == 10
    resumed, _ = search_plan(runner, PROMPTS, SearchConfig(**CFG | {"trials": 14}), out, "tiny", study,
                             progress=False)
    assert resumed.completed == 14 and resumed.value >= first.value
    trials = open_study(study, {**SearchConfig(**CFG).study_settings(), "model": runner.identity(), "task": "tiny",
                                "prompts": 3}).trials
    assert sum(1 for t in trials if t.user_attrs.get("warm_start")) == len(PlanSpace(6).uniform_plans())
    with pytest.raises(UserError, match="other settings.*max_new_tokens"):
        search_plan(runner, PROMPTS, SearchConfig(**CFG | {"max_new_tokens": 8}), out, "tiny", study, progress=False)
    fresh, _ = search_plan(runner, PROMPTS, SearchConfig(**CFG | {"max_new_tokens": 8, "trials": 3}), out, "tiny",
                           study, fresh=True, progress=False)
    assert fresh.completed == 3


def test_model_objective_finds_planted_redundant_sublayers(tmp_path):
    """Zeroed output projections make three sublayers no-ops: skipping exactly them is exact and cheaper."""
    model = make_model("llama", seed=0, layers=6)
    with torch.no_grad():
        for i in (2, 3):
            model.model.layers[i].self_attn.o_proj.weight.zero_()
        model.model.layers[4].mlp.down_proj.weight.zero_()
    runner = Runner.from_model(model)
    cfg = SearchConfig(trials=80, seed=0, cost="weights", n_prompts=3, max_new_tokens=16, num_draft=4)
    result, plan_file = search_plan(runner, PROMPTS, cfg, tmp_path / "p.json", "tiny", None, progress=False)
    assert result.plan == LayerPlan(6, frozenset({2, 3}), frozenset({4}))
    assert result.attrs["acceptance_rate"] == 1.0 and result.value > 1.15
    from infer.decode.engine import DecodeConfig, Engine
    from infer.drafters import build_drafter

    gen = DecodeConfig(max_new_tokens=30)
    drafted = Engine(runner, build_drafter("self_sd", runner, {"plan": str(tmp_path / "p.json")})).generate(
        PROMPTS[0], gen)
    plain = Engine(runner, build_drafter("autoregressive", runner)).generate(PROMPTS[0], gen)
    assert drafted.tokens == plain.tokens and drafted.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("reference", ["interleaved", "once"])
def test_speed_objective(runner, tmp_path, reference):
    cfg = SearchConfig(objective="speed", trials=3, n_prompts=1, max_new_tokens=8, num_draft=3, warm_start=False,
                       speed_reference=reference)
    result, plan_file = search_plan(runner, PROMPTS[:1], cfg, tmp_path / "s.json", "tiny", None, progress=False)
    assert result.value > 0 and plan_file.objective["name"] == "speed"
    assert {"speedup", "tokens_per_second", "acceptance_rate", "tokens_per_verify", "final_confidence"} <= set(
        plan_file.objective)
    expect = plan_file.objective["speedup"] if reference == "interleaved" else plan_file.objective["tokens_per_second"]
    assert result.value == pytest.approx(expect)
    assert plan_file.search["autoregressive_tokens_per_second_at_start"] > 0


def test_speed_objective_drafts_as_the_reference_search(runner, monkeypatch):
    """searching.py decodes with decoding.py's defaults: k = 8 and gamma from 0.8 (adaptive) on every prompt."""
    import infer.selfsd.search as search_module
    import infer.selfsd.search_objectives as objectives_module

    assert SearchConfig(objective="speed").num_draft == 8 and SearchConfig(objective="model").num_draft == 12
    assert SearchConfig(objective="speed", num_draft=5).num_draft == 5
    built = []
    drafter_class = objectives_module.SelfSDDrafter

    def record(runner, config, inputs):
        built.append(config)
        return drafter_class(runner, config, inputs)

    monkeypatch.setattr(objectives_module, "SelfSDDrafter", record)
    cfg = SearchConfig(objective="speed", trials=1, n_prompts=2, max_new_tokens=8, warm_start=False)
    objective, _ = search_module.build_objective(runner, PROMPTS[:2], cfg)
    value, metrics = objective(LayerPlan(6, frozenset({2})))
    assert value > 0 and len(built) == 1
    config = built[0]
    assert (config.num_draft, config.confidence, config.adapt_confidence, config.carry_confidence) == (
        8, 0.8, True, False)


def test_config_defaults_and_no_kept_aliases():
    with pytest.raises(UserError, match="unknown objective 'acceptance'; choose model or speed"):
        SearchConfig(objective="acceptance")
    assert SearchConfig(objective="model").max_new_tokens == 64
    assert SearchConfig(objective="speed").max_new_tokens == 32
    assert "trials" not in SearchConfig().study_settings()
    assert dataclasses.replace(SearchConfig(), trials=5).trials == 5


# --------------------------------------------------------------------------- CLI
@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "calib.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def add(a, b):", "hello there", "x = 1"]))
    return path


def test_search_cli_writes_a_usable_plan(capsys, tiny_model_dir, prompts_file, tmp_path):
    out = tmp_path / "plans" / "tiny.json"
    argv = ["search", "--model", str(tiny_model_dir), "--data", str(prompts_file), "--trials", "6", "--out", str(out),
            "--cost", "weights", "--n", "2", "--max-new-tokens", "8", "--quiet"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out) and "best of 6 trials" in captured.err
    assert (tmp_path / "plans" / "tiny.study.log").is_file()
    plan_file = PlanFile.load(out)
    assert plan_file.task == "calib" and plan_file.search["prompt_ids"] == ["0", "1"]
    assert main(argv) == 2  # the plan is neither overwritten nor its search continued without being asked
    assert "exists; pass --resume to continue its search, or --force" in capsys.readouterr().err
    assert main(argv[:-1] + ["--skip-ratio", "0.25", "--quiet", "--resume"]) == 2  # resuming with other settings
    err = capsys.readouterr().err
    assert "other settings" in err and "--force" in err and len(err.strip().splitlines()) == 1


def test_search_cli_resumes_with_resume_reusing_the_calibration_and_starts_over_with_force(
        capsys, tiny_model_dir, prompts_file, tmp_path, monkeypatch):
    out = tmp_path / "p.json"
    assert main(["search", "--model", str(tiny_model_dir), "--data", str(prompts_file), "--trials", "3", "--out",
                 str(out), "--n", "2", "--max-new-tokens", "8", "--quiet"]) == 0  # measured costs, stored
    first = PlanFile.load(out).search["cost_model"]

    def no_calibration(*args, **kwargs):
        raise AssertionError("a resumed search calibrated again")

    monkeypatch.setattr("infer.selfsd.search.calibration_set", no_calibration)
    monkeypatch.setattr("infer.selfsd.search.measure_cost", no_calibration)
    assert main(search_argv(tiny_model_dir, prompts_file, out, "--trials", "5", "--cost", "measured",
                            "--resume")) == 0
    resumed = PlanFile.load(out).search
    assert resumed["trials"] == 5 and resumed["cost_model"] == first  # the costs measured by the first run
    monkeypatch.undo()
    assert main(search_argv(tiny_model_dir, prompts_file, out, "--force")) == 0  # starts over: 3 trials, not 5
    assert PlanFile.load(out).search["trials"] == 3
    capsys.readouterr()


@pytest.mark.parametrize("flags,message", [
    (["--resume"], "there is no study"),
    (["--resume", "--force"], "pass one of them"),
    ([], "pass --resume to continue it, or --force to start over"),
])
def test_search_cli_resume_and_force_refusals(capsys, tiny_model_dir, prompts_file, tmp_path, flags, message):
    out = tmp_path / "p.json"
    if not flags:  # an interrupted search: its study, no plan yet
        (tmp_path / "p.study.log").write_text("")
    code = main(search_argv(tiny_model_dir, prompts_file, out, *flags))
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize("args,message", [
    (["--trials", "0"], "--trials must be >= 1"),
    (["--skip-ratio", "1.5"], "--skip-ratio must be in (0, 1)"),
    (["--skip-ratio", "0.01"], "skips 0 of the 8 sublayers"),
    (["--objective", "fastest"], "unknown objective 'fastest'"),
    (["--sampler", "cmaes"], "unknown sampler 'cmaes'"),
    (["--cost", "guess"], "unknown cost model 'guess'"),
    (["--speed-reference", "never"], "unknown speed reference 'never'"),
    (["--timeout", "0"], "--timeout must be > 0"),
    (["--n", "0"], "--n must be >= 1"),
    (["--data", "/no/such/set"], "unknown prompt source"),
    (["--out", "plan.txt"], "should be a .json file"),
    (["--model", "/definitely/not/here"], "does not exist"),
])
def test_search_cli_bad_input_is_one_clear_line(capsys, tiny_model_dir, prompts_file, tmp_path, args, message):
    argv = ["search", "--model", str(tiny_model_dir), "--data", str(prompts_file), "--out", str(tmp_path / "p.json"),
            "--trials", "2", "--cost", "weights", "--n", "2", "--quiet"]
    for i in range(0, len(args), 2):  # later flags override earlier ones
        argv += args[i:i + 2]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def search_argv(model_dir, data, out, *extra):
    return ["search", "--model", str(model_dir), "--data", str(data), "--trials", "3", "--out", str(out),
            "--cost", "weights", "--n", "2", "--max-new-tokens", "8", "--quiet", *extra]


def test_search_out_below_a_file_is_one_line(capsys, tiny_model_dir, prompts_file, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    code = main(search_argv(tiny_model_dir, prompts_file, afile / "p.json"))
    err = capsys.readouterr().err
    assert code == 2 and "--out" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("damage", ["garbage", "cut"])
def test_damaged_study_journal_says_pass_force(capsys, tiny_model_dir, prompts_file, tmp_path, damage):
    out = tmp_path / "p.json"
    assert main(search_argv(tiny_model_dir, prompts_file, out)) == 0
    journal = tmp_path / "p.study.log"
    text = journal.read_bytes()
    journal.write_bytes(b"\x00garbage{{\n" if damage == "garbage" else text[:len(text) // 2])
    capsys.readouterr()
    code = main(search_argv(tiny_model_dir, prompts_file, out, "--resume"))
    err = capsys.readouterr().err
    assert code == 2 and "--force" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert main(search_argv(tiny_model_dir, prompts_file, out, "--force")) == 0


def test_a_killed_search_leaves_no_lock_that_stalls_the_rerun(capsys, tiny_model_dir, prompts_file, tmp_path,
                                                               monkeypatch):
    import os

    from optuna.storages.journal import _file

    out = tmp_path / "p.json"
    assert main(search_argv(tiny_model_dir, prompts_file, out)) == 0
    lock = tmp_path / "p.study.log.lock"
    os.symlink(tmp_path / "p.study.log", lock)  # what a search killed while writing leaves behind
    os.utime(lock, (1e9, 1e9), follow_symlinks=False)

    def no_waiting(seconds):
        raise AssertionError("optuna waited for a stale lock")

    monkeypatch.setattr(_file.time, "sleep", no_waiting)
    assert main(search_argv(tiny_model_dir, prompts_file, out, "--trials", "4", "--resume")) == 0
    assert not lock.exists() and not lock.is_symlink()
