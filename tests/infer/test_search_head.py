"""Plan search: one draft head per search (objectives, cost model, plan file, generate); the --paper GP-UCB search."""

import pytest

import infer.selfsd.search as search_module
import infer.selfsd.search_objectives as objectives_module
from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter
from infer.model.plan import LayerPlan, PlanFile, PlanSpace, weights_cost
from infer.model.runner import Runner
from infer.selfsd.search import SearchConfig, run_gp_ucb, search_plan
from infer.selfsd.search_objectives import ModelObjective, calibration_set
from layerskip_core.draft_vocab import DraftVocab
from tiny_models import make_model

PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 250, 17]]


@pytest.fixture(scope="module")
def runner():
    return Runner.from_model(make_model("llama", seed=0, layers=6))


@pytest.fixture(scope="module")
def vocab(runner):
    return DraftVocab(ids=tuple(range(0, 320, 2)), model=runner.identity())


def test_model_objective_scores_and_costs_with_the_search_head(runner, vocab):
    """The agreement and the draft cost both use the search's head (before: the full head, whatever generate used)."""
    calibration = calibration_set(runner, PROMPTS, 12)
    cost = weights_cost(runner.spec, 5)
    plan = LayerPlan(6, frozenset({2}), frozenset({3}))
    full = ModelObjective(runner, calibration, cost, 4)
    reduced = ModelObjective(runner, calibration, cost, 4, vocab)
    assert reduced(plan)[1]["draft_cost"] < full(plan)[1]["draft_cost"]
    odd = [t for item in calibration for t in item.continuation if t % 2]
    assert odd  # the subset misses some target tokens, so agreement must drop with it
    assert reduced.agreement(plan)[0] != full.agreement(plan)[0]


def test_the_plan_file_records_the_head_and_self_sd_drafts_with_it(runner, vocab, tmp_path):
    """Search with a reduced head writes its ids into the plan; self_sd with that plan drafts with them even when
    its own draft_vocab would resolve to another head (here 'auto': the full head on a model without counts)."""
    out = tmp_path / "p.json"
    cfg = SearchConfig(trials=4, cost="weights", n_prompts=2, max_new_tokens=8, num_draft=3, draft_vocab=vocab)
    search_plan(runner, PROMPTS, cfg, out, "tiny", None, progress=False)
    assert PlanFile.load(out).draft_ids == list(vocab.ids)
    drafter = build_drafter("self_sd", runner, {"plan": str(out)})
    assert drafter.vocab is not None and drafter.vocab.size == vocab.size
    gen = DecodeConfig(max_new_tokens=16)
    plain = Engine(runner, build_drafter("autoregressive", runner)).generate(PROMPTS[0], gen)
    out_sd = Engine(runner, drafter).generate(PROMPTS[0], gen)
    assert out_sd.tokens == plain.tokens and out_sd.stats.drafter.draft_vocab == vocab.size
    full = tmp_path / "full.json"
    search_plan(runner, PROMPTS, SearchConfig(**{**cfg.__dict__, "draft_vocab": "off"}), full, "tiny", None,
                progress=False)
    assert PlanFile.load(full).draft_head == {"vocab": "full"}
    assert build_drafter("self_sd", runner, {"plan": str(full), "draft_vocab": vocab}).vocab is None


def test_speed_objective_drafts_with_the_search_head(runner, vocab, monkeypatch):
    built = []
    drafter_class = objectives_module.SelfSDDrafter
    monkeypatch.setattr(objectives_module, "SelfSDDrafter", lambda r, c, i: built.append(i) or drafter_class(r, c, i))
    cfg = SearchConfig(objective="speed", trials=1, n_prompts=1, max_new_tokens=6, warm_start=False,
                       draft_vocab=vocab)
    objective, _ = search_module.build_objective(runner, PROMPTS[:1], cfg, vocab)
    objective(LayerPlan(6, frozenset({2})))
    assert built[0].vocab.ids.tolist() == list(vocab.ids)


def _hamming(target: LayerPlan):
    def evaluate(plan: LayerPlan):
        same = sum((i in plan.skip_attn) == (i in target.skip_attn) for i in range(target.num_layers))
        same += sum((i in plan.skip_mlp) == (i in target.skip_mlp) for i in range(target.num_layers))
        return float(same), {"same": same}
    return evaluate


def test_paper_search_is_gp_ucb_on_a_thresholded_point(monkeypatch):
    """--paper: GP-UCB with kappa 2.576 and alpha 1e-2 over [0,1]^2L, skip where a coordinate exceeds 0.5; it finds
    a planted optimum of 3 layers and is reproducible with a seed."""
    configs, points = [], []
    real = search_module.GPUCB

    class Recording(real):
        def __init__(self, dim, seed, config):
            configs.append((dim, config.kappa, config.noise))
            super().__init__(dim, seed, config)

        def suggest(self):
            points.append(super().suggest())
            return points[-1]

    monkeypatch.setattr(search_module, "GPUCB", Recording)
    target = LayerPlan(3, frozenset({1}), frozenset({0, 2}))
    space = PlanSpace(3, None)
    cfg = SearchConfig(paper=True, iterations=40, seed=1)
    evaluated = []
    hamming = _hamming(target)
    result = run_gp_ucb(lambda plan: evaluated.append(plan) or hamming(plan), space, cfg, progress=False)
    assert configs == [(6, 2.576, 1e-2)] and len(points) == 40
    assert result.plan == target and result.value == 6.0
    thresholded = [LayerPlan(3, frozenset(i for i in range(3) if p[i] > 0.5), frozenset(i for i in range(3)
                                                                                         if p[3 + i] > 0.5))
                   for p in points]
    assert evaluated == list(dict.fromkeys(thresholded))  # each distinct thresholded point, evaluated once
    again = run_gp_ucb(_hamming(target), space, cfg, progress=False)
    assert (again.plan, again.history) == (result.plan, result.history)


def test_paper_search_defaults_and_plan_file(runner, tmp_path):
    cfg = SearchConfig(paper=True, iterations=3, n_prompts=1, max_new_tokens=6, draft_vocab="8192")
    assert (cfg.objective, cfg.draft_vocab) == ("speed", "off")
    assert SearchConfig(paper=True, objective="model").objective == "model"
    out = tmp_path / "paper.json"
    result, plan_file = search_plan(runner, PROMPTS[:1], cfg, out, "tiny", tmp_path / "no.study.log", progress=False)
    assert plan_file.search["sampler"] == "gp_ucb (paper)" and plan_file.draft_head == {"vocab": "full"}
    assert plan_file.search["study"] is None and not (tmp_path / "no.study.log").exists()
    assert result.proposals == 3 and 1 <= result.completed <= 3
