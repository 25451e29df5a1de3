"""What a drafter remembers across commands: on (read and write), read (a warm start that changes nothing), off."""

import pytest

from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter
from infer.model.plan import PlanFile
from infer.model.runner import Runner
from layerskip_core.draft_vocab import DraftVocab
from layerskip_core.errors import UserError
from tiny_models import make_model

PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 250, 17]]
SWIFT = {"context_window": 4, "opt_budget": 0.95, "fallback_opt_budget": 0.95}
EARLY = {"exit_layer": 2, "adaptive": True}


@pytest.fixture(scope="module")
def runner():
    return Runner.from_model(make_model("llama", seed=0, layers=6))


def _decode(runner, name, options, prompt=PROMPTS[0]):
    drafter = build_drafter(name, runner, options)
    with Engine(runner, drafter) as engine:
        return drafter, engine.generate(prompt, DecodeConfig(max_new_tokens=24)).stats.drafter


@pytest.mark.parametrize("name,options", [("swift", SWIFT), ("early_exit", EARLY)])
def test_read_starts_warm_and_changes_nothing_off_starts_cold(runner, tmp_path, name, options):
    """A 'read' drafter starts from what an 'on' drafter saved and says so, but its finish writes nothing; an 'off'
    drafter starts cold whatever is remembered (before, every drafter read and wrote the memory)."""
    first, stats = _decode(runner, name, options)
    assert stats.start_state == "cold"
    memory = first.memory.path
    saved = memory.read_text()
    reader, stats = _decode(runner, name, options | {"remember": "read"}, PROMPTS[1])
    assert stats.start_state == f"warm from {memory}" and reader.memory.path == memory
    assert memory.read_text() == saved  # every warm repeat starts from the same state
    _, stats = _decode(runner, name, options | {"remember": "off"})
    assert stats.start_state == "cold" and memory.read_text() == saved


def test_swift_remember_read_restores_the_remembered_plan(runner):
    """The remembered best plan and score reach a 'read' drafter (that is the warm start a bench can ask for)."""
    first, _ = _decode(runner, "swift", SWIFT)
    reader = build_drafter("swift", runner, SWIFT | {"remember": "read"})
    cold = build_drafter("swift", runner, SWIFT | {"remember": "off"})
    assert reader.best == first.best and reader.best_score == first.best_score >= 0
    assert cold.best_score < 0


def test_remember_refuses_other_values(runner):
    with pytest.raises(UserError, match="remember must be one of on, read, off"):
        build_drafter("swift", runner, {"remember": "sometimes"})


def test_paper_mode_drafts_with_the_full_head_and_records_it(runner, tmp_path):
    """swift:paper=true drafts with the full LM head as every reference does, whatever draft_vocab says; the
    stats and the saved plan file record the head (before, paper mode drafted with the reduced head)."""
    vocab = DraftVocab(ids=tuple(range(0, 320, 2)), model=runner.identity())
    out = tmp_path / "plan.json"
    paper, stats = _decode(runner, "swift", {"paper": True, "context_window": 4, "draft_vocab": vocab,
                                             "max_opt_steps": 3, "save_plan": str(out)})
    assert paper.vocab is None and stats.draft_vocab is None
    assert PlanFile.load(out).draft_head == {"vocab": "full"}
    ours, stats = _decode(runner, "swift", SWIFT | {"draft_vocab": vocab, "save_plan": str(out)})
    assert stats.draft_vocab == vocab.size
    assert PlanFile.load(out).draft_ids == list(vocab.ids)


def test_paper_mode_with_a_plan_does_not_optimise_and_zero_steps_still_runs_one(runner, tmp_path):
    """The reference's cached-plan mode runs no optimisation; its step limit is checked after a step, so
    max_opt_steps=0 in paper mode still scores one candidate (ours: none)."""
    out = tmp_path / "plan.json"
    _decode(runner, "swift", SWIFT | {"save_plan": str(out)})
    cached, stats = _decode(runner, "swift", {"paper": True, "context_window": 4, "plan": str(out)})
    assert stats.opt_steps == 0 and not cached.optimising and cached.best == PlanFile.load(out).plan
    _, stats = _decode(runner, "swift", {"paper": True, "context_window": 4, "max_opt_steps": 0})
    assert stats.opt_steps == 1
    _, stats = _decode(runner, "swift", SWIFT | {"max_opt_steps": 0})
    assert stats.opt_steps == 0


def test_remembered_hopelessness_caps_optimisation_at_one_percent(runner, monkeypatch):
    """A drafter whose restored plan is predicted not to pay optimises at most 1 % of its time while plain, even
    with a generous fallback budget (before, it spent that budget on every prompt: 3 % by default)."""
    from infer.drafters.swift import SwiftDrafter

    monkeypatch.setattr(SwiftDrafter, "predicted_speedup", lambda self, a: None if a < 0 else 0.5)
    generous = SWIFT | {"fallback_opt_budget": 0.9, "opt_budget": 0.9}
    first, _ = _decode(runner, "swift", generous)
    assert first.best_score >= 0 and first.opt_step.cycles > 0 and first.mode == "plain"
    for prompt in PROMPTS:
        drafter = build_drafter("swift", runner, generous | {"remember": "read"})
        assert drafter.hopeless and drafter.mode == "plain"
        with Engine(runner, drafter) as engine:
            stats = engine.generate(prompt, DecodeConfig(max_new_tokens=40)).stats.drafter
        assert stats.hopeless and stats.draft_forwards == 0
        assert drafter.opt_time <= 0.01 * (drafter.decode_time + drafter.opt_time)
    cold = build_drafter("swift", runner, generous | {"remember": "off"})
    assert not cold.hopeless
