"""Self-SD drafter: lossless with any plan, never reads the draft's deep KV, adaptive threshold, plan files."""

import json
import random

import pytest
import torch
from lossless_stats import P_THRESHOLD, sampling_pvalue

from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter, parse_spec
from infer.drafters.base import DecodeState, Draft, VerifyOutcome
from infer.drafters.chain import PlanForward
from infer.drafters.self_sd import AdaptiveThreshold, SelfSDConfig
from infer.model.plan import LayerPlan, PlanFile
from infer.model.program import ONCE, Program, Rows
from infer.model.runner import Runner
from infer.model.sampling import SamplingConfig
from layerskip_cli.main import main
from layerskip_core.errors import UserError
from tiny_models import make_model

PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 250, 17], [42] * 12 + [7, 8]]
L = 6


@pytest.fixture(scope="module")
def runner():
    return Runner.from_model(make_model("llama", seed=0, layers=L))


def random_plans(num_layers: int, count: int, seed: int = 0) -> list[LayerPlan]:
    rng = random.Random(seed)
    plans = []
    for _ in range(count):
        p = rng.uniform(0.1, 0.7)
        plans.append(LayerPlan(num_layers, frozenset(i for i in range(num_layers) if rng.random() < p),
                               frozenset(i for i in range(num_layers) if rng.random() < p)))
    return plans


EDGE_PLANS = [
    LayerPlan.full(L),  # exact draft: everything accepted
    LayerPlan(L, frozenset({0})),  # first attention skipped: no exact prefix at all
    LayerPlan(L, frozenset(), frozenset({L - 1})),  # only the last MLP: the whole KV is exact
    LayerPlan(L, frozenset(range(L)), frozenset(range(L))),  # embeddings -> LM head
    LayerPlan(L, frozenset({2, 3}), frozenset({4})),
]


def drafter(runner, plan, **options):
    return build_drafter("self_sd", runner, {"plan": plan, **options})


def generate(runner, d=None, prompt=PROMPTS[0], eos=(), **kw):
    d = d or build_drafter("autoregressive", runner)
    return Engine(runner, d, eos_token_ids=eos).generate(prompt, DecodeConfig(**kw))


def save_plan(path, runner, plan, task="test"):
    PlanFile(plan, runner.identity(), task, {"name": "model", "value": 1.0}, {"trials": 0}, "self_sd").save(path)
    return path


# --------------------------------------------------------------------------- greedy losslessness
@pytest.mark.parametrize("options", [{}, {"num_draft": 1}, {"num_draft": 4, "confidence": 0.0},
                                     {"num_draft": 8, "confidence": 0.6, "adapt_confidence": False}],
                         ids=["paper-defaults", "k1", "k4-no-stop", "k8-fixed-0.6"])
def test_greedy_equals_autoregressive_for_any_plan(runner, options):
    plans = EDGE_PLANS + random_plans(L, 4, seed=len(options))
    for prompt in PROMPTS:
        ref = generate(runner, prompt=prompt, max_new_tokens=32).tokens
        for plan in plans:
            res = generate(runner, drafter(runner, plan, **options), prompt, max_new_tokens=32)
            assert res.tokens == ref, (plan.describe(), options)
            assert res.stats.drafter.draft_forwards >= res.stats.drafted > 0


def test_greedy_lossless_on_qwen2_with_a_plan_file(tmp_path):
    runner = Runner.from_model(make_model("qwen2", seed=1, layers=4))
    for i, plan in enumerate(random_plans(4, 4, seed=3)):
        path = save_plan(tmp_path / f"p{i}.json", runner, plan)
        d = build_drafter("self_sd", runner, {"plan": str(path), "k": "5"})
        assert d.plan == plan and d.config.num_draft == 5
        for prompt in PROMPTS[:2]:
            assert generate(runner, d, prompt, max_new_tokens=30).tokens == generate(
                runner, prompt=prompt, max_new_tokens=30).tokens


def test_exact_plan_accepts_everything(runner):
    res = generate(runner, drafter(runner, LayerPlan.full(L), num_draft=4, confidence=0.0), max_new_tokens=41)
    assert res.stats.acceptance_rate == 1.0 and res.stats.tokens_per_verify == 5.0


def test_eos_and_max_new_tokens_inside_a_draft(runner):
    exact = LayerPlan.full(L)
    ref = generate(runner, max_new_tokens=40).tokens
    eos = ref[9]
    ar = generate(runner, eos=[eos], max_new_tokens=40)
    res = generate(runner, drafter(runner, exact, num_draft=7, confidence=0.0), eos=[eos], max_new_tokens=40)
    assert res.tokens == ar.tokens and res.finish_reason == "eos" and res.stats.accepted > 0
    for max_new in (1, 2, 5, 13):
        res = generate(runner, drafter(runner, exact, num_draft=6, confidence=0.0), max_new_tokens=max_new)
        assert res.tokens == ref[:max_new] and res.finish_reason == "length"


# --------------------------------------------------------------------------- sampling losslessness
@pytest.mark.slow
def test_speculative_sampling_with_a_plan_matches_target_distribution():
    """Empirical joint of the first 3 sampled tokens under Self-SD drafting == exact target joint."""
    model = make_model("llama", seed=7, vocab_size=5, layers=2)
    runner = Runner.from_model(model)
    plan = LayerPlan(2, frozenset({1}), frozenset({0}))
    # adaptive threshold (starts at 0.5: the 5-token draft is rarely more confident than that)
    engine = Engine(runner, drafter(runner, plan, num_draft=3, confidence=0.5))
    pvalue, totals = sampling_pvalue(engine, model, [1, 2, 3], SamplingConfig(temperature=1.0), samples=2500,
                                     seed=4321)
    assert 0.2 < totals["accepted"] / totals["drafted"] < 0.95  # the draft differs from the target but is used
    assert pvalue > P_THRESHOLD


# --------------------------------------------------------------------------- KV validity
def _started(runner, d, prompt):
    """An engine over drafter ``d``, with ``prompt`` prefilled: one token pending and a budget of 100 more."""
    engine = Engine(runner, d)
    return engine, engine.start(prompt, DecodeConfig(max_new_tokens=101))


def _step(engine, gen, context, between):
    """``engine.step(gen)``, with ``between(draft)`` run after the drafter proposes and before verification."""
    propose = engine.drafter.propose

    def proposing(state):
        draft = propose(state)
        between(draft)
        return draft

    context.setattr(engine.drafter, "propose", proposing)
    return engine.step(gen)


def _verify_after(runner, monkeypatch, plan, corrupt=None, broken_rollback=False):
    """Draft once with ``plan``, optionally corrupt cache rows, verify; return (outcome, logits, cache)."""
    engine, gen = _started(runner, drafter(runner, plan, num_draft=5, confidence=0.0), PROMPTS[1])
    state, captured, run = gen.state, [], runner.run

    def tamper(draft):
        n, h = state.n, draft.hidden.shape[0]
        if corrupt is not None:
            E = plan.exact_prefix
            layers = slice(0, E) if corrupt == "exact" else slice(E, L)
            g = torch.Generator().manual_seed(0)
            for buf in (state.cache.k, state.cache.v):
                rows = buf[layers, :, n:n + h + 2]
                rows.copy_(torch.randn(rows.shape, generator=g) * 50)
        m.setattr(runner, "run", lambda program, rows: captured.append(run(program, rows)) or captured[-1])
        if broken_rollback:  # an engine that forgot to drop the draft's rows would attend to them
            m.setattr(state.cache, "rollback", lambda length, start=0, end=None: None)

    with monkeypatch.context() as m:
        outcome = _step(engine, gen, m, tamper)
    return outcome, [out.logits for out in captured if out.logits is not None][-1], state.cache


def test_verification_never_reads_the_draft_kv_past_the_exact_prefix(runner, monkeypatch):
    plan = LayerPlan(L, frozenset({2, 4}), frozenset({3}))  # exact prefix: layers 0, 1
    assert plan.exact_prefix == 2
    clean, clean_logits, clean_cache = _verify_after(runner, monkeypatch, plan)
    dirty, dirty_logits, dirty_cache = _verify_after(runner, monkeypatch, plan, corrupt="deep")
    assert dirty.tokens == clean.tokens
    assert torch.equal(dirty_logits, clean_logits)
    n = len(PROMPTS[1]) + len(clean.path)
    assert torch.equal(dirty_cache.k[:, :, :n], clean_cache.k[:, :, :n])
    assert torch.equal(dirty_cache.v[:, :, :n], clean_cache.v[:, :, :n])
    # The corruption is one that matters: verification that read those rows would change ...
    _, broken_logits, _ = _verify_after(runner, monkeypatch, plan, corrupt="deep", broken_rollback=True)
    assert not torch.allclose(broken_logits, clean_logits, atol=1e-3)
    # ... and the exact-prefix rows, which verification does reuse, change the result when corrupted.
    _, reused_logits, _ = _verify_after(runner, monkeypatch, plan, corrupt="exact")
    assert not torch.allclose(reused_logits, clean_logits, atol=1e-3)


@pytest.mark.parametrize("plan", EDGE_PLANS[1:] + random_plans(L, 3, seed=9), ids=lambda p: p.describe())
def test_verification_recomputes_only_what_the_draft_could_not_reuse(runner, plan, monkeypatch):
    """Layers < E run for the one unseen position; layers >= E for every verified position."""
    k = 5
    engine, gen = _started(runner, drafter(runner, plan, num_draft=k, confidence=0.0), PROMPTS[0])
    state, drafts = gen.state, []

    def count_verification(draft):
        drafts.append(draft)
        runner.counters.reset()

    _step(engine, gen, monkeypatch, count_verification)
    E = plan.exact_prefix
    assert drafts[0].size == k and drafts[0].exact_layers == E
    expect = [1] * E + [k + 1] * (L - E) if E > 0 else [k + 1] * L
    assert runner.counters.layer_tokens == expect
    assert state.cache.lengths == [state.n] * L
    fresh = runner.new_cache(128)
    runner.forward(fresh, torch.tensor(state.tokens[:state.n]))
    torch.testing.assert_close(state.cache.k[:, :, :state.n], fresh.k[:, :, :state.n], atol=1e-5, rtol=0)
    torch.testing.assert_close(state.cache.v[:, :, :state.n], fresh.v[:, :, :state.n], atol=1e-5, rtol=0)


@pytest.mark.parametrize("plan", [LayerPlan(L, frozenset(), frozenset({1})),
                                  LayerPlan(L, frozenset({3}), frozenset({1, 3})),
                                  LayerPlan(L, frozenset({0}), frozenset({5}))], ids=lambda p: p.describe())
def test_draft_step_is_exactly_the_plan(runner, plan):
    """The draft logits equal the model run under the plan; the handed-over hidden state is exact."""
    prompt = torch.tensor(PROMPTS[2])
    cache = runner.new_cache(64)
    runner.forward(cache, prompt[:-1])
    n = len(PROMPTS[2]) - 1
    exact, logits = PlanForward(runner, plan)(cache, prompt[-1:], n)
    ref = runner.new_cache(64)
    runner.forward(ref, prompt[:-1])
    pos = torch.tensor([n])
    rows = Rows.one(ref, runner.embed(prompt[-1:]), pos, kind=ONCE)
    alone = runner.run(Program(0, runner.num_layers, plan=plan), rows)
    torch.testing.assert_close(logits, runner.logits(alone.hidden), atol=1e-5, rtol=0)
    E = plan.exact_prefix
    full = runner.new_cache(64)
    runner.forward(full, prompt[:-1])
    torch.testing.assert_close(exact, runner.run(Program(0, E), Rows.one(full, runner.embed(prompt[-1:]), pos,
                                                                     kind=ONCE)).hidden,
                               atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- adaptive threshold
def test_threshold_rule_follows_self_sd():
    t = AdaptiveThreshold(SelfSDConfig(confidence=0.8))
    t.update(accepted=0, drafted=4)  # acc 0 < 0.9: raise by eps, smoothed
    assert t.acceptance == 0.0 and t.value == pytest.approx(0.9 * 0.8 + 0.1 * 0.81)
    for _ in range(10):
        t.update(4, 4)
    assert t.acceptance > 0.9
    high = t.value
    t.update(4, 4)  # good drafts that ended before k: lower the threshold
    assert t.value == pytest.approx(0.9 * high + 0.1 * (high - 0.01))
    same = t.value
    t.update(12, 12)  # good drafts that ran to k: keep it
    assert t.value == pytest.approx(same)
    fixed = AdaptiveThreshold(SelfSDConfig(adapt_confidence=False, confidence=0.3))
    fixed.update(0, 5)
    assert fixed.value == 0.3 and fixed.updates == 0


@pytest.mark.parametrize("k", [1, 4])
def test_threshold_edge_cases_follow_the_reference_code(runner, k):
    """decoding.py decides by the chain's length alone: k drafts keep gamma, fewer (budget cut) lower it."""
    d = drafter(runner, LayerPlan(L, frozenset({3})), num_draft=k)
    cache = runner.new_cache(64)
    prompt = PROMPTS[0]
    runner.forward(cache, torch.tensor(prompt[:-1]))
    state = DecodeState(runner, cache, SamplingConfig(), torch.Generator(), list(prompt), len(prompt),
                        n=len(prompt) - 1)
    d.start(state)

    def cycle(gamma: float, budget: int) -> tuple[Draft, float]:
        d.threshold.acceptance, d.threshold.value = 1.0, gamma  # drafts have been passing
        state.budget = budget
        draft = d.propose(state)
        cache.rollback(state.n)
        d.update(state, VerifyOutcome(draft, list(range(draft.size + 1)), [], state.n))
        return draft, d.threshold.value

    draft, gamma = cycle(0.999, budget=100)  # the first token falls below gamma and ends the chain
    assert draft.size == 1
    assert gamma == pytest.approx(0.999) if k == 1 else gamma < 0.999  # k reached (k = 1): kept; else lowered
    draft, gamma = cycle(0.001, budget=100)  # nothing falls below: the chain runs to k and keeps gamma
    assert draft.size == k and gamma == pytest.approx(0.001)
    if k > 2:
        draft, gamma = cycle(0.001, budget=3)  # the token budget cuts the chain to 2 drafts: lowered
        assert draft.size == 2 and gamma < 0.001


def test_threshold_adapts_during_generation_and_stats_are_per_call(runner):
    bad = LayerPlan(L, frozenset(range(L)), frozenset(range(L)))  # drafts that almost never pass
    d = drafter(runner, bad, num_draft=6, confidence=0.2)
    res = generate(runner, d, max_new_tokens=40)
    s = res.stats.drafter
    assert s.confidence > 0.2 and 0 < s.threshold_updates < res.stats.verify_calls
    assert s.draft_forwards == res.stats.drafted  # the low-confidence token is proposed, as in Self-SD
    again = generate(runner, d, max_new_tokens=10).stats.drafter
    assert again.draft_forwards < s.draft_forwards  # counters restart with each generate call
    fixed = generate(runner, drafter(runner, bad, confidence=0.2, adapt_confidence=False), max_new_tokens=40)
    assert fixed.stats.drafter.confidence == 0.2


def test_threshold_starts_at_0_6_and_carries_across_prompts_as_the_reference_evaluations_do():
    """evaluate_sum/evaluate_code.ipynb start adaptive runs at 0.6 and pass each prompt's final gamma to the next;
    the smoothed acceptance is local to decoding.py's generate call, so it restarts at 0 on every prompt."""
    cfg = SelfSDConfig()
    assert (cfg.confidence, cfg.carry_confidence) == (0.6, True)
    t = AdaptiveThreshold(cfg)
    for accepted in (0, 1, 0):
        t.update(accepted, 4)
    assert t.value != 0.6 and t.acceptance > 0
    adapted = t.value
    t.new_prompt()
    assert t.value == adapted and t.acceptance == 0.0 and t.updates == 0
    fresh = AdaptiveThreshold(SelfSDConfig(carry_confidence=False))
    fresh.update(0, 4)
    fresh.new_prompt()
    assert fresh.value == 0.6 and fresh.acceptance == 0.0


def test_one_drafter_carries_gamma_from_prompt_to_prompt(runner):
    plan = random_plans(L, 1, seed=5)[0]
    d = drafter(runner, plan, num_draft=6)
    finals, starts = [], []
    for prompt in PROMPTS:
        res = generate(runner, d, prompt, max_new_tokens=24)
        assert res.tokens == generate(runner, prompt=prompt, max_new_tokens=24).tokens
        starts.append(res.stats.drafter.confidence_start)
        finals.append(res.stats.drafter.confidence)
    assert starts[0] == 0.6 and starts[1:] == finals[:-1] and finals[0] != 0.6
    per_prompt = drafter(runner, plan, num_draft=6, carry_confidence=False)
    starts = [generate(runner, per_prompt, p, max_new_tokens=24).stats.drafter.confidence_start for p in PROMPTS]
    assert starts == [0.6] * len(PROMPTS)


# --------------------------------------------------------------------------- plan files and options
def test_plan_json_round_trip(tmp_path, runner):
    for plan in EDGE_PLANS + random_plans(L, 5, seed=4):
        assert LayerPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
        pf = PlanFile(plan, runner.identity(), "humaneval", {"name": "speed", "value": 1.5}, {"seed": 3}, "self_sd")
        pf.save(tmp_path / "p.json")
        back = PlanFile.load(tmp_path / "p.json")
        assert back == pf
        back.check_model(runner.identity())
    assert not list(tmp_path.glob(".*.tmp"))  # atomic save leaves no temporary file


def test_plan_for_another_model_is_refused(tmp_path, runner):
    path = save_plan(tmp_path / "p.json", runner, LayerPlan(L, frozenset({2})))
    other_weights = Runner.from_model(make_model("llama", seed=5, layers=L))
    with pytest.raises(UserError, match="made for another model.*weight_fingerprint"):
        build_drafter("self_sd", other_weights, {"plan": str(path)})
    other_depth = Runner.from_model(make_model("llama", seed=0, layers=4))
    with pytest.raises(UserError, match="another model.*num_layers"):
        build_drafter("self_sd", other_depth, {"plan": str(path)})


def test_options_in_specs_and_flags(tmp_path, runner):
    path = save_plan(tmp_path / "p.json", runner, LayerPlan(L, frozenset({2})))
    spec = parse_spec(f"self_sd:plan={path}:k=4:confidence=0.5:adapt_confidence=false")
    d = build_drafter(spec.drafter, runner, spec.options)
    assert (d.config.num_draft, d.config.confidence, d.config.adapt_confidence) == (4, 0.5, False)
    with pytest.raises(UserError, match="needs a plan"):
        parse_spec("self_sd")
    with pytest.raises(UserError, match="does not exist"):
        parse_spec("self_sd:plan=/no/such/plan.json")
    with pytest.raises(UserError, match="confidence must be in"):
        parse_spec(f"self_sd:plan={path}:confidence=1.5")


def test_generate_cli(capsys, tiny_model_dir, tmp_path):
    runner = Runner.from_pretrained(tiny_model_dir)
    path = save_plan(tmp_path / "p.json", runner, LayerPlan(runner.num_layers, frozenset({1}), frozenset({2})))
    base = ["generate", "--model", str(tiny_model_dir), "--prompt", "def add(a, b):", "--json",
            "--max-new-tokens", "16", "--ignore-eos"]
    assert main(base) == 0
    ref = json.loads(capsys.readouterr().out)["tokens"]
    assert main(base + ["--drafter", "self_sd", "--plan", str(path), "--num-draft", "3", "--no-adapt-confidence"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == ref and out["stats"]["drafter"]["draft_forwards"] > 0
    for extra, message in [([], "needs a plan"), (["--plan", str(tmp_path / "none.json")], "does not exist")]:
        assert main(base + ["--drafter", "self_sd"] + extra) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
    other = save_plan(tmp_path / "other.json", Runner.from_model(make_model("llama", seed=9)), LayerPlan(4))
    assert main(base + ["--drafter", "self_sd", "--plan", str(other)]) == 2
    err = capsys.readouterr().err
    assert "made for another model" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.real_model
def test_committed_plan_is_lossless_on_default_model(default_model_path):
    from pathlib import Path

    from infer.loading import load_model

    plans = sorted(Path(__file__).resolve().parents[2].glob("plans/*.json"))
    if not plans:
        pytest.skip("no committed plan")
    model = load_model(str(default_model_path))
    plans = [p for p in plans if PlanFile.load(p).model == model.runner.identity()]
    if not plans:
        pytest.skip("no committed plan for the default model")
    prompt = model.encode("def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"\n")
    cfg = DecodeConfig(max_new_tokens=24, stop_at_eos=False)
    ref = Engine(model.runner, build_drafter("autoregressive", model.runner)).generate(prompt, cfg).tokens
    for path in plans:
        d = build_drafter("self_sd", model.runner, {"plan": str(path)})
        assert Engine(model.runner, d).generate(prompt, cfg).tokens == ref, path
