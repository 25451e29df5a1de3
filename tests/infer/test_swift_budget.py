"""SWIFT's cost of looking for a plan (optimisation, probes) is bounded by what drafting could gain on the model.

The situation of Gemma 3 270M on GSM8K (docs/SWIFT.md, "The cost of looking"): a draft forward at c ~ 0.28 of a
step, v(2) ~ 1.04, best matchness 0.1-0.2, where about 0.35 is needed to pay. Prices are injected (measured-style,
v(T) growing with T) and matchness is pinned, so nothing here depends on timing.
"""

import pytest

import infer.drafters.swift as swift_module
from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter
from infer.drafters.costs import PlanPrices
from infer.drafters.gate import FallbackGate
from infer.drafters.swift import SwiftDrafter
from infer.model.plan import CostModel
from infer.model.runner import Runner
from tiny_models import make_model

BAR = 1 + FallbackGate.MARGIN  # what the gate keeps: drafting that beats plain steps by its margin


pytestmark = pytest.mark.usefixtures("private_cache")  # tests/infer/conftest.py


@pytest.fixture(scope="module")
def runner():
    return Runner.from_model(make_model("llama", seed=0, layers=6))


def gemma_like_prices(tokens: int = 64) -> PlanPrices:
    """Measured-style prices of a uniform plan skipping 3 of the tiny model's 12 sublayers: c = 0.1 + 9 x 0.02 =
    0.28 of a step, v(2) = 1.04, v(T) + 0.14 per further token (Gemma 3 270M's measured costs, 1 thread)."""
    verify = [1.0] + [1.04 + 0.14 * (t - 2) for t in range(2, tokens + 1)]
    return PlanPrices(CostModel(0.1, 0.02, 0.02, verify, "measured"), 1.0, 1e-4)


def swift(runner, **options) -> SwiftDrafter:
    drafter = build_drafter("swift", runner, {"remember": "off", "costs": "weights"} | options)
    drafter.prices = gemma_like_prices()
    return drafter


@pytest.mark.parametrize("matchness,probes", [(0.2, False), (0.5, True)])
def test_a_probe_needs_a_prediction_that_clears_the_gate(runner, monkeypatch, matchness, probes):
    """Matchness 0.2 predicts 0.91x: above the gate's old 0.9 bar (it probed, drafting at ~0.1 acceptance on
    Gemma's GSM8K prompts), below what the gate keeps: no probe now. Matchness 0.5 predicts 1.14x: it probes."""
    monkeypatch.setattr(swift_module, "matchness_span", lambda state, plans, *a, **k: [matchness] * len(plans))
    drafter = swift(runner, context_window=4, opt_budget=0.95, fallback_opt_budget=0.95)
    predicted = drafter.predicted_speedup(matchness)
    assert (FallbackGate.HOPELESS <= predicted < BAR) if not probes else predicted >= BAR
    res = Engine(runner, drafter).generate([5, 6, 7, 8, 9], DecodeConfig(max_new_tokens=40))
    assert drafter.best_score == matchness and res.stats.drafter.opt_steps > 0
    assert (drafter.gate.drafting.cycles > 0) == probes
    assert (res.stats.drafted > 0) == probes


def ready(drafter, step: float = 0.02) -> SwiftDrafter:
    """A drafter whose window is set and whose scored plans took ``step`` seconds each."""
    drafter.window = (0, 4)
    drafter.opt_step.add(1, step)
    return drafter


def test_a_probe_earns_the_drafting_share_of_its_own_time_only(runner):
    """10 s of plain decoding with 3 % of it spent optimising: the budget is used up. A probe used to lift the share
    to 25 % of the whole history (10 s of plain time included) and optimise through it; it earns 25 % of its own."""
    drafter = ready(swift(runner))
    drafter.decode_time, drafter.opt_time_total = 10.0, 0.31
    assert drafter.mode == "plain" and not drafter.within_budget()
    drafter.gate.switch("draft")  # a probe starts
    assert not drafter.within_budget()
    drafter.decode_time += 2.0
    drafter.draft_time = 2.0  # the probe drafted for 2 s: 25 % of it is the probe's own
    assert drafter.within_budget()


@pytest.mark.parametrize("speedup,allowed", [(1.05, False), (2.0, True)])
def test_optimisation_while_drafting_spends_at_most_what_drafting_gains(runner, speedup, allowed):
    """Drafting measured at 1.05x saves 1 - 1/1.05 = 4.8 % of its time: optimising 10 % of it (within the 25 %
    opt_budget) made SWIFT slower than plain decoding while the gate kept drafting. At 2x the full 25 % applies."""
    drafter = ready(swift(runner))
    drafter.gate.switch("draft")
    drafter.gate.plain.add(10, 1.0)  # 10 tokens/s plain
    drafter.gate.drafting.add(10 * speedup, 1.0)
    drafter.decode_time, drafter.opt_time_total = 10.0, 1.0
    drafter.draft_time = 11.0  # all of it while drafting
    assert drafter.within_budget() == allowed


@pytest.mark.parametrize("best,allowed", [(0.05, False), (0.5, True)])
def test_plain_share_follows_how_near_the_best_plan_is_to_paying(runner, best, allowed):
    """2 % of plain time spent optimising: within the 3 % fallback share when the best plan's matchness (0.5)
    clears the gate; over it when the best plan (0.05) is far from the ~0.35 needed (1 %, the floor)."""
    drafter = ready(swift(runner))
    drafter.best_score = best
    drafter.decode_time, drafter.opt_time_total = 10.0, 0.2
    assert drafter.mode == "plain" and drafter.within_budget() == allowed


def test_the_first_look_gets_the_fallback_share(runner):
    """Before any plan was scored nothing is known: the first step may take the whole fallback share."""
    drafter = ready(swift(runner))
    drafter.decode_time, drafter.opt_time_total = 10.0, 0.2
    assert drafter.best_score < 0 and drafter.within_budget()
