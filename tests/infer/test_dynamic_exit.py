"""The dynamic-exit drafter: lossless at every exit it can pick, the streams it observes are the model's, its
choice converges to the exit that pays on a scripted model, and it does not draft where no exit pays."""

import pytest
import torch
import yaml
from lossless_stats import P_THRESHOLD, sampling_pvalue

from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter, drafter_spec
from infer.drafters.costs import CycleTiming, realised_cost
from infer.drafters.dynamic_exit import (
    OBSERVE_SHARE,
    DynamicExitDrafter,
    candidate_exits,
    exit_prices,
)
from infer.drafters.exit_choice import Choice, RunEstimates, RunRates, best_choice, predicted_speedup
from infer.drafters.registry import stats_from_dict
from infer.model.program import ONCE, Program, Rows
from infer.model.runner import Runner
from infer.model.sampling import SamplingConfig
from layerskip_core.errors import UserError
from tiny_models import make_model, save_tiny

PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 250, 17], [42] * 12 + [7, 8]]
FORCED = {"min_speedup": 0, "adaptive": False, "observe_every": 1, "stops": "0", "calibrate": False, "costs": "weights"}
"""Options that make the cost model always draft its best (E, k), with no confidence stop, from weight-count prices
(no timing in the choice), and observe every cycle."""


@pytest.fixture(scope="module")
def runner():
    return Runner.from_model(make_model("llama", seed=0, layers=6))


@pytest.fixture(scope="module")
def scripted():
    """Layers 3-5 add nothing to the residual stream (zero output projections): exits 3 and 5 always agree with the
    last layer, exits 1 and 2 rarely; exit 3 is the cheapest that is always accepted."""
    model = make_model("llama", seed=0, layers=6)
    with torch.no_grad():
        for layer in model.model.layers[3:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return Runner.from_model(model)


def plain(runner, prompt, n=40):
    return Engine(runner, build_drafter("autoregressive", runner)).generate(prompt, DecodeConfig(max_new_tokens=n))


@pytest.mark.parametrize("exits", ["1", "2", "3", "4", "5", "1/3/5"])
def test_greedy_output_is_plain_decoding_for_every_exit_it_can_pick(runner, exits):
    for prompt, (k, stops) in zip(PROMPTS, [(1, "0"), (4, "0/0.5"), (6, "0.3")], strict=True):
        ref = plain(runner, prompt).tokens
        drafter = build_drafter("dynamic_exit", runner, FORCED | {"exits": exits, "k": k, "stops": stops})
        res = Engine(runner, drafter).generate(prompt, DecodeConfig(max_new_tokens=40))
        assert res.tokens == ref, (exits, k, stops)
        assert res.stats.drafter.draft_forwards > 0 and res.stats.drafter.observed_rows > 0


def test_observed_streams_are_the_models(runner):
    """What verification hands back at each observed layer (split forwards, draft rows for layers below the drafting
    exit) is the stream a plain forward over the same tokens computes entering that layer."""
    drafter = build_drafter("dynamic_exit", runner, FORCED | {"exits": "1/2/4/5", "k": 3})
    drafter._best = lambda: Choice(4, 3, 0.0, 9.0)  # draft from exit 4: the rows of layers 1-2 come from the drafts
    drafter.choice = drafter._best()
    outcomes = []
    learn = drafter._learn
    drafter._learn = lambda outcome: (outcomes.append(outcome), learn(outcome))
    res = Engine(runner, drafter).generate(PROMPTS[0], DecodeConfig(max_new_tokens=30))
    tokens = PROMPTS[0] + res.tokens
    cache = runner.new_cache(64)
    ids = torch.tensor(tokens)
    drafted = [o for o in outcomes if o.draft is not None]
    assert drafted and all(set(o.observed) == {1, 2, 4, 5} for o in drafted)
    for layer in (1, 2, 4, 5):
        cache.reset()
        rows = Rows.one(cache, runner.embed(ids), torch.arange(len(tokens)), kind=ONCE)
        ref = runner.run(Program(0, layer), rows).hidden  # (S, d)
        for o in outcomes:
            rows = o.observed[layer][o.path]  # (P, d)
            assert torch.allclose(rows, ref[o.start:o.start + len(o.path)], atol=1e-4), layer


def test_choice_converges_to_the_exit_that_pays(scripted):
    drafter = build_drafter("dynamic_exit", scripted, FORCED | {"exits": "1/2/3/5", "k": 6})
    engine = Engine(scripted, drafter)
    for prompt in PROMPTS:
        res = engine.generate(prompt, DecodeConfig(max_new_tokens=60))
        assert res.tokens == plain(scripted, prompt, 60).tokens
    stats = res.stats.drafter
    alpha = dict(zip(stats.exits, stats.acceptance, strict=True))
    assert alpha[3] > 0.9 and alpha[5] > 0.9 and alpha[1] < 0.5 and alpha[2] < 0.5, alpha
    assert drafter.choice.exit == 3 and drafter.choice.k >= 4, drafter.choice
    drafted = dict(zip(stats.exits, stats.drafted_cycles, strict=True))
    assert drafted[3] > 2 * (drafted[1] + drafted[2] + drafted[5]), drafted
    assert res.stats.acceptance_rate > 0.9


def test_exploration_drafts_now_and_then_when_nearly_even(scripted):
    """With a bar the cost model never reaches (min_speedup 5), it still drafts its best choice every explore_every
    plain cycles when that choice is predicted near even or better, and observes it; 0 turns it off. Output stays plain
    decoding's."""
    ref = plain(scripted, PROMPTS[2], 60).tokens
    for every, explores in ((4, True), (0, False)):
        options = FORCED | {"exits": "1/3", "k": 4, "min_speedup": 5, "explore_every": every, "observe_every": 1000,
                            "prior": "depth"}  # nearly even from the start: exit 3's prior P(good) is 3 / 6
        res = Engine(scripted, build_drafter("dynamic_exit", scripted, options)).generate(
            PROMPTS[2], DecodeConfig(max_new_tokens=60))
        assert res.tokens == ref
        assert (res.stats.drafter.explored_cycles > 0) == explores and (res.stats.drafted > 0) == explores
        assert (res.stats.drafter.observed_rows > 0) == explores  # an exploration is observed, whatever the cadence


def test_no_drafting_where_no_exit_pays(runner):
    """On the random tiny model no exit agrees with the last layer often enough: the cost model never drafts
    (a forward or two whose chain stops on confidence at once, nothing proposed; explorations off), observes less
    often, and the output is plain decoding's."""
    for options in ({"adaptive": False}, {}):
        drafter = build_drafter("dynamic_exit", runner, {"exits": "1/3/5", "observe_every": 1, "explore_every": 0,
                                                         "calibrate": False} | options)
        res = Engine(runner, drafter).generate(PROMPTS[0], DecodeConfig(max_new_tokens=40))
        assert res.tokens == plain(runner, PROMPTS[0]).tokens
        assert res.stats.drafted == 0 and res.stats.drafter.plain_steps >= 0.9 * res.stats.verify_calls
        assert max(res.stats.drafter.acceptance) < 0.3
        # observed, but SPARSE_OBSERVE times less often than the option says (two cycles of every 8, not every
        # cycle), and the scoring within OBSERVE_SHARE of the decoding time (an observation or two beyond it)
        assert 1 <= res.stats.drafter.observed_rows <= 0.4 * res.stats.verify_calls, res.stats.drafter.observed_rows
        assert drafter.observe_seconds <= OBSERVE_SHARE * drafter.decode_seconds + 2 * drafter.observe_seconds / \
            res.stats.drafter.observed_rows


@pytest.mark.slow
def test_sampling_stays_lossless():
    """Empirical joint of the first 3 tokens under dynamic-exit drafting (exits 1 and 2 of 3) == exact target."""
    model = make_model("llama", seed=7, vocab_size=5, layers=3)
    runner = Runner.from_model(model)
    engine = Engine(runner, build_drafter("dynamic_exit", runner, FORCED | {"exits": "1/2", "k": 3}))
    pvalue, totals = sampling_pvalue(engine, model, [1, 2, 3], SamplingConfig(temperature=1.0),
                                     samples=1000, seed=99)
    assert 0.2 < totals["accepted"] / totals["drafted"] < 0.95  # the draft differs from the target but is used
    assert pvalue > P_THRESHOLD


def _estimates(windows: dict[int, list[tuple[list[float], list[bool]]]], stops=(0.0,)) -> RunEstimates:
    est = RunEstimates(sorted(windows), stops, 0.999)
    for e, ws in windows.items():
        for probs, hits in ws:
            est.add(e, probs, hits)
    return est


def test_cost_model():
    spec = make_model("llama", seed=0, layers=6).config
    prices = exit_prices(Runner.from_model(make_model("llama", seed=0, layers=6)).spec, [1, 3, 5], 320)
    assert 0 < prices[1] < prices[3] < prices[5] < 1 and spec.num_hidden_layers == 6
    one = [1.0]
    low = best_choice(_estimates({1: [(one, [i % 20 == 0]) for i in range(200)],
                                  3: [(one, [i % 10 == 0]) for i in range(200)]}), {1: 0.2, 3: 0.5}, 8, 0.13)
    assert low.speedup < 1 and low.k == 1
    high = best_choice(_estimates({1: [(one, [i % 10 == 0]) for i in range(200)],
                                   3: [(one, [i % 20 != 0]) for i in range(200)]}), {1: 0.2, 3: 0.5}, 8, 0.13)
    assert high.exit == 3 and high.k > 1 and high.speedup > 1
    # independent drafts (no pairs yet): the closed form (1 - a^(k+1)) / (1 - a) / (k c + 1 + s k)
    a, c, s = 0.7, 0.6, 0.13
    for k in (1, 4):
        assert predicted_speedup(RunRates(a, a, 1.0, 1.0), k, c, s) == pytest.approx(
            (1 - a ** (k + 1)) / (1 - a) / (k * c + 1 + s * k))
        # no stop: every chain proposes all k, whose last row runs through every layer (a plain step's price), the
        # other rows only through layers [E, L) (each extra row costs s times the reused verification's 0.3)
        assert predicted_speedup(RunRates(a, a, 1.0, 1.0), k, c, s, verify=0.3) == pytest.approx(
            (1 - a ** (k + 1)) / (1 - a) / (k * c + 1 + s * 0.3 * k))
    # with a stop, chains that stop early verify only layers [E, L): the reused KV makes them cheaper
    stopping = RunRates(0.6, 0.8, 0.7, 0.8)
    assert predicted_speedup(stopping, 6, c, s, verify=0.3) > 1.15 * predicted_speedup(stopping, 6, c, s)


def test_runs_of_good_drafts_raise_the_prediction():
    """Same share of good positions (0.5), in long runs or alternating: runs make longer drafts pay."""
    runs = [[True] * 8 + [False] * 8 for _ in range(20)]
    alternating = [[True, False] * 8 for _ in range(20)]
    rates_runs = _estimates({3: [([1.0] * 16, h) for h in runs]}).rates(3, 0.0)
    rates_alt = _estimates({3: [([1.0] * 16, h) for h in alternating]}).rates(3, 0.0)
    assert rates_runs.good == pytest.approx(rates_alt.good, abs=0.02)
    assert rates_runs.good_after_good > 0.8 > 0.1 > rates_alt.good_after_good
    assert predicted_speedup(rates_runs, 6, 0.3, 0.1) > 1.3 * predicted_speedup(rates_alt, 6, 0.3, 0.1)


def test_the_confidence_stop_is_chosen_where_confidence_tells_hits_from_misses():
    """Confident positions (p 0.9) are hits, unconfident ones (p 0.2) misses: stopping at 0.5 drafts only the hits,
    so (E, k, 0.5) beats drafting k blindly; where confidence says nothing, no stop is best."""
    telling = [([0.9] * 6 + [0.2] * 2, [True] * 6 + [False] * 2) for _ in range(30)]
    est = _estimates({3: telling}, stops=(0.0, 0.5))
    choice = best_choice(est, {3: 0.4}, 8, 0.13)
    assert choice.stop == 0.5 and choice.k >= 6 and choice.speedup > 1, choice
    blind = [([0.2, 0.9] * 4, [True] * 6 + [False] * 2) for _ in range(30)]  # confidence unrelated to hits
    assert best_choice(_estimates({3: blind}, stops=(0.0, 0.5)), {3: 0.4}, 8, 0.13).stop == 0.0


def test_default_exits_are_the_trained_ones(tmp_path):
    folder = save_tiny(tmp_path / "run" / "final", layers=4)
    assert candidate_exits("auto", Runner.from_pretrained(folder)) == [1, 2, 3]  # L/4, L/2, 3L/4
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump({"early_exit": {"exits": [3, 1, 9]}}))
    assert candidate_exits("auto", Runner.from_pretrained(folder)) == [1, 3]  # the last layer's own 4 and 9 drop
    assert candidate_exits("2/3", Runner.from_pretrained(folder)) == [2, 3]


def test_prior_follows_depth_where_the_exits_were_trained(tmp_path):
    """auto: a checkpoint whose training run recorded its exits starts from P(good) = E / L (its deepest candidate
    is the first choice); without that record, or with prior flat, every exit starts at 0.1."""
    folder = save_tiny(tmp_path / "run" / "final", layers=4)
    untrained = build_drafter("dynamic_exit", Runner.from_pretrained(folder), FORCED | {"exits": "1/3"})
    assert untrained.estimates.rates(1, 0.0).good == untrained.estimates.rates(3, 0.0).good == 0.1
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump({"early_exit": {"exits": [1, 3]}}))
    runner = Runner.from_pretrained(folder)
    trained = build_drafter("dynamic_exit", runner, FORCED)
    assert trained.estimates.rates(1, 0.0).good == 0.25 and trained.estimates.rates(3, 0.0).good == 0.75  # E / 4
    assert trained.choice.exit == 3
    flat = build_drafter("dynamic_exit", runner, FORCED | {"prior": "flat"})
    assert flat.estimates.rates(3, 0.0).good == 0.1


def test_drafting_decisions_use_the_measured_cost():
    """A drafted cycle's realised weight-count cost is the cost model's denominator as it happened, and the ratio of
    measured seconds per unit of it to a plain step's seconds divides every drafting prediction."""
    price, verify, slope = 0.5, 0.3, 0.1
    # nothing stopped the chain: its last proposal has no draft forward, so verification reads every layer
    full = realised_cost(price, verify, slope, forwards=4, proposed=4)
    assert full == pytest.approx(4 * price + 1 + slope * verify * 4)
    stopped = realised_cost(price, verify, slope, forwards=3, proposed=2)  # the third forward's token not proposed
    assert stopped == pytest.approx(3 * price + verify + slope * verify * 2)
    sure = RunRates(1.0, 1.0, 1.0, 1.0)  # every draft accepted: 5 tokens for the realised cost of a full chain of 4
    assert predicted_speedup(sure, 4, price, slope, verify) == pytest.approx(
        5 / realised_cost(price, verify, slope, forwards=4, proposed=4))
    timing = CycleTiming()
    assert timing.scale() == 1.0
    for _ in range(3):
        timing.plain_step(0.1)
        timing.cycle(0.3, 1.5)  # 0.2 s per unit of weight-count cost, a plain step 0.1 s
    assert timing.scale() == pytest.approx(2.0)


def test_stats_serialise(runner):
    drafter = build_drafter("dynamic_exit", runner, FORCED | {"exits": "2/4"})
    stats = Engine(runner, drafter).generate(PROMPTS[1], DecodeConfig(max_new_tokens=12)).stats
    assert stats_from_dict(stats.to_dict()["drafter"]) == stats.drafter
    assert stats.drafter.schedule and all(len(entry) == 4 for entry in stats.drafter.schedule)
    assert stats.drafter.stops == [0.0] and {entry[1] for entry in stats.drafter.schedule} & {2, 4}


@pytest.mark.parametrize("options,message", [
    ({"exits": "8,x"}, "exits must be layer numbers"),
    ({"exits": "2/2"}, "duplicates"),
    ({"exits": "6"}, "exit 6 is out of range"),
    ({"exits": "0/2"}, "exit 0 is out of range"),
    ({"decay": "1"}, "decay must be in (0, 1)"),
    ({"observe_every": "0"}, "observe-every must be between"),
    ({"min_speedup": "-1"}, "min-speedup must be in"),
    ({"verify_slope": "-0.1"}, "verify-slope must be in"),
    ({"k": "0"}, "num-draft must be between"),
    ({"stops": "1"}, "stops must each be in [0, 1)"),
    ({"stops": "0/x"}, "stops must be confidence thresholds"),
    ({"explore_every": "-1"}, "explore-every must be >= 0"),
    ({"confidence": "0.5"}, "does not apply to drafter 'dynamic_exit'"),
    ({"exit_layer": "3"}, "does not apply to drafter 'dynamic_exit'"),
])
def test_bad_options_are_refused_in_one_line(runner, options, message):
    with pytest.raises(UserError) as e:
        build_drafter("dynamic_exit", runner, options)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_compact_spec():
    spec = drafter_spec("dynamic_exit", {"exits": "8/16/24", "k": "4"})
    assert spec.cls is DynamicExitDrafter and spec.config.exits == "8/16/24" and spec.config.num_draft == 4


@pytest.mark.real_model
def test_default_model_drafts_rarely_and_exactly(default_model_path):
    """The unchanged default model has no trained exits: the drafter learns that none pays (it drafts on few or no
    cycles) and its output is plain decoding's."""
    from infer.loading import load_model

    model = load_model(str(default_model_path))
    prompt = model.encode("def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"\n")
    cfg = DecodeConfig(max_new_tokens=32, stop_at_eos=False)
    ref = Engine(model.runner, build_drafter("autoregressive", model.runner)).generate(prompt, cfg).tokens
    for calibrate in (False, True):  # weight counts alone (deterministic), then with measured times
        drafter = build_drafter("dynamic_exit", model.runner, {"remember": "off", "calibrate": calibrate})
        res = Engine(model.runner, drafter).generate(prompt, cfg)
        assert res.tokens == ref
        assert res.stats.drafter.plain_steps >= 0.8 * res.stats.verify_calls, (calibrate, res.stats.drafter)
    forced = build_drafter("dynamic_exit", model.runner, FORCED | {"exits": "8/24", "k": 3})
    assert Engine(model.runner, forced).generate(prompt, cfg).tokens == ref


def test_command_line(capsys, tiny_model_dir):
    """`layerskip generate --drafter dynamic_exit` prints plain decoding's tokens and the typed stats; `bench`
    takes it as a compact spec (exits separated by '/', since specs are separated by commas)."""
    import json

    from infer.measure.methods import parse_methods
    from layerskip_cli.main import main

    common = ["generate", "--model", str(tiny_model_dir), "--prompt", "def add", "--json", "--max-new-tokens", "12",
              "--ignore-eos"]
    assert main(common) == 0
    ref = json.loads(capsys.readouterr().out)["tokens"]
    assert main(common + ["--drafter", "dynamic_exit", "--exits", "1/3", "--stops", "0", "--min-speedup", "0",
                          "--no-adaptive"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["tokens"] == ref and row["stats"]["drafter"]["exits"] == [1, 3] and row["stats"]["drafted"] > 0
    methods = parse_methods("autoregressive,dynamic_exit:exits=1/3:k=3", "")
    assert [m.label for m in methods] == ["autoregressive", "dynamic_exit:exits=1/3:k=3"]
    assert main(common + ["--drafter", "dynamic_exit", "--exits", "4"]) == 2
    assert "candidate exits lie in 1 <= E < 4" in capsys.readouterr().err


def test_static_executor_decodes_as_eager(runner):
    """The split verification forwards and observing drafts run on the static executor too, with the same output
    and the same estimates."""
    static = Runner.from_model(make_model("llama", seed=0, layers=6), executor="static")
    results = []
    for r in (runner, static):
        drafter = build_drafter("dynamic_exit", r, FORCED | {"exits": "1/3/5", "k": 3})
        drafter._best = lambda: Choice(3, 3, 0.0, 9.0)  # draft from the middle exit: observed rows on both sides of it
        drafter.choice = drafter._best()
        results.append(Engine(r, drafter).generate(PROMPTS[0], DecodeConfig(max_new_tokens=30)))
    assert results[0].tokens == results[1].tokens == plain(runner, PROMPTS[0], 30).tokens
    assert results[0].stats.drafter.acceptance == results[1].stats.drafter.acceptance


def test_best_choice_is_the_argmax_of_the_prediction():
    """best_choice's running sums give predicted_speedup's value for the (E, k, stop) it picks, and no other
    (E, k, stop) predicts more."""
    import random

    rng = random.Random(0)
    windows = {e: [([rng.random() for _ in range(6)], [rng.random() < a for _ in range(6)]) for _ in range(40)]
               for e, a in ((2, 0.3), (4, 0.8))}
    est = _estimates(windows, stops=(0.0, 0.4, 0.8))
    prices = {2: 0.3, 4: 0.6}
    choice = best_choice(est, prices, 8, 0.13)
    every = {(e, k, s): predicted_speedup(est.rates(e, s), k, prices[e], 0.13)
             for e in (2, 4) for s in (0.0, 0.4, 0.8) for k in range(1, 9)}
    assert choice.speedup == pytest.approx(every[choice.exit, choice.k, choice.stop])
    assert choice.speedup == pytest.approx(max(every.values()))


def test_consecutive_windows_pair_across_their_border():
    """Windows of one position each (plain steps): only windows that follow one another make pairs, so good runs
    show in plain decoding too."""
    one = [1.0]
    apart, together = RunEstimates([3], (0.0,), 0.999), RunEstimates([3], (0.0,), 0.999)
    for hit in [True] * 10 + [False] * 10:
        apart.add(3, one, [hit])
        together.add(3, one, [hit], continues=True)
    assert apart.rates(3, 0.0).good_after_good == pytest.approx(apart.rates(3, 0.0).good)  # no pairs: the marginal
    assert together.rates(3, 0.0).good_after_good > 0.8  # 9 of 10 good positions followed by a good one


def test_first_choice_comes_from_the_prompt(scripted):
    """The prefill keeps each exit's stream at the prompt's last positions and the drafter scores them at its first
    cycle asking for a draft (not at the prefill: a batch whose gate takes plain steps never pays for it): on the
    scripted model the first draft is already from exit 3 (the cheapest always accepted); without prompt rows it starts
    from the flat prior, which favours the cheapest exit."""
    prompt = list(range(3, 40))
    for rows, first in ((16, 3), (0, 1)):
        drafter = build_drafter("dynamic_exit", scripted, FORCED | {"exits": "1/2/3/5", "k": 6, "prompt_rows": rows})
        engine = Engine(scripted, drafter)
        gen = engine.start(prompt, DecodeConfig(max_new_tokens=20))
        assert drafter.stats().prompt_rows == 0 and (gen.state.prompt_observed is not None) == (rows > 0)
        engine.step(gen)
        assert drafter.schedule[0][1] == first, (rows, drafter.schedule)
        assert drafter.stats().prompt_rows == rows


def test_prompt_streams_are_the_models_and_the_prefill_is_unchanged(runner):
    """What the split prefill keeps is the stream entering each exit (and after the last layer) at the prompt's last
    rows, as one unsplit forward computes it; the first token and the decoded output are plain decoding's."""
    prompt = list(range(7, 30))
    drafter = build_drafter("dynamic_exit", runner, FORCED | {"exits": "2/4", "prompt_rows": 5})
    engine = Engine(runner, drafter)
    gen = engine.start(prompt, DecodeConfig(max_new_tokens=30))
    kept = gen.state.prompt_observed
    assert set(kept) == {2, 4, 6} and all(rows.shape == (5, runner.spec.hidden_size) for rows in kept.values())
    ids, cache = torch.tensor(prompt), runner.new_cache(64)
    for layer in (2, 4, 6):
        cache.reset()
        rows = Rows.one(cache, runner.embed(ids), torch.arange(len(prompt)), kind=ONCE)
        ref = runner.run(Program(0, layer), rows).hidden  # (P, d)
        assert torch.allclose(kept[layer], ref[-5:], atol=1e-5), layer
    while not gen.done:
        engine.step(gen)
    assert engine.finish(gen).tokens == plain(runner, prompt, 30).tokens


def test_batch_rows_draft_in_packed_forwards_per_exit(monkeypatch):
    """Rows of a batch that chose the same exit draft together: one packed draft forward per draft step for all of
    them, none per row."""
    from infer.decode.batch import BatchEngine
    from infer.drafters.chain import EarlyExitForward

    runner = Runner.from_model(make_model("llama", seed=7, layers=4))
    calls = {"rows": 0, "one": 0}
    packed, single = EarlyExitForward.rows, EarlyExitForward.__call__
    monkeypatch.setattr(EarlyExitForward, "rows", lambda self, *a: calls.__setitem__("rows", calls["rows"] + 1)
                        or packed(self, *a))
    monkeypatch.setattr(EarlyExitForward, "__call__", lambda self, *a: calls.__setitem__("one", calls["one"] + 1)
                        or single(self, *a))
    options = FORCED | {"exits": "2", "k": 3, "observe_every": 1000}
    with BatchEngine(runner, lambda: build_drafter("dynamic_exit", runner, options), 3) as batch:
        rows = [(e, e.start(p, DecodeConfig(max_new_tokens=20))) for e, p in zip(batch.slots, PROMPTS, strict=True)]
        outcomes = batch.step(rows)
    steps = {o.drafted for o in outcomes}  # each row's k chosen on its own estimates: the same here
    assert len(steps) == 1 and steps.pop() > 0
    assert calls == {"rows": outcomes[0].drafted, "one": 0}  # each draft step one packed forward over the 3 rows


def test_rows_of_a_batch_taking_plain_steps_never_score_their_prompts(runner):
    """A batch whose gate takes plain steps never asks the rows for drafts, so none pays the draft head over its
    prompt's streams; the first cycle that drafts scores them."""
    from infer.decode.batch import BatchEngine
    from infer.decode.batch_gate import BatchGate

    class Plain(BatchGate):
        def drafts(self, rows):
            return False

    options = {"exits": "2/4", "k": 3, "prompt_rows": 5, "adaptive": True, "remember": "off"}
    with BatchEngine(runner, lambda: build_drafter("dynamic_exit", runner, options), 3) as batch:
        batch.gate = Plain()
        results = batch.generate(PROMPTS[:3], DecodeConfig(max_new_tokens=12))
    assert [r.stats.drafter.prompt_rows for r in results] == [0, 0, 0]
    assert [r.tokens for r in results] == [plain(runner, p, 12).tokens for p in PROMPTS[:3]]
