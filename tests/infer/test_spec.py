"""Drafter specs: parsed once from any spelling, checked before a model loads, resolved once per model."""

import pytest

from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter, drafter_spec, parse_spec
from infer.drafters.chain import MAX_DRAFT
from infer.drafters.swift import SwiftDrafter
from infer.drafters.swift_paper import SwiftPaperDrafter
from layerskip_core.errors import UserError
from tiny_models import make_model


def test_text_flags_and_keywords_make_the_same_spec():
    text = parse_spec("early_exit:E=8:k=6")
    keywords = drafter_spec("early_exit", {"exit_layer": 8, "num_draft": 6})
    assert text.config == keywords.config and text.given == keywords.given == {"exit_layer", "num_draft"}
    assert parse_spec("autoregressive:target_exit=3").target_exit == 3


@pytest.mark.parametrize("spec,option", [("early_exit:k=100000", "num-draft"), ("self_sd:plan=p.json:k=0", "num-draft"),
                                         ("swift:max_tree_nodes=100000", "max-tree-nodes")])
def test_draft_sizes_are_bounded(spec, option, tmp_path):
    (tmp_path / "p.json").write_text("{}")
    with pytest.raises(UserError, match=f"{option} must be between 1 and {MAX_DRAFT}"):
        parse_spec(spec.replace("p.json", str(tmp_path / "p.json")))


def test_swift_paper_mode_is_its_own_class():
    assert parse_spec("swift").cls is SwiftDrafter and parse_spec("swift:paper=true").cls is SwiftPaperDrafter


def test_a_resolved_spec_builds_fresh_drafters_on_the_same_inputs():
    from infer.model.runner import Runner

    runner = Runner.from_model(make_model("llama", seed=0, layers=4))
    resolved = parse_spec("early_exit:E=2:k=3:adaptive=true:remember=off").resolve(runner)
    first, second = resolved.build(runner), resolved.build(runner)
    assert first is not second and first.gate is not second.gate and first.config is second.config
    config = DecodeConfig(max_new_tokens=8)
    plain = Engine(runner, build_drafter("autoregressive", runner)).generate([1, 2, 3], config)
    assert Engine(runner, first).generate([1, 2, 3], config).tokens == plain.tokens
