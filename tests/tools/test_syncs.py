"""Host syncs per draft-verify cycle on the static executor (what CUDA graphs need), counted on the CPU."""

import pytest
import torch

from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter
from infer.drafters.base import DecodeState
from infer.drafters.chain import draft_chain
from infer.model.kv_cache import ints_to_device
from infer.model.plan import LayerPlan, PlanFile
from infer.model.runner import Runner
from infer.model.sampling import SamplingConfig
from tiny_models import make_model
from tools.syncs import SyncCounter, measure_decode

L = 8
PROMPT = [17, 240, 5, 99, 123, 61, 7, 300, 42, 11, 18, 77]


@pytest.fixture(scope="module")
def runner():
    return Runner.from_model(make_model("llama", seed=0, layers=L), executor="static")


def test_counter_sees_every_kind_of_host_read():
    x = torch.randn(3, 5)
    t = torch.tensor([2])
    with SyncCounter() as syncs:
        x.argmax(-1).tolist()  # a read
        x[0, t[0]]  # indexing with a 0-dim tensor reads it
        float(x[0, 0])  # a read (counted once, not once per op it dispatches)
        bool(x[0, 0] > 0)
        torch.tensor([1, 2], device="cpu")  # host data built on the device: a blocking copy on CUDA
        ints_to_device([1, 2], torch.device("cpu"))  # the runner's pinned path: no sync
        torch.tensor([1, 2]).pin_memory() if torch.cuda.is_available() else None
    assert syncs.counts["reads"] == 4 and syncs.counts["h2d"] == 1


def _measure(runner, name, options, sampling=None):
    engine = Engine(runner, build_drafter(name, runner, options))
    config = DecodeConfig(max_new_tokens=40, stop_at_eos=False, sampling=sampling or SamplingConfig())
    return measure_decode(engine, PROMPT, config)


def _plan(runner, tmp_path):
    path = tmp_path / "plan.json"
    PlanFile(LayerPlan(L, skip_attn=frozenset({L - 3}), skip_mlp=frozenset({L - 2})), runner.identity(),
             source="test").save(path)
    return str(path)


def test_greedy_sync_budgets(runner, tmp_path):
    """One read per greedy verification; a confidence-stopped chain adds one per draft step; a tree one more."""
    ar = _measure(runner, "autoregressive", {})
    assert ar["per_cycle"] == 1.0 and ar["prefill"] == 1
    fixed = _measure(runner, "early_exit", {"exit_layer": L // 2, "num_draft": 4})
    assert fixed["draft_steps_per_cycle"] > 3 and fixed["per_cycle"] <= 1.0  # k drafts, one read per cycle
    conf = _measure(runner, "early_exit", {"exit_layer": L // 2, "num_draft": 4, "confidence": 0.05})
    assert conf["draft_steps_per_cycle"] < fixed["draft_steps_per_cycle"]  # the confidence stop still stops
    assert conf["per_cycle"] <= conf["draft_steps_per_cycle"] + 1
    sd = _measure(runner, "self_sd", {"plan": _plan(runner, tmp_path), "num_draft": 6})
    assert sd["per_cycle"] <= sd["draft_steps_per_cycle"] + 1
    swift = _measure(runner, "swift", {"context_window": 4, "remember": "off", "adaptive": False,
                                       "max_tree_nodes": 12})
    assert swift["per_cycle"] <= swift["draft_steps_per_cycle"] + 2  # + the tree's one read
    assert swift["update_per_cycle"] > 0  # the optimiser reads its scores (reported apart)


def test_sampled_chain_verification_reads_once(runner):
    """Speculative sampling over a chain: all acceptance draws, residuals and the bonus in one transfer."""
    sampling = SamplingConfig(temperature=1.0, seed=0)
    for name, options in (("autoregressive", {}), ("early_exit", {"exit_layer": L // 2, "num_draft": 4})):
        assert _measure(runner, name, options, sampling)["per_cycle"] == 1.0


def test_tree_costs_one_read_whatever_its_depth(runner):
    """SWIFT's siblings for all depths come from one batched top-k, read in one transfer."""
    drafter = build_drafter("swift", runner, {"context_window": 4, "remember": "off", "adaptive": False,
                                              "confidence": 0.0, "num_draft": 5, "max_opt_steps": 0})
    engine = Engine(runner, drafter)
    gen = engine.start(PROMPT, DecodeConfig(max_new_tokens=30, stop_at_eos=False))
    gen.state.budget = 29  # what Engine.step sets before proposing
    with SyncCounter() as syncs:
        draft = drafter.propose(gen.state)
    assert draft.parents is not None and draft.size > 5  # a real tree over 5 depths
    assert syncs.total == 1  # the chain read nothing (no threshold); the tree read once


class _Fixed:
    """A stand-in draft forward whose argmax is token 3 with probability 0.5."""

    exact_layers = 0

    def __call__(self, cache, token, position):
        probs = torch.full((1, 16), 0.5 / 15)
        probs[0, 3] = 0.5
        return torch.zeros(1, 4), probs.log()  # (1, d), (1, V)


def _state(eos=frozenset()):
    sampling = SamplingConfig()
    return DecodeState(runner=type("R", (), {"device": "cpu"})(), cache=None, sampling=sampling,
                       generator=sampling.generator(), tokens=[1], prompt_len=1, n=0, budget=100, eos=eos)


def test_chain_that_reads_its_tokens_stops_at_eos():
    """Like LayerSkip's and Self-SD's code: an EOS draft token is proposed and ends the chain."""
    plain = draft_chain(_state(), _Fixed(), 5, confidence=0.3)
    assert plain.forwards == 5 and not plain.eos
    stopped = draft_chain(_state(eos=frozenset({3})), _Fixed(), 5, confidence=0.3)
    assert stopped.forwards == 1 and stopped.eos and stopped.draft.tokens.tolist() == [3]


def test_greedy_output_unchanged_when_the_draft_meets_eos(runner):
    """Stopping at a drafted EOS changes work, never output: early exit with EOS = a frequent token equals AR."""
    eos = {int(t) for t in Engine(runner, build_drafter("autoregressive", runner)).generate(
        PROMPT, DecodeConfig(max_new_tokens=12, stop_at_eos=False)).tokens[5:7]}
    config = DecodeConfig(max_new_tokens=40)
    ref = Engine(runner, build_drafter("autoregressive", runner), eos_token_ids=eos).generate(PROMPT, config)
    for options in ({"exit_layer": 4, "num_draft": 4}, {"exit_layer": 4, "num_draft": 4, "confidence": 0.01}):
        got = Engine(runner, build_drafter("early_exit", runner, options), eos_token_ids=eos).generate(PROMPT, config)
        assert got.tokens == ref.tokens and got.finish_reason == ref.finish_reason == "eos"


def test_pinned_non_blocking_copy_is_not_a_sync_in_either_call_shape(monkeypatch):
    """aten gives ``copy_`` its ``non_blocking`` positionally (``[dst, src, True]``) and ``_to_copy`` as a keyword.

    A CPU has no pinned memory and no second device, so the copy goes to the meta device and ``is_pinned`` is
    faked: what a static forward's pinned index copies look like to the counter on CUDA.
    """
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    src, dst = torch.ones(3, dtype=torch.long), torch.empty(3, dtype=torch.long, device="meta")
    with SyncCounter("meta") as syncs:
        torch.ops.aten.copy_.default(dst, src, True)  # the exact positional shape aten dispatches
        dst.copy_(src, non_blocking=True)
        src.to("meta", non_blocking=True)
    assert syncs.total == 0, syncs.counts
    with SyncCounter("meta") as syncs:
        torch.ops.aten.copy_.default(dst, src, False)
        dst.copy_(src)
        src.to("meta")
    assert syncs.counts["h2d"] == 3, syncs.counts  # blocking copies still count


def test_on_a_gpu_only_reads_of_device_tensors_are_syncs():
    """Counting for a CUDA device, a host tensor's .tolist()/.item()/bool() waits for nothing: not counted."""
    host = torch.tensor([1, 2, 3])
    with SyncCounter("cuda") as syncs:
        host.tolist(), host[0].item(), bool(host[1]), int(host[2])
    assert syncs.total == 0
    with SyncCounter("cpu") as syncs:  # on a CPU host and device are one: every read counts (an upper bound)
        host.tolist(), host[0].item()
    assert syncs.counts["reads"] == 2


def test_explicit_synchronisation_and_captures_are_syncs(runner, monkeypatch):
    from executor_cases import fake_capture

    from infer.model.graphs import StaticExecutor, StaticSpan

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append(1))
    with SyncCounter("cpu") as syncs:
        torch.cuda.synchronize()
    assert syncs.counts["explicit"] == 1 and calls == [1]
    monkeypatch.setattr(StaticSpan, "capture", fake_capture)
    captured = Runner.from_model(make_model("llama", seed=0, layers=L), executor="eager")
    captured.static = StaticExecutor(captured, capture=True)
    engine = Engine(captured, build_drafter("autoregressive", captured))
    m = measure_decode(engine, PROMPT, DecodeConfig(max_new_tokens=6, stop_at_eos=False))  # no warm-up
    assert m["captures"] >= 1 and m["per_cycle"] * m["cycles"] >= m["captures"] + m["cycles"]
