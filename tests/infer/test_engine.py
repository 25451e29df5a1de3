"""Greedy losslessness, stop conditions, cache rollback, KV reuse, tree verification."""


import pytest
import torch

from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import Drafter, build_drafter
from infer.model.program import ONCE, Program, Rows
from infer.model.runner import Runner
from stub_drafters import ScriptedDrafter
from tiny_models import make_model

PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 250, 17], [42] * 12 + [7, 8]]


@pytest.fixture(scope="module")
def runner():
    return Runner.from_model(make_model("llama", seed=0, layers=6))


def generate(runner, drafter="autoregressive", prompt=PROMPTS[0], eos=(), **kw):
    options = {k: kw.pop(k) for k in ("exit_layer", "num_draft", "confidence") if k in kw}
    engine = Engine(runner, build_drafter(drafter, runner, options), eos_token_ids=eos)
    return engine.generate(prompt, DecodeConfig(**kw))


def test_autoregressive_matches_transformers_generate():
    model = make_model("llama", seed=0, layers=6)
    runner = Runner.from_model(model)
    for prompt in PROMPTS:
        ours = generate(runner, prompt=prompt, max_new_tokens=30).tokens
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert ours == ref


@pytest.mark.parametrize("k", [1, 3, 8])
def test_early_exit_greedy_equals_autoregressive_for_every_exit_layer(runner, k):
    for prompt in PROMPTS:
        ref = generate(runner, prompt=prompt, max_new_tokens=40).tokens
        for E in range(1, runner.num_layers + 1):
            for confidence in (0.0, 0.3):
                res = generate(runner, "early_exit", prompt, exit_layer=E, num_draft=k, confidence=confidence,
                               max_new_tokens=40)
                assert res.tokens == ref, (E, k, confidence)


@pytest.mark.parametrize("E", [1, 3, 6])
def test_adaptive_early_exit_is_lossless_over_a_stream(runner, E):
    """One adaptive drafter over several prompts (its gate keeps state): every output exact, whether it
    drafts or takes plain steps; a short recheck interval makes it switch modes often."""
    from infer.drafters.gate import FallbackGate

    drafter = build_drafter("early_exit", runner, {"E": str(E), "k": "3", "adaptive": "true",
                                                   "recheck_interval": "4", "watch": "false"})
    engine = Engine(runner, drafter)
    drafted = plain = 0
    for i, prompt in enumerate(PROMPTS * 2):
        ref = generate(runner, prompt=prompt, max_new_tokens=60).tokens
        res = engine.generate(prompt, DecodeConfig(max_new_tokens=60))
        assert res.tokens == ref, E
        if i == 0:
            assert res.stats.drafter.plain_steps >= FallbackGate.WARM_PLAIN  # plain steps are timed first
        drafted, plain = drafted + res.stats.drafted, plain + res.stats.drafter.plain_steps
    assert drafted > 0 and plain > 0  # both modes were exercised


class FakeClock:
    """perf_counter() that advances 1 ms per call, plus whatever a test adds."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 0.001
        return self.now


def test_adaptive_early_exit_falls_back_when_drafting_cannot_pay(runner, monkeypatch):
    from infer.drafters import early_exit
    from infer.drafters.early_exit import EarlyExitDrafter
    from infer.drafters.gate import FallbackGate

    clock = FakeClock()
    monkeypatch.setattr(early_exit, "time", clock)  # the gate's timings, without sleeping
    fast_propose = EarlyExitDrafter.propose

    def slow(self, state):
        draft = fast_propose(self, state)
        if draft is not None:
            clock.now += 0.02  # drafting far slower than a plain step
        return draft

    monkeypatch.setattr(EarlyExitDrafter, "propose", slow)
    drafter = build_drafter("early_exit", runner, {"E": "3", "k": "4", "adaptive": "true", "watch": "false"})
    res = Engine(runner, drafter).generate(PROMPTS[0], DecodeConfig(max_new_tokens=80))
    assert res.tokens == generate(runner, max_new_tokens=80).tokens
    assert res.stats.drafter.mode == "plain" and res.stats.drafter.plain_steps > 50
    assert drafter.gate.drafting.cycles >= FallbackGate.PROBE  # drafting was probed, then dropped
    fixed = build_drafter("early_exit", runner, {"E": "3", "k": "4"})
    assert Engine(runner, fixed).generate(PROMPTS[0], DecodeConfig(max_new_tokens=20)).stats.drafter \
        .plain_steps == 0  # without adaptive, LayerSkip's fixed k always drafts


def test_full_depth_exit_accepts_everything(runner):
    res = generate(runner, "early_exit", exit_layer=runner.num_layers, num_draft=4, max_new_tokens=41)
    assert res.stats.acceptance_rate == 1.0
    assert res.stats.tokens_per_verify == 5.0


def test_eos_inside_a_draft(runner):
    ref = generate(runner, max_new_tokens=40).tokens
    eos = ref[9]  # the 10th generated token, reached inside a multi-token step below
    first = ref.index(eos)
    ar = generate(runner, eos=[eos], max_new_tokens=40)
    assert ar.tokens == ref[:first + 1] and ar.finish_reason == "eos"
    res = generate(runner, "early_exit", eos=[eos], exit_layer=runner.num_layers, num_draft=7, max_new_tokens=40)
    assert res.tokens == ar.tokens and res.finish_reason == "eos"
    assert res.stats.accepted > 0


@pytest.mark.parametrize("max_new", [1, 2, 5, 7, 13])
def test_max_new_tokens_inside_a_draft(runner, max_new):
    ref = generate(runner, max_new_tokens=max_new).tokens
    assert len(ref) == max_new
    res = generate(runner, "early_exit", exit_layer=runner.num_layers, num_draft=6, max_new_tokens=max_new)
    assert res.tokens == ref and res.finish_reason == "length"


def test_stop_strings():
    from tiny_models import byte_tokenizer

    tok = byte_tokenizer()
    model = make_model("llama", seed=2, vocab_size=259, layers=4)
    runner = Runner.from_model(model)
    prompt = tok("hello")["input_ids"]
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
    plain = Engine(runner, build_drafter("autoregressive", runner), decode=decode).generate(
        prompt, DecodeConfig(max_new_tokens=30, stop_at_eos=False))
    stop = plain.text[8:10]
    expect = next(j for j in range(1, 31) if stop in decode(plain.tokens[:j]))
    for name, opts in [("autoregressive", {}), ("early_exit", {"exit_layer": 4, "num_draft": 5})]:
        engine = Engine(runner, build_drafter(name, runner, opts), decode=decode)
        res = engine.generate(prompt, DecodeConfig(max_new_tokens=30, stop_strings=(stop,), stop_at_eos=False))
        assert res.finish_reason == "stop_string"
        assert res.tokens == plain.tokens[:expect]


def _started(runner, prompt, drafter=None):
    """An engine and a prefilled generation with room for many steps (public API only)."""
    engine = Engine(runner, drafter or build_drafter("autoregressive", runner))
    return engine, engine.start(prompt, DecodeConfig(max_new_tokens=100))


def test_step_by_step_equals_generate(runner):
    drafter = build_drafter("early_exit", runner, {"exit_layer": 3, "num_draft": 3})
    engine = Engine(runner, drafter)
    gen = engine.start(PROMPTS[1], DecodeConfig(max_new_tokens=25))
    assert len(gen.tokens) == 1 and not gen.done  # the prefill's token
    steps = 0
    while not gen.done:
        outcome = engine.step(gen)
        assert 1 <= len(outcome.tokens) <= 4
        steps += 1
    res = engine.finish(gen)
    assert res.tokens == generate(runner, prompt=PROMPTS[1], max_new_tokens=25).tokens
    assert res.stats.verify_calls == steps and res.finish_reason == "length"
    with pytest.raises(ValueError, match="finished"):
        engine.step(gen)
    with pytest.raises(ValueError, match="running"):
        engine.finish(engine.start(PROMPTS[1], DecodeConfig(max_new_tokens=25)))


def test_cache_after_rejection_equals_fresh_prefill(runner):
    drafter = build_drafter("early_exit", runner, {"exit_layer": 2, "num_draft": 6})
    engine, gen = _started(runner, PROMPTS[0], drafter)
    for _ in range(6):
        engine.step(gen)
    state = gen.state
    assert not gen.done and state.cache.lengths == [state.n] * runner.num_layers
    fresh = runner.new_cache(128)
    runner.forward(fresh, torch.tensor(state.tokens[:state.n]))
    n = state.n
    torch.testing.assert_close(state.cache.k[:, :, :n], fresh.k[:, :, :n], atol=1e-5, rtol=0)
    torch.testing.assert_close(state.cache.v[:, :, :n], fresh.v[:, :, :n], atol=1e-5, rtol=0)


@pytest.mark.parametrize("E,k", [(2, 4), (3, 1), (5, 6)])
def test_verification_reuses_draft_kv(runner, E, k):
    """Verification computes layers < E only for the one position no draft pass has seen."""
    drafter = build_drafter("early_exit", runner, {"exit_layer": E, "num_draft": k})
    engine, gen = _started(runner, PROMPTS[1], drafter)
    runner.counters.reset()
    outcome = engine.step(gen)
    assert outcome.drafted == k
    L = runner.num_layers
    # k draft forwards through [0, E), then verification: 1 row in [0, E) and k + 1 rows in [E, L)
    assert runner.counters.layer_tokens == [k + 1] * L
    assert runner.counters.lm_head_tokens == k + (k + 1)




def _one_verify(runner, drafter, prompt):
    engine, gen = _started(runner, prompt, drafter)
    outcome = engine.step(gen)
    return gen.state, outcome


def test_tree_that_is_a_chain_equals_chain(runner):
    ref = generate(runner, prompt=PROMPTS[2], max_new_tokens=8).tokens  # ref[0] is the pending token
    chain = ref[1:5]
    _, a = _one_verify(runner, ScriptedDrafter(chain, None), PROMPTS[2])
    _, b = _one_verify(runner, ScriptedDrafter(chain, [0, 1, 2, 3]), PROMPTS[2])
    assert a.tokens == b.tokens == ref[1:6]


def test_planted_sibling_is_accepted_and_kv_compacted(runner):
    ref = generate(runner, prompt=PROMPTS[2], max_new_tokens=8).tokens
    wrong = (ref[2] + 1) % 320
    # position 1: right token; position 2: wrong child; position 3: sibling of 2 that is right;
    # position 4: child of 3 that is right; position 5: child of the wrong node
    tokens = [ref[1], wrong, ref[2], ref[3], ref[3]]
    parents = [0, 1, 1, 3, 2]
    state, outcome = _one_verify(runner, ScriptedDrafter(tokens, parents), PROMPTS[2])
    assert outcome.path == [0, 1, 3, 4]
    assert outcome.tokens == ref[1:5]
    _, chain_only = _one_verify(runner, ScriptedDrafter([ref[1], wrong], None), PROMPTS[2])
    assert chain_only.accepted == 1 < outcome.accepted
    n = state.n
    fresh = runner.new_cache(128)
    runner.forward(fresh, torch.tensor(state.tokens[:len(PROMPTS[2])] + ref[:4]))
    assert n == len(PROMPTS[2]) + 4 and state.cache.lengths == [n] * runner.num_layers
    torch.testing.assert_close(state.cache.k[:, :, :n], fresh.k[:, :, :n], atol=1e-5, rtol=0)
    torch.testing.assert_close(state.cache.v[:, :, :n], fresh.v[:, :, :n], atol=1e-5, rtol=0)


def test_early_exit_target_at_full_depth_is_the_plain_model(runner):
    L = runner.num_layers
    engine = Engine(runner, build_drafter("autoregressive", runner))
    for prompt in PROMPTS:
        out = engine.generate(prompt, DecodeConfig(max_new_tokens=20, target_exit=L))
        assert out.tokens == generate(runner, prompt=prompt, max_new_tokens=20).tokens and not out.stats.lossy


@pytest.mark.parametrize("E", [1, 3])
def test_early_exit_target_runs_only_its_layers(runner, E):
    """target_exit E: greedy decoding of layers [0, E) + final norm + LM head, deeper layers never run."""
    prompt = PROMPTS[0]
    engine = Engine(runner, build_drafter("autoregressive", runner))
    runner.counters.reset()
    result = engine.generate(prompt, DecodeConfig(max_new_tokens=12, target_exit=E))
    got = result.tokens
    assert result.stats.lossy and result.stats.target_exit == E
    assert runner.counters.layer_tokens[E:] == [0] * (runner.num_layers - E)
    ids, expect = list(prompt), []
    for _ in range(12):  # reference: recompute the shallow model on the whole sequence each time
        rows = Rows.one(runner.new_cache(64), runner.embed(torch.tensor(ids)), torch.arange(len(ids)), kind=ONCE)
        hidden = runner.run(Program(0, E), rows).hidden
        expect.append(int(runner.logits(hidden[-1:]).argmax()))
        ids.append(expect[-1])
    assert got == expect
    assert got != generate(runner, prompt=prompt, max_new_tokens=12).tokens  # lossy: not the full model


def test_early_exit_target_errors(runner):
    from layerskip_core.errors import UserError

    L = runner.num_layers
    with pytest.raises(UserError, match=">= 1"):
        DecodeConfig(target_exit=0)
    with pytest.raises(UserError, match="out of range"):
        Engine(runner, build_drafter("autoregressive", runner)).generate(PROMPTS[0],
                                                                         DecodeConfig(target_exit=L + 1))
    with pytest.raises(UserError, match="autoregressive"):
        Engine(runner, build_drafter("early_exit", runner, {"exit_layer": 2})).generate(
            PROMPTS[0], DecodeConfig(target_exit=3))
    with pytest.raises(UserError, match="target_exit"):  # the drafter option it replaced says where it went
        build_drafter("autoregressive", runner, {"exit_layer": 3})


def test_prompt_errors(runner):
    from layerskip_core.errors import UserError

    with pytest.raises(UserError, match="empty"):
        generate(runner, prompt=[])
    with pytest.raises(UserError, match="context"):
        generate(runner, prompt=[1] * 500, max_new_tokens=100)


@pytest.mark.real_model
def test_early_exit_lossless_on_default_model(default_model_path):
    from infer.loading import load_model

    model = load_model(str(default_model_path))
    prompt = model.encode("def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"\n")
    cfg = DecodeConfig(max_new_tokens=24, stop_at_eos=False)
    ref = Engine(model.runner, build_drafter("autoregressive", model.runner)).generate(prompt, cfg).tokens
    for E, k in [(8, 4), (24, 6), (30, 3)]:
        drafter = build_drafter("early_exit", model.runner, {"exit_layer": E, "num_draft": k})
        assert Engine(model.runner, drafter).generate(prompt, cfg).tokens == ref, (E, k)


def test_engine_close_finishes_the_drafter_once(runner):
    """The engine owns its drafter's life: close() (or leaving a with block) calls finish() exactly once, and a
    closed engine refuses to start another generation; drafters without finish() are fine."""
    from infer.drafters.autoregressive import AutoregressiveDrafter

    class Counting(AutoregressiveDrafter):
        finished = 0

        def finish(self):
            self.finished += 1

    drafter = Counting(runner)
    with Engine(runner, drafter) as engine:
        engine.generate(PROMPTS[0], DecodeConfig(max_new_tokens=4))
    engine.close()
    assert drafter.finished == 1 and engine.closed
    with pytest.raises(ValueError, match="closed"):
        engine.generate(PROMPTS[0], DecodeConfig(max_new_tokens=4))

    class Bare(Drafter):
        name = "bare"

        def propose(self, state): return None

    Engine(runner, Bare()).close()  # the base class's start/update/stats/finish do nothing
