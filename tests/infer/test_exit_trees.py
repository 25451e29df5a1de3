"""Early exit verifying token trees (``tree``): siblings of the drafted chain hang off it, the accepted path may take
one, and the draft's own caches (an adapter's, a copied prefix's) keep only the rows of tokens the chain ran."""

from __future__ import annotations

import pytest
import torch
from lossless_stats import P_THRESHOLD, sampling_pvalue

from infer.decode.cycle import step_rows
from infer.decode.engine import DecodeConfig, Engine, start_rows
from infer.drafters import build_drafter
from infer.drafters.base import Draft, VerifyOutcome
from infer.drafters.tree import chain_rows_kept
from infer.model.runner import Runner
from infer.model.sampling import SamplingConfig
from layerskip_core.errors import UserError
from tiny_models import make_model, noisy_adapter

PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 250, 17], [42] * 12 + [7, 8]]
# ``model`` (seeded, 6 layers) and ``eager`` (its runner) come from tests/infer/conftest.py


@pytest.fixture(scope="module")
def adapter(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("adapter") / "a.safetensors"
    noisy_adapter(model, path, 3, noise=0.05, seed=1, mlp_size=16)
    return str(path)


def _outcome(path: list[int], parents: list[int]) -> VerifyOutcome:
    draft = Draft(torch.zeros(len(parents), dtype=torch.long), parents)
    return VerifyOutcome(draft, path, [0] * len(path), start=10)


def test_rows_kept_stop_at_the_first_sibling_the_path_takes():
    parents = [0, 1, 2, 0, 1]  # a chain of 3, then a sibling of node 1 (position 4) and of node 2 (position 5)
    assert chain_rows_kept(_outcome([0, 1, 2, 3], parents)) == 4  # the whole chain
    assert chain_rows_kept(_outcome([0, 1, 5], parents)) == 2  # node 1, then the sibling of node 2
    assert chain_rows_kept(_outcome([0, 4], parents)) == 1  # the sibling of node 1: only the pending token's row
    assert chain_rows_kept(_outcome([0], parents)) == 1


def _decode(runner, options, new_tokens=32):
    """(outputs, sibling acceptances) of early exit with ``options`` over PROMPTS."""
    drafter = build_drafter("early_exit", runner, options)
    siblings, update = [0], drafter.update

    def counted(state, outcome):
        chain = outcome.draft is None or outcome.draft.parents is None or all(
            node == i for i, node in enumerate(outcome.path))
        siblings[0] += not chain
        update(state, outcome)

    drafter.update = counted
    engine = Engine(runner, drafter)
    return [engine.generate(p, DecodeConfig(max_new_tokens=new_tokens)).tokens for p in PROMPTS], siblings[0]


def _plain(runner, new_tokens=32):
    engine = Engine(runner, build_drafter("autoregressive", runner))
    return [engine.generate(p, DecodeConfig(max_new_tokens=new_tokens)).tokens for p in PROMPTS]


@pytest.mark.parametrize("case", ["exit", "adapter_shared", "adapter_copy", "adapter_copy_bf16"])
def test_greedy_trees_equal_plain_decoding_and_take_siblings(eager, adapter, case):
    """Paths that leave the chain for a sibling are taken (the tiny model's drafts are often second-best), and the
    adapter's cache and a copied prefix's are rolled back to the chain rows the path kept, then refilled."""
    options = {"E": 3, "k": 4, "tree": True, "max_tree_nodes": 8, "confidence": 0.02, "keep_last": True}
    if case != "exit":
        options |= {"adapter": adapter, "prefix": "shared" if case.endswith("shared") else "copy"}
    if case.endswith("bf16"):
        options["draft_dtype"] = "bf16"
    outs, siblings = _decode(eager, options)
    assert outs == _plain(eager)
    assert siblings > 0, case


@pytest.mark.parametrize("prefix", ["shared", "copy"])
def test_the_adapter_cache_holds_the_rows_of_the_sequence_tokens(eager, adapter, prefix):
    """Stale rows would not change the output (verification is exact) but would spoil later drafts: after every
    verification, each row the adapter's cache holds equals the row a fresh start over the tokens computes."""
    options = {"adapter": adapter, "k": 4, "tree": True, "max_tree_nodes": 8, "confidence": 0.02, "keep_last": True,
               "prefix": prefix, "draft_dtype": "model"}
    drafter = build_drafter("early_exit", eager, options)
    checked, siblings, update = [0], [0], drafter.update

    def checking(state, outcome):
        update(state, outcome)
        siblings[0] += outcome.draft is not None and any(node != i for i, node in enumerate(outcome.path))
        own = drafter.forward.cache if prefix == "shared" else drafter.forward.adapter_cache
        have = own.lengths[0]
        fresh = build_drafter("early_exit", eager, options).forward
        fresh.start(eager.new_cache(state.n + 8), state.tokens[:have])
        if prefix == "copy":
            fresh.fill()  # a copy runs over the prompt at its first draft
        want = fresh.cache if prefix == "shared" else fresh.adapter_cache
        torch.testing.assert_close(own.k[:, :, :have], want.k[:, :, :have], rtol=1e-4, atol=1e-5)
        checked[0] += have > 0

    drafter.update = checking
    engine = Engine(eager, drafter)
    for p in PROMPTS:
        engine.generate(p, DecodeConfig(max_new_tokens=24))
    assert checked[0] > 10 and siblings[0] > 0


def test_a_copied_prefix_runs_over_the_prompt_at_its_first_draft_and_not_before(eager, adapter):
    """Where a batch's gate takes plain steps only (drafting does not pay at that B), the copy never runs: its caches
    stay empty through plain steps and fill (the prompt and every token since) at the first draft, output exact."""
    drafter = build_drafter("early_exit", eager, {"adapter": adapter, "k": 4, "prefix": "copy", "draft_dtype": "model"})
    engine = Engine(eager, drafter)
    gen = engine.admit(PROMPTS[0], DecodeConfig(max_new_tokens=16))
    start_rows([(engine, gen)])
    for _ in range(3):
        step_rows([(engine, gen)], plain=True)
    assert drafter.forward.cache.lengths[0] == drafter.forward.adapter_cache.lengths[0] == 0
    while not gen.done:
        step_rows([(engine, gen)])
    assert drafter.forward.cache.lengths[0] > len(PROMPTS[0]) + 3
    assert engine.finish(gen).tokens == _plain(eager, 16)[0]


def test_a_tree_never_exceeds_its_node_cap(eager, adapter):
    drafter = build_drafter("early_exit", eager, {"adapter": adapter, "k": 3, "tree": True, "max_tree_nodes": 5})
    sizes, propose = [], drafter.propose

    def recorded(state):
        draft = propose(state)
        sizes.append(0 if draft is None else draft.size)
        return draft

    drafter.propose = recorded
    Engine(eager, drafter).generate(PROMPTS[0], DecodeConfig(max_new_tokens=24))
    assert max(sizes) == 5 and drafter.needs().lookahead == 6


def test_a_bad_node_cap_is_a_one_line_error(eager):
    with pytest.raises(UserError, match="max-tree-nodes"):
        build_drafter("early_exit", eager, {"tree": True, "max_tree_nodes": 0})


@pytest.mark.slow
def test_sampled_trees_with_an_adapter_match_the_target(tmp_path):
    """Siblings drawn without replacement from the adapter's distribution, accepted by recursive rejection."""
    model = make_model("llama", seed=7, vocab_size=5, layers=3)
    path = tmp_path / "a.safetensors"
    noisy_adapter(model, path, 1, noise=0.3)
    runner = Runner.from_model(model)
    drafter = build_drafter("early_exit", runner, {"adapter": str(path), "k": 3, "tree": True, "max_tree_nodes": 6})
    pvalue, totals = sampling_pvalue(Engine(runner, drafter), model, [1, 2, 3], SamplingConfig(temperature=1.0),
                                     samples=2500, seed=99)
    assert totals["drafted"] > 3 * totals["accepted"] > 0  # trees were drafted (several nodes per accepted one)
    assert pvalue > P_THRESHOLD
