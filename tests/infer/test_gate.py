"""The fallback gate's memory: what early_exit --adaptive and swift learned survives into the next command."""

import json

import pytest
import torch

from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter, gate
from infer.model.runner import Runner
from tiny_models import make_model

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def runner():
    return Runner.from_model(make_model("llama", seed=0, layers=6))


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(gate, "cache_root", lambda: tmp_path / "cache")  # the toolkit cache, for gate memory
    return tmp_path / "cache"


def decode(runner, drafter, n=40):
    return Engine(runner, drafter).generate(PROMPT, DecodeConfig(max_new_tokens=n))


@pytest.mark.parametrize("name,options", [("early_exit", {"E": "2", "k": "3", "adaptive": "true"}),
                                          ("swift", {"max_opt_steps": "0"})])
def test_a_new_command_continues_from_what_the_gate_learned(runner, cache, name, options):
    first = build_drafter(name, runner, options)
    decode(runner, first)
    assert not cache.exists()  # nothing is written while decoding or by stats()
    first.finish()
    assert len(list((cache / "gate").glob(f"{name}-*.json"))) == 1
    again = build_drafter(name, runner, options)  # a later command, same model and settings
    assert again.gate.to_dict() == first.gate.to_dict()
    assert again.gate.plain.cycles >= 3  # no fresh warm-up of plain steps on the next prompt
    if name == "swift":
        assert again.draft_forward.to_dict() == first.draft_forward.to_dict()


def test_other_settings_threads_or_models_start_afresh(runner, cache):
    options = {"E": "2", "k": "3", "adaptive": "true"}
    first = build_drafter("early_exit", runner, options)
    decode(runner, first)
    first.finish()
    assert build_drafter("early_exit", runner, options).gate.plain.cycles > 0
    assert build_drafter("early_exit", runner, options | {"k": "4"}).gate.plain.cycles == 0
    other = Runner.from_model(make_model("llama", seed=3, layers=6))
    assert build_drafter("early_exit", other, options).gate.plain.cycles == 0
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert build_drafter("early_exit", runner, options).gate.plain.cycles == 0
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": "layerskip-gate/1", "gate": {"mode": "plain"}}),
                                     json.dumps([1, 2])])
def test_a_damaged_memory_is_ignored_and_rewritten(runner, cache, content):
    options = {"E": "2", "k": "3", "adaptive": "true"}
    first = build_drafter("early_exit", runner, options)
    first.finish()
    (path,) = (cache / "gate").glob("*.json")
    path.write_text(content)
    again = build_drafter("early_exit", runner, options)
    assert again.gate.plain.cycles == 0 and again.gate.mode == "plain"
    res = decode(runner, again)
    assert res.tokens == decode(runner, build_drafter("autoregressive", runner)).tokens
    again.finish()
    assert json.loads(path.read_text())["gate"]["plain"]["cycles"] > 0


def test_a_remembered_plain_mode_spends_nothing_on_probes(runner, cache):
    """Once drafting was measured not to pay, the next command's prompt takes plain steps only."""
    options = {"E": "2", "k": "3", "adaptive": "true"}
    fresh = build_drafter("early_exit", runner, options)
    fresh.shadow.seen = fresh.shadow.good = 100.0  # as if exit 2 had been seen to agree everywhere: it probes
    assert decode(runner, fresh).stats.drafted > 0
    fresh.gate.plain.add(10, 1.0)  # as if plain steps had measured faster than drafting
    fresh.gate.drafting.add(1, 1.0)
    fresh.gate.load(fresh.gate.to_dict() | {"mode": "plain", "mode_cycles": 0})
    fresh.finish()
    again = build_drafter("early_exit", runner, options)
    res = decode(runner, again)
    assert res.stats.drafted == 0 and again.gate.mode == "plain"


def test_a_fresh_gate_does_not_probe_an_exit_seen_not_to_agree(runner, cache):
    """The adaptive early exit watches its exit on plain steps (shadow drafts): an exit whose drafts would not be
    accepted is never probed, so a cold start costs no drafting (Gemma 3 270M's untrained exit 9: 0.15-0.3x when
    probed); the output is plain decoding's."""
    options = {"E": "1", "k": "3", "adaptive": "true", "costs": "weights"}
    drafter = build_drafter("early_exit", runner, options)
    drafter.shadow.share = 1.0  # every plain step scored: on a tiny model the head costs a step (timing-free test)
    res = decode(runner, drafter)
    assert res.stats.drafted == 0 and drafter.shadow.seen > 7 and drafter.shadow.acceptance < 0.3
    assert res.tokens == decode(runner, build_drafter("autoregressive", runner)).tokens
    drafter.finish()
    again = build_drafter("early_exit", runner, options)  # the next command starts from what it saw
    assert again.shadow.seen == drafter.shadow.seen and again.shadow.predicted() < gate.FallbackGate.HOPELESS


def test_a_fresh_gate_probes_an_exit_seen_to_agree(cache):
    """An exit that agrees with the model is seen to on plain steps, predicted to pay and probed: here layers 4 and 5
    of 6 add nothing to the stream (their output projections zeroed), so exit 4's drafts are the model's."""
    model = make_model("llama", seed=0, layers=6)
    with torch.no_grad():
        for layer in model.model.layers[4:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    runner = Runner.from_model(model)
    drafter = build_drafter("early_exit", runner, {"E": "4", "k": "3", "adaptive": "true", "costs": "weights"})
    drafter.shadow.share = 1.0  # every plain step scored (timing-free test)
    res = decode(runner, drafter, 120)
    assert drafter.shadow.acceptance > 0.8 and res.stats.drafted > 0 and res.stats.accepted == res.stats.drafted
    assert res.tokens == decode(runner, build_drafter("autoregressive", runner), 120).tokens


def damaged(saved: dict, how: str) -> dict:
    rate = saved["gate"]["plain"]
    changes = {"gate is a list": {"gate": [1, 2]},
               "NaN rate": {"gate": saved["gate"] | {"plain": rate | {"seconds": float("nan")}}},
               "absurd rate": {"gate": saved["gate"] | {"plain": rate | {"tokens": 5, "seconds": 1e-300}}},
               "negative cycles": {"gate": saved["gate"] | {"drafting": rate | {"cycles": -3}}},
               "fractional back-off": {"gate": saved["gate"] | {"recheck": 2.5}},
               "plan of booleans": {"plan": {"attn": [True], "mlp": []}, "score": 0.5},
               "infinite score": {"plan": {"attn": [1], "mlp": []}, "score": 1e308 * 10}}
    return saved | changes[how]


@pytest.mark.parametrize("name,options", [("early_exit", {"E": "2", "k": "3", "adaptive": "true"}),
                                          ("swift", {"max_opt_steps": "0"})])
@pytest.mark.parametrize("how", ["gate is a list", "NaN rate", "absurd rate", "negative cycles", "fractional back-off",
                                 "plan of booleans", "infinite score"])
def test_a_corrupted_memory_is_reset_with_a_warning_naming_it(runner, cache, capsys, name, options, how):
    first = build_drafter(name, runner, options)
    decode(runner, first, 20)
    first.finish()
    (path,) = (cache / "gate").glob("*.json")
    path.write_text(json.dumps(damaged(json.loads(path.read_text()), how)))
    capsys.readouterr()
    again = build_drafter(name, runner, options)
    err = capsys.readouterr().err
    assert str(path) in err and "starting afresh" in err and len(err.strip().splitlines()) == 1
    assert again.gate.plain.cycles == 0  # nothing of the damaged file is trusted
    assert decode(runner, again, 20).tokens == decode(runner, build_drafter("autoregressive", runner), 20).tokens
    again.finish()
    gate.check_memory(json.loads(path.read_text()))  # what is written back is sane
    capsys.readouterr()
    build_drafter(name, runner, options)
    assert capsys.readouterr().err == ""  # later runs are not broken
