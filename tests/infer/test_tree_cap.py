"""``max_tree_nodes`` caps a token tree's drafted tokens, the chain's included: a tree of at most N nodes drafts at
most N tokens per verification (a verification of at most N + 1), also where the chain's k is larger than N (a
chain of k used to be verified whole: ``--max-tree-nodes 1 --num-draft 6`` drafted 49 nodes in 9 verifications).
The output stays plain decoding's."""

from __future__ import annotations

import pytest

from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter
from infer.drafters.swift import SwiftDrafter

PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 250, 17], [42] * 12 + [7, 8]]
# ``model`` (seeded, 6 layers) and ``eager`` (its runner) come from tests/infer/conftest.py


pytestmark = pytest.mark.usefixtures("private_cache")  # tests/infer/conftest.py


def _decode_recording(runner, name: str, options: dict) -> tuple[list[list[int]], list[int], list]:
    """(outputs over PROMPTS, drafted tokens of every verified draft, generation stats) with ``name``/``options``."""
    drafter = build_drafter(name, runner, options)
    sizes, update = [], drafter.update

    def recording(state, outcome):
        if outcome.draft is not None:
            sizes.append(outcome.draft.size)
        update(state, outcome)

    drafter.update = recording
    engine = Engine(runner, drafter)
    results = [engine.generate(p, DecodeConfig(max_new_tokens=32)) for p in PROMPTS]
    return [r.tokens for r in results], sizes, [r.stats for r in results]


def _plain(runner) -> list[list[int]]:
    engine = Engine(runner, build_drafter("autoregressive", runner))
    return [engine.generate(p, DecodeConfig(max_new_tokens=32)).tokens for p in PROMPTS]


@pytest.mark.parametrize(("k", "cap"), [(6, 1), (6, 4), (4, 2)])
def test_early_exit_trees_draft_at_most_the_cap_and_stay_exact(eager, k, cap):
    """No confidence stop: the chain alone would run k deep. With the cap below k it stops at the cap, its draft
    forwards included, and the greedy output is plain decoding's."""
    options = {"E": 3, "k": k, "tree": True, "max_tree_nodes": cap}
    outs, sizes, stats = _decode_recording(eager, "early_exit", options)
    assert outs == _plain(eager)
    assert max(sizes) == cap  # drafted up to the cap, never beyond
    assert sum(s.drafted for s in stats) <= cap * sum(s.verify_calls for s in stats)
    assert sum(s.drafter.draft_forwards for s in stats) <= cap * len(sizes)  # no chain token drafted past the cap
    assert build_drafter("early_exit", eager, options).needs().lookahead == cap + 1


def test_early_exit_trees_with_an_adapter_and_a_confidence_stop_keep_the_cap(eager, model, tmp_path):
    """The recommended shape (adapter, k = 6, keep_last, a confidence stop, cap 4): at most 4 drafted tokens."""
    from tiny_models import noisy_adapter

    adapter = tmp_path / "a.safetensors"
    noisy_adapter(model, adapter, 3, noise=0.05, seed=1, mlp_size=16)
    options = {"adapter": str(adapter), "k": 6, "confidence": 0.02, "keep_last": True, "tree": True,
               "max_tree_nodes": 4}
    outs, sizes, _ = _decode_recording(eager, "early_exit", options)
    assert outs == _plain(eager)
    assert max(sizes) == 4


def test_swift_trees_draft_at_most_the_cap_and_stay_exact(eager):
    options = {"num_draft": 6, "tree": True, "max_tree_nodes": 2, "confidence": 0.0, "adaptive": False,
               "max_opt_steps": 0, "remember": "off"}
    outs, sizes, _ = _decode_recording(eager, "swift", options)
    assert outs == _plain(eager)
    assert sizes and max(sizes) == 2


def test_swift_cost_model_counts_the_chain_the_cap_allows(eager):
    """SWIFT's predicted speed-up maximises over the chain depths k it can draft: 1..min(num_draft, cap) with a
    tree (it counted depths up to num_draft, which the cap never lets a cycle reach)."""
    drafter = SwiftDrafter(eager, SwiftDrafter.Config(num_draft=8, max_tree_nodes=2, remember="off"))
    drafter.plain.add(1, 0.1)  # 10 tokens/s plain
    drafter.draft_forward.add(10, 0.1)  # c = 0.01 s / 0.1 s = 0.1: long chains would pay
    drafter.verify.add(1, 0.1)  # v = 1
    a = 0.95
    assert drafter.predicted_speedup(a) == pytest.approx(max((1 - a ** (k + 1)) / (1 - a) / (0.1 * k + 1)
                                                             for k in (1, 2)))
