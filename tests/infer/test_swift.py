"""SWIFT: losslessness (greedy and sampling, trees included), matchness, optimisation, fallback, plan files."""

import random
import time
import warnings

import pytest
import torch
from lossless_stats import P_THRESHOLD, sampling_pvalue

from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter
from infer.drafters.base import DecodeState
from infer.drafters.gate import FallbackGate
from infer.drafters.skipping import agreement, matchness_span, rerun_mask, verified_window
from infer.drafters.swift import SwiftDrafter
from infer.drafters.swift_search import LayerSetSearch
from infer.model.plan import LayerPlan, PlanFile
from infer.model.program import ONCE, Program, Rows
from infer.model.runner import Runner
from infer.model.sampling import SamplingConfig
from layerskip_core.errors import UserError
from tiny_models import make_model

PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 250, 17], [42] * 12 + [7, 8], [1, 2, 3]]
EAGER = {"context_window": 8, "opt_budget": 0.95, "fallback_opt_budget": 0.95}  # optimise at every step


pytestmark = pytest.mark.usefixtures("private_cache")  # tests/infer/conftest.py


@pytest.fixture(scope="module")
def runner():
    return Runner.from_model(make_model("llama", seed=0, layers=6))


def reference(runner, prompt, n=48):
    return Engine(runner, build_drafter("autoregressive", runner)).generate(
        prompt, DecodeConfig(max_new_tokens=n)).tokens


def random_plan_file(runner, tmp_path, seed):
    rng = random.Random(seed)
    L = runner.num_layers
    plan = LayerPlan(L, frozenset(rng.sample(range(L), 2)), frozenset(rng.sample(range(L), 2)))
    path = tmp_path / f"plan{seed}.json"
    PlanFile(plan, runner.identity(), task="test").save(path)
    return path


@pytest.mark.parametrize("tree", [True, False])
@pytest.mark.parametrize("fallback", [True, False])
def test_greedy_equals_autoregressive_over_a_stream(runner, tmp_path, tree, fallback):
    for seed in range(3):
        options = EAGER | {"tree": tree, "adaptive": fallback, "plan": str(random_plan_file(runner, tmp_path, seed)),
                           "confidence": 0.3, "opt_seed": seed}
        engine = Engine(runner, build_drafter("swift", runner, options))  # one drafter: state persists
        drafted = 0
        for prompt in PROMPTS:
            res = engine.generate(prompt, DecodeConfig(max_new_tokens=48))
            assert res.tokens == reference(runner, prompt), (seed, prompt)
            drafted += res.stats.drafted
        assert engine.drafter.search.steps > 0  # the optimiser ran inside the stream
        if not fallback:
            assert drafted > 0


def test_tree_shape_and_sibling_distributions(runner):
    drafter = SwiftDrafter(runner, SwiftDrafter.Config(confidence=0.99, num_draft=3, max_tree_nodes=12))
    drafter.gate.mode = "draft"
    config = DecodeConfig(max_new_tokens=51, sampling=SamplingConfig(temperature=1.0, seed=0))
    state = Engine(runner, drafter).start([5, 6, 7], config).state  # prefilled: one token pending
    state.budget = 50
    draft = drafter.propose(state)
    m = draft.hidden.shape[0]  # chain nodes drafted = draft forwards
    assert draft.parents[:m] == list(range(m))
    assert len(draft.parents) > m and all(p < m for p in draft.parents[m:])
    for i, p in enumerate(draft.parents):  # a sibling shares the distribution of the chain node at its depth
        torch.testing.assert_close(draft.q[i], draft.q[p])
    for depth in range(m):  # siblings at one depth are distinct and differ from the chain token
        group = [int(draft.tokens[depth])] + [int(draft.tokens[i]) for i, p in enumerate(draft.parents)
                                              if i >= m and p == depth]
        assert len(group) == len(set(group))


@pytest.mark.slow
def test_sampling_with_multi_candidate_trees_matches_target():
    model = make_model("llama", seed=7, vocab_size=5, layers=4)
    runner = Runner.from_model(model)
    options = {"confidence": 0.99, "num_draft": 2, "adaptive": False, "max_opt_steps": 0, "skip_ratio": 0.3}
    engine = Engine(runner, build_drafter("swift", runner, options))
    pvalue, totals = sampling_pvalue(engine, model, [1, 2, 3], SamplingConfig(temperature=1.0), samples=2000, seed=99)
    siblings = totals["drafted"] - totals["draft_forwards"]
    assert siblings > 400 and totals["accepted"] > 150  # multi-candidate trees were drafted and used
    assert pvalue > P_THRESHOLD


@pytest.mark.slow
def test_sampled_trees_with_a_reduced_head_match_target():
    """Sampled multi-candidate trees drafted with a reduced head (token 4 never drafted) keep the target's
    distribution: the draft q is zero outside the subset and the residual covers it (chi-square)."""
    from layerskip_core.draft_vocab import DraftVocab

    model = make_model("llama", seed=7, vocab_size=5, layers=4)
    runner = Runner.from_model(model)
    vocab = DraftVocab(ids=(0, 1, 2, 3), model=runner.identity())
    options = {"confidence": 0.99, "num_draft": 2, "adaptive": False, "max_opt_steps": 0, "skip_ratio": 0.3,
               "draft_vocab": vocab}
    engine = Engine(runner, build_drafter("swift", runner, options))
    pvalue, totals = sampling_pvalue(engine, model, [1, 2, 3], SamplingConfig(temperature=1.0), samples=2000, seed=5)
    siblings = totals["drafted"] - totals["draft_forwards"]
    assert siblings > 250 and totals["accepted"] > 150  # trees from the subset head were drafted and used
    assert pvalue > P_THRESHOLD


def engine_state(runner, prompt, n=40):
    """A decode state whose cache holds the prompt and n greedy tokens (the last one pending)."""
    tokens = prompt + reference(runner, prompt, n)
    cache = runner.new_cache(128)
    state = DecodeState(runner, cache, SamplingConfig(), SamplingConfig().generator(), tokens, len(prompt))
    runner.forward(cache, torch.tensor(tokens[:-1]))
    state.n = len(tokens) - 1
    return state


def test_matchness_of_the_full_plan_is_one(runner):
    state = engine_state(runner, PROMPTS[0])
    cache = state.cache
    full, skipped = matchness_span(state, [LayerPlan.full(runner.num_layers), LayerPlan(6, frozenset({1, 2, 3, 4}))],
                                   state.n - 32, state.n)
    assert full == 1.0 and skipped < 1.0
    assert cache.lengths == [state.n] * runner.num_layers  # scoring leaves the cache as it was


def test_one_scorer_two_kv_views(runner):
    """SWIFT's draft view and the search's exact view agree on a window's first token and differ after it."""
    state = engine_state(runner, PROMPTS[0])
    start, end = state.n - 16, state.n
    plan = LayerPlan(6, frozenset({1, 2, 3}), frozenset({2, 4}))
    scores = {}
    for kv in ("draft", "exact"):
        window = verified_window(runner, state.cache, state.n, start, state.ids(start, end),
                                 state.ids(start + 1, end + 1), kv)
        scores[kv] = agreement(runner, window, plan)
        assert state.cache.lengths == [state.n] * runner.num_layers
    (agree_d, top1_d), (_, top1_e) = scores["draft"], scores["exact"]
    assert float(agree_d.float().mean()) == matchness_span(state, [plan], start, end)[0]
    assert float(top1_d[0]) == pytest.approx(float(top1_e[0]), abs=1e-6)  # nothing before it in the window
    assert (top1_d[1:] - top1_e[1:]).abs().max() > 1e-3  # later tokens see draft-mode vs exact rows
    with pytest.raises(ValueError, match="kv must be"):
        rerun_mask(2, 2, "cpu", "sideways")


def planted_model():
    """A 6-layer model whose layer-2 attention and layer-3/4 MLPs contribute nothing (redundant)."""
    model = make_model("llama", seed=11, layers=6)
    with torch.no_grad():
        model.model.layers[2].self_attn.o_proj.weight.zero_()
        model.model.layers[3].mlp.down_proj.weight.zero_()
        model.model.layers[4].mlp.down_proj.weight.zero_()
    return Runner.from_model(model)


def test_optimisation_finds_the_planted_redundant_sublayers():
    runner = planted_model()
    planted = LayerPlan(6, frozenset({2}), frozenset({3, 4}))
    options = EAGER | {"skip_ratio": 0.375, "adaptive": False, "bo_interval": 5, "opt_seed": 0}  # 3 of 8 slots
    drafter = build_drafter("swift", runner, options)
    start_plan = drafter.best
    engine = Engine(runner, drafter)
    for prompt in PROMPTS * 3:
        res = engine.generate(prompt, DecodeConfig(max_new_tokens=48))
        assert res.tokens == reference(runner, prompt)
        if not drafter.optimising:
            break
    assert drafter.best_score == 1.0 and drafter.stop_reason.startswith("matchness")
    # the planted set is perfect and the uniform start is not (scored on the same verified window)
    state = engine_state(runner, PROMPTS[0])
    start_score, planted_score, found_score = matchness_span(state, [start_plan, planted, drafter.best],
                                                             state.n - 32, state.n)
    assert start_score < 1.0 and planted_score == 1.0 and found_score >= start_score
    traj = [score for _, score in drafter.trajectory]
    assert traj == sorted(traj) and traj[-1] == 1.0  # best-so-far never decreases


def test_search_random_and_bayesian_candidates_have_the_right_size():
    search = LayerSetSearch(num_layers=10, skip_ratio=0.45, bo_interval=3, seed=0)
    assert search.uniform_plan().num_skipped == search.num_skip == int(16 * 0.45)
    kinds = []
    for _ in range(9):
        plan, trial = search.propose()
        assert plan.num_skipped == search.num_skip
        assert not ({0, 9} & (plan.skip_attn | plan.skip_mlp))  # first and last layer always run
        search.record(plan, trial, random.random())
        kinds.append(trial is not None)
    assert kinds == [False, False, True] * 3


def test_fallback_when_drafting_cannot_pay(runner, monkeypatch):
    slow_forward = SwiftDrafter.propose

    def slow(self, state):
        draft = slow_forward(self, state)
        if draft is not None:
            time.sleep(0.02)  # make drafting far slower than a plain step
        return draft

    monkeypatch.setattr(SwiftDrafter, "propose", slow)
    drafter = build_drafter("swift", runner, {"max_opt_steps": 0})
    engine = Engine(runner, drafter)
    res = engine.generate(PROMPTS[0], DecodeConfig(max_new_tokens=80))
    assert res.tokens == reference(runner, PROMPTS[0], 80)
    assert drafter.mode == "plain"
    assert res.stats.drafter.plain_steps > 50 and drafter.drafting.cycles >= SwiftDrafter.PROBE


def test_plan_saved_by_swift_loads_back(runner, tmp_path):
    path = tmp_path / "swift_plan.json"
    drafter = build_drafter("swift", runner, EAGER | {"save_plan": str(path)})
    res = Engine(runner, drafter).generate(PROMPTS[0], DecodeConfig(max_new_tokens=40))
    drafter.stats()
    assert res.stats.drafter and not path.exists()  # stats() has no side effects: the plan is saved by finish()
    drafter.finish()
    saved = PlanFile.load(path)
    assert saved.plan == drafter.best and saved.source == "swift"
    saved.check_model(runner.identity())
    again = build_drafter("swift", runner, {"plan": str(path)})
    assert again.best == drafter.best


def test_plan_for_another_model_is_refused(runner, tmp_path):
    from layerskip_core.errors import UserError

    other = Runner.from_model(make_model("llama", seed=5, layers=6))
    path = random_plan_file(other, tmp_path, 0)
    with pytest.raises(UserError, match="another model"):
        build_drafter("swift", runner, {"plan": str(path)})


def test_cost_model_prediction(runner):
    from infer.model.plan import weights_cost

    drafter = SwiftDrafter(runner, SwiftDrafter.Config(num_draft=4, remember="off", costs="weights"))
    assert drafter.predicted_speedup(-1.0) is None  # no score yet
    c = weights_cost(runner.spec, 1).draft(drafter.best)  # nothing timed yet, by weights: the optimistic bound (v = 1)
    bound = max((1 - 0.8 ** (k + 1)) / 0.2 / (k * c + 1) for k in range(1, 5))
    assert drafter.predicted_speedup(0.8) == pytest.approx(bound)
    drafter.plain.add(1, 0.1)  # 10 tokens/s plain
    drafter.draft_forward.add(4, 0.1)  # c = 0.025 s / 0.1 s = 0.25
    drafter.verify.add(1, 0.1)  # v = 1
    expected = max((1 - 0.8 ** (k + 1)) / 0.2 / (k * 0.25 + 1) for k in range(1, 5))  # Leviathan et al. Thm 3.8
    assert drafter.predicted_speedup(0.8) == pytest.approx(expected)
    assert drafter.predicted_speedup(0.0) == pytest.approx(1 / 1.25)  # k = 1 is best when nothing is accepted


def test_cold_start_drafts_only_after_a_score_that_can_pay(runner, monkeypatch):
    """A fresh SWIFT (nothing remembered) takes plain steps until the optimiser has scored a plan, and probes
    drafting only if the optimistic bound of the cost model allows it: a plan that cannot pay is never drafted.
    The bound is pinned on each side of the gate's threshold (the measured one moves with the machine's load)."""
    options = {"remember": "off", "context_window": 4, "opt_budget": 0.95, "fallback_opt_budget": 0.95}
    for bound, probes in ((FallbackGate.HOPELESS / 2, False), (2.0, True)):
        monkeypatch.setattr(SwiftDrafter, "predicted_speedup", lambda self, a, b=bound: None if a < 0 else b)
        drafter = build_drafter("swift", runner, options)
        engine = Engine(runner, drafter)
        gen = engine.start(PROMPTS[0], DecodeConfig(max_new_tokens=40))
        drafts_before_score = 0
        while not gen.done:
            scored = drafter.best_score >= 0
            drafts_before_score += engine.step(gen).draft is not None and not scored
        assert drafts_before_score == 0 and drafter.best_score >= 0
        assert (drafter.drafting.cycles > 0) == probes, bound


def test_remembered_plan_and_score_spare_fresh_drafters_the_probe(runner, tmp_path, monkeypatch):
    """The gate memory keeps the best plan and its matchness too: a fresh drafter on the next prompt knows its plan
    cannot pay and does not probe it again (it used to, on every prompt, a fresh drafter having no score). The
    cost model's verdict is pinned below the gate's threshold (the measured one moves with the machine's load)."""
    monkeypatch.setenv("LAYERSKIP_CACHE", str(tmp_path))
    monkeypatch.setattr(SwiftDrafter, "predicted_speedup",
                        lambda self, a: None if a < 0 else FallbackGate.HOPELESS / 2)
    options = {"context_window": 4, "fallback_opt_budget": 0.95, "opt_budget": 0.95}
    first = build_drafter("swift", runner, options)
    with Engine(runner, first) as engine:
        engine.generate(PROMPTS[0], DecodeConfig(max_new_tokens=40))
    second = build_drafter("swift", runner, options)
    assert second.best == first.best and second.best_score == first.best_score >= 0
    result = Engine(runner, second).generate(PROMPTS[1], DecodeConfig(max_new_tokens=40))
    assert result.stats.drafter.draft_forwards == 0


def test_paper_mode_has_no_budget_no_cap_and_no_fallback(runner):
    """swift:paper=true is the paper's SWIFT: the tree is not capped, optimisation has no budget, no fallback."""
    drafter = build_drafter("swift", runner, {"paper": "true", "confidence": 0.0, "num_draft": 4,
                                              "context_window": 8})
    assert drafter.gate.mode == "draft" and not drafter.gate.enabled
    drafter.opt_time_total, drafter.decode_time = 100.0, 1.0  # far over any budget: optimises all the same (below)
    sizes = []
    propose = drafter.propose

    def record(state):
        draft = propose(state)
        sizes.append(0 if draft is None else draft.size)
        return draft

    drafter.propose = record
    res = Engine(runner, drafter).generate(PROMPTS[0], DecodeConfig(max_new_tokens=48))
    assert res.tokens == reference(runner, PROMPTS[0])
    assert max(sizes) > 12  # more nodes than the default cap of 12 (4 chain nodes + their siblings)
    cycles = res.stats.verify_calls
    assert drafter.opt_steps >= cycles - 8 - 1  # an optimisation step after every verification once γ tokens exist


def test_drafting_uses_the_optimised_plan(monkeypatch):
    """Every draft forward runs the best plan found so far, and the optimiser does change it."""
    from infer.drafters import chain

    runner = planted_model()
    drafter = build_drafter("swift", runner, EAGER | {"skip_ratio": 0.375, "adaptive": False, "bo_interval": 5})
    start = drafter.best
    used, best_at_propose = [], []
    call = chain.PlanForward.__call__

    def record(self, cache, token, position):
        used.append((len(best_at_propose), self.plan))
        return call(self, cache, token, position)

    propose = drafter.propose

    def remember_best(state):
        best_at_propose.append(drafter.best)
        return propose(state)

    monkeypatch.setattr(chain.PlanForward, "__call__", record)
    drafter.propose = remember_best
    engine = Engine(runner, drafter)
    for prompt in PROMPTS[:2]:
        assert engine.generate(prompt, DecodeConfig(max_new_tokens=48)).tokens == reference(runner, prompt)
    assert drafter.best != start and used
    assert all(plan == best_at_propose[i - 1] for i, plan in used)
    assert {plan for _, plan in used} >= {start, drafter.best}  # drafted with the start plan, then the found one


@pytest.mark.parametrize("old,new", [("max_draft", "num_draft"), ("fallback", "adaptive"), ("gamma", "context_window")])
def test_old_option_names_are_refused_with_the_one_spelling(runner, old, new):
    pattern = f"option '{old}' does not apply to drafter 'swift' \\(its options: .*\\b{new}\\b"
    with pytest.raises(UserError, match=pattern):
        build_drafter("swift", runner, {old: "3"})
    assert build_drafter("self_sd", runner, {"gamma": "0.5", "plan": LayerPlan(6, frozenset({2}))}).config.confidence \
        == 0.5  # gamma is Self-SD's threshold (its alias); swift does not take it


# --------------------------------------------------------------------------- paper mode follows the reference code
PAPER = {"paper": "true", "context_window": "8", "confidence": "0.3", "num_draft": "4", "bo_interval": "3"}


def test_paper_mode_defaults_are_the_released_scripts_unless_set(runner):
    """eval_llama.sh passes --context-window 50 --max-score 0.93; inference_swift.py's defaults are 32 / 0.95."""
    paper = SwiftDrafter.Config(paper=True)
    assert (paper.context_window, paper.match_threshold) == (50, 0.93)
    assert (SwiftDrafter.Config().context_window, SwiftDrafter.Config().match_threshold) == (32, 0.95)
    explicit = build_drafter("swift", runner, {"paper": "true", "context_window": "32", "match_threshold": "0.95"})
    assert (explicit.config.context_window, explicit.config.match_threshold) == (32, 0.95)


def test_paper_mode_starts_from_the_odd_inner_layers(runner):
    """inference_swift.py initialises attention and MLP skips to range(1, L - 1, 2), whatever the skip ratio."""
    drafter = build_drafter("swift", runner, {"paper": "true"})
    assert drafter.best == LayerPlan(6, frozenset({1, 3}), frozenset({1, 3}))
    assert build_drafter("swift", runner).best == drafter.search.uniform_plan()


def test_gp_ucb_search_keeps_the_top_n_of_its_continuous_suggestion():
    search = LayerSetSearch(num_layers=10, skip_ratio=0.45, bo_interval=3, seed=0, bayes="gp_ucb")
    kinds = []
    for _ in range(9):
        plan, point = search.propose()
        assert plan.num_skipped == search.num_skip and not ({0, 9} & (plan.skip_attn | plan.skip_mlp))
        if point is not None:  # a continuous point: its num_skip largest values are the skipped sublayers
            assert point.shape == (16,) and 0 <= float(point.min()) <= float(point.max()) <= 1
            assert plan == search.top_n(point)
            top = set(torch.argsort(point, descending=True)[:search.num_skip].tolist())
            assert torch.equal(search.vector(plan).nonzero().flatten(), torch.tensor(sorted(top)))
        search.record(plan, point, random.random())
        kinds.append(point is not None)
        registered = search.gp.xs[-1]  # random candidates as their 0/1 vector, Bayesian ones as the point itself
        assert torch.equal(registered, point if point is not None else search.vector(plan))
    assert kinds == [False, False, True] * 3 and search.method == "gp_ucb" and search.study is None


def test_paper_mode_scores_each_prompts_first_generated_tokens_on_the_prompts_kv(runner, monkeypatch):
    """The reference re-runs the first γ+1 generated tokens on a copy of the prompt's prefilled cache."""
    from infer.drafters import swift

    windows = []
    span = swift.matchness_span

    def spy(state, plans, start, end, vocab=None, runner=None):
        scores = span(state, plans, start, end, vocab, runner)
        windows.append((state.prompt_len, start, end, plans[0], scores[0], list(state.tokens)))
        return scores

    monkeypatch.setattr(swift, "matchness_span", spy)
    drafter = build_drafter("swift", runner, PAPER)
    engine = Engine(runner, drafter)
    for prompt in PROMPTS[:2]:
        assert engine.generate(prompt, DecodeConfig(max_new_tokens=40)).tokens == reference(runner, prompt, 40)
    assert windows and len(windows) == drafter.search.steps  # one plan per step: the incumbent is never rescored
    assert all((start, end) == (prompt_len, prompt_len + 8) for prompt_len, start, end, *_ in windows)
    prompt_len, start, end, plan, score, tokens = windows[-1]
    cache = runner.new_cache(128)
    runner.forward(cache, torch.tensor(tokens[:prompt_len]))  # the prompt's KV and nothing else
    ids = torch.tensor(tokens[start:end])
    rows = Rows.one(cache, runner.embed(ids), torch.arange(start, end), kind=ONCE)
    hidden = runner.run(Program(0, runner.num_layers, plan=plan), rows).hidden
    agree = runner.logits(hidden).argmax(-1) == torch.tensor(tokens[start + 1:end + 1])
    assert score == pytest.approx(float(agree.float().mean()))


def test_paper_mode_keeps_one_global_best_score(runner):
    """statistics['origin_score'] starts at 0 and only grows: a new prompt's window does not rescore the best plan."""
    drafter = build_drafter("swift", runner, PAPER | {"max_opt_steps": "1000", "patience": "1000"})
    engine = Engine(runner, drafter)
    for prompt in PROMPTS:
        assert engine.generate(prompt, DecodeConfig(max_new_tokens=40)).tokens == reference(runner, prompt, 40)
    traj = [score for _, score in drafter.trajectory]
    assert len(traj) == drafter.search.steps >= 25 and traj == sorted(traj)
    assert len(drafter.search.gp.xs) == drafter.search.steps  # every candidate went to the GP
    assert drafter.stats().bayes == "gp_ucb"


def test_paper_mode_stops_as_the_reference_compares(runner):
    """The reference stops when score > max_score and after more than max-tolerance / max-opt iterations."""
    for paper, stops in ((True, False), (False, True)):
        drafter = build_drafter("swift", runner, {"paper": str(paper).lower(), "match_threshold": "0.5",
                                                  "patience": "5", "max_opt_steps": "9"})
        drafter.best_score = 0.5
        drafter.check_stop()
        assert drafter.optimising != stops
        drafter.best_score, drafter.search.since_improved = 0.1, 5
        drafter.check_stop()
        assert drafter.optimising != stops
        drafter.search.since_improved, drafter.search.steps = 0, 9
        drafter.check_stop()
        assert drafter.optimising != stops


# --------------------------------------------------------------------------- optuna is optional
@pytest.mark.parametrize("paper", [False, True])
def test_swift_runs_without_optuna(runner, monkeypatch, paper):
    import sys

    monkeypatch.setitem(sys.modules, "optuna", None)  # `import optuna` raises ImportError
    options = EAGER | {"bo_interval": 2, "adaptive": False, "confidence": 0.3} | ({"paper": True} if paper else {})
    drafter = build_drafter("swift", runner, options)
    engine = Engine(runner, drafter)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for prompt in PROMPTS[:2]:
            res = engine.generate(prompt, DecodeConfig(max_new_tokens=48))
            assert res.tokens == reference(runner, prompt)
    assert drafter.search.steps >= 4 and res.stats.drafted > 0
    notes = [w for w in caught if "optuna is not installed" in str(w.message)]
    if paper:
        assert drafter.stats().bayes == "gp_ucb" and len(drafter.search.gp.xs) == drafter.search.steps
        assert not notes
    else:
        assert drafter.stats().bayes == "random (optuna not installed)" and len(notes) == 1


# --------------------------------------------------------------------------- plain mode costs what plain decoding costs
def remembered_plain(runner, **options):
    """A swift drafter whose remembered gate says 'plain' (drafting measured slower) and whose optimisation steps
    were measured at 0.5 s each; its file also holds 1000 s of earlier decoding with 1 s of optimisation, which an
    earlier budget counted as credit."""
    from infer.drafters.gate import GateMemory

    cfg = SwiftDrafter.Config(context_window=8, recheck_interval=10_000, **options)
    plain = {"tokens": 1.0, "seconds": 0.01, "cycles": 50}
    drafting = {"tokens": 1.0, "seconds": 0.05, "cycles": SwiftDrafter.PROBE}
    GateMemory.for_drafter(runner, "swift", cfg).save({
        "gate": {"mode": "plain", "mode_cycles": 0, "recheck": 10_000, "plain": plain, "drafting": drafting},
        "draft_forward": {"tokens": 1.0, "seconds": 0.006, "cycles": 6}, "verify": drafting,
        "opt_time": 1.0, "decode_time": 1000.0, "opt_step": {"tokens": 1.0, "seconds": 0.5, "cycles": 3}})
    return SwiftDrafter(runner, cfg)


def test_remembered_plain_mode_takes_no_optimisation_step_the_prompt_cannot_pay_for(runner, monkeypatch):
    drafter = remembered_plain(runner)
    assert drafter.mode == "plain"
    calls = []
    predicted = drafter.predicted_speedup
    monkeypatch.setattr(drafter, "predicted_speedup", lambda m: calls.append(m) or predicted(m))
    res = Engine(runner, drafter).generate(PROMPTS[0], DecodeConfig(max_new_tokens=48))
    assert res.tokens == reference(runner, PROMPTS[0])
    s = res.stats.drafter
    assert res.stats.drafted == 0 and s.plain_steps == res.stats.verify_calls - 1 and s.mode == "plain"
    assert s.opt_steps == 0 and s.opt_time == 0.0  # a 0.5 s step is far over 3 % of this prompt's own time
    assert calls == [-1.0]  # once, for stats(): not per plain step (the gate reads it only at a re-check)
    assert s.predicted_speedup is None and s.opt_step_time == 0.5


def test_remembered_plain_mode_still_optimises_once_its_own_time_pays_for_it(runner):
    drafter = remembered_plain(runner)
    drafter.decode_time = 100.0  # as after a long prompt or a stream: 3 % of it pays for a 0.5 s step
    res = Engine(runner, drafter).generate(PROMPTS[0], DecodeConfig(max_new_tokens=48))
    assert res.tokens == reference(runner, PROMPTS[0])
    assert res.stats.drafter.opt_steps >= 1 and drafter.best_score >= 0
    drafter.finish()
    reloaded = SwiftDrafter(runner, drafter.config)
    assert reloaded.opt_step.cycles == drafter.opt_step.cycles > 3  # the step cost is remembered with the gate


def test_plain_steps_before_the_first_probe_get_the_fallback_budget(runner):
    """Waiting for a scored plan is plain decoding: optimisation may take the fallback share (3 %), not the 25 % of
    an assessment that has not started (a fresh drafter otherwise spent a quarter of a short prompt optimising)."""
    drafter = build_drafter("swift", runner, {"remember": "off"})
    assert drafter.mode == "plain" and drafter.gate.drafting.cycles == 0
    drafter.decode_time, drafter.opt_time_total = 1.0, 0.1  # 9 % of the time spent optimising
    assert not drafter.within_budget()
    drafter.gate.switch("draft")  # a probe: the assessment's share applies, to the probe's own time
    drafter.decode_time += 0.4
    drafter.draft_time = 0.4
    assert drafter.within_budget()


@pytest.mark.parametrize("name", ["swift", "self_sd"])
@pytest.mark.parametrize("layers", [4, 12])
def test_a_plan_file_for_another_depth_is_refused(runner, tmp_path, name, layers):
    """The file's model record matches (as a hand-edited or foreign file's may); the plan's depth does not."""
    from layerskip_core.errors import UserError

    path = tmp_path / "plan.json"
    PlanFile(LayerPlan(layers, frozenset({1}), frozenset({2})), runner.identity(), source="import").save(path)
    with pytest.raises(UserError, match=f"plan for {layers} layers; the model has 6"):
        build_drafter(name, runner, {"plan": str(path), "save_plan": str(tmp_path / "out.json")} if name == "swift"
                      else {"plan": str(path)})
    assert not (tmp_path / "out.json").exists()  # --save-plan never writes a foreign plan back


@pytest.mark.parametrize("name", ["swift", "self_sd"])
def test_a_layer_plan_object_is_taken_and_checked_like_a_file(runner, name):
    from layerskip_core.errors import UserError

    plan = LayerPlan(6, frozenset({2}), frozenset({3}))
    drafter = build_drafter(name, runner, {"plan": plan})
    assert (drafter.best if name == "swift" else drafter.plan) == plan
    with pytest.raises(UserError, match="plan for 8 layers; the model has 6"):
        build_drafter(name, runner, {"plan": LayerPlan(8, frozenset({2}))})


@pytest.mark.parametrize("name", ["swift", "self_sd"])
def test_a_folder_as_plan_says_it_is_a_folder(tmp_path, name):
    from layerskip_core.errors import UserError

    with pytest.raises(UserError, match="is a folder; give the path of a plan file"):
        build_drafter(name, None, {"plan": str(tmp_path)})
