"""Measured drafting costs (infer.drafters.costs): c of any draft forward and v(T) timed against a plain step, kept in
the toolkit cache per model and machine setting, extended with what a caller lacks, refused when damaged; the
drafters' cost models read them (SWIFT, dynamic exit, the adaptive early exit)."""

import json

import pytest
import torch

from infer.drafters import build_drafter, costs
from infer.drafters.chain import EarlyExitForward
from infer.drafters.costs import exit_costs, measure_costs, measured_exit_prices, plan_costs
from infer.model.runner import Runner
from tiny_models import make_model


@pytest.fixture(scope="module")
def runner():
    return Runner.from_model(make_model("llama", seed=0, layers=6))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(costs, "cache_root", lambda: tmp_path)
    return tmp_path / "costs"


def forbid_timing(monkeypatch):
    def timed(*args, **kwargs):
        raise AssertionError("timed again")

    monkeypatch.setattr(costs, "_timed_rounds", timed)


def test_costs_are_ratios_to_a_plain_step_and_kept_once(runner, cache, monkeypatch, capsys):
    measured = measure_costs(runner, {"exit2": EarlyExitForward(runner, 2)}, 6)
    assert measured.verify[0] == 1.0 and len(measured.verify) == 6 and measured.step_seconds > 0
    assert all(b >= a for a, b in zip(measured.verify, measured.verify[1:], strict=False))  # never falling with T
    assert 0 < measured.drafts["exit2"] < 3 and measured.where == str(next(cache.glob("*.json")))
    assert "measured this model's draft and verification costs once" in capsys.readouterr().err
    forbid_timing(monkeypatch)
    again = measure_costs(runner, {"exit2": EarlyExitForward(runner, 2)}, 4)  # kept: nothing timed, v up to 6 kept
    assert again.drafts == measured.drafts and again.verify == measured.verify and capsys.readouterr().err == ""


def test_only_what_the_record_lacks_is_timed_and_added(runner, cache, monkeypatch):
    first = measure_costs(runner, {"exit2": EarlyExitForward(runner, 2)}, 4)
    seen = []
    timed = costs._timed_rounds

    def spy(run, drafts, sizes, rounds):
        seen.append((sorted(drafts), sizes))
        return timed(run, drafts, sizes, rounds)

    monkeypatch.setattr(costs, "_timed_rounds", spy)
    both = measure_costs(runner, {"exit2": EarlyExitForward(runner, 2), "exit4": EarlyExitForward(runner, 4)}, 4)
    assert seen == [(["exit4"], [])] and both.drafts["exit2"] == first.drafts["exit2"] and "exit4" in both.drafts
    measure_costs(runner, {"exit4": EarlyExitForward(runner, 4)}, 12)  # a larger T: v timed again, nothing else
    assert seen[-1] == ([], [2, 4, 8, 12])


def test_another_thread_count_or_model_measures_afresh(runner, cache):
    measure_costs(runner, {"exit2": EarlyExitForward(runner, 2)}, 4)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        measure_costs(runner, {"exit2": EarlyExitForward(runner, 2)}, 4)
    finally:
        torch.set_num_threads(threads)
    other = Runner.from_model(make_model("llama", seed=3, layers=6))
    measure_costs(other, {"exit2": EarlyExitForward(other, 2)}, 4)
    assert len(list(cache.glob("*.json"))) == 3


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": "layerskip-costs/1", "verify": [1.0]}),
                                     json.dumps({"format": "layerskip-costs/1", "step_seconds": 0.1,
                                                 "verify": [1.0, float("nan")], "drafts": {}})])
def test_a_damaged_record_is_measured_again_with_one_line(runner, cache, capsys, content):
    measure_costs(runner, {"exit2": EarlyExitForward(runner, 2)}, 4)
    (path,) = cache.glob("*.json")
    path.write_text(content)
    capsys.readouterr()
    again = measure_costs(runner, {"exit2": EarlyExitForward(runner, 2)}, 4)
    err = capsys.readouterr().err.strip().splitlines()
    assert str(path) in err[0] and "measuring again" in err[0] and again.drafts["exit2"] > 0
    assert json.loads(path.read_text())["drafts"]["exit2"] == again.drafts["exit2"]  # rewritten whole


def test_plan_and_exit_prices_come_from_the_measurement(runner, cache):
    cost, measured = plan_costs(runner, None, 5)
    assert 0 < cost.base < 1 and cost.attn >= 0 and cost.mlp >= 0 and cost.source == "measured"
    assert cost.verify == list(measured.verify[:5])
    prices, _ = exit_costs(runner, [1, 3, 5], None, 4)
    assert set(prices) == {1, 3, 5}
    exits = measured_exit_prices(runner, [1, 3, 5], None, 4)
    assert all(0 < v <= 1 for v in exits.verify.values()) and exits.verify[5] <= exits.verify[1]
    assert exits.slope >= 0 and exits.draft == {e: prices[e] for e in (1, 3, 5)}


def test_drafters_price_with_measured_costs_unless_told_weights(runner, cache):
    swift = build_drafter("swift", runner, {"remember": "off"})
    assert swift.prices.step_seconds is not None and swift.prices.cost.source == "measured"
    assert build_drafter("swift", runner, {"remember": "off", "costs": "weights"}).prices.step_seconds is None
    dynamic = build_drafter("dynamic_exit", runner, {"exits": "1/3", "remember": "off"})
    measured = measured_exit_prices(runner, [1, 3], None, dynamic.config.num_draft)
    assert dynamic.prices == measured.draft and dynamic.slope == measured.slope
    assert build_drafter("dynamic_exit", runner, {"exits": "1/3", "costs": "weights"}).slope == 0.13
    early = build_drafter("early_exit", runner, {"E": "3", "k": "4", "adaptive": "true", "remember": "off"})
    prices, measured = exit_costs(runner, [3], None, 5)
    assert early.shadow.c == prices[3] and early.shadow.v == measured.v(5)
