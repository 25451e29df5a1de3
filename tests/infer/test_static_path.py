"""The static-shape executor (device-side positions and lengths, capacity-wide attention with a length
mask, row buckets) equals the eager path: token for token for every drafter, and cache for cache after
a padded verification and its rollback."""


import pytest
import torch
from executor_cases import SIX, drafter_cases, fake_capture, run_drafter

from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter
from infer.model.graphs import bucket, padded_window
from infer.model.program import ONCE, Program, Rows
from infer.model.runner import Runner
from layerskip_core.errors import UserError
from layerskip_core.settings import RunSettings
from stub_drafters import ScriptedDrafter

PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 250, 17], [42] * 12 + [7, 8]]
L = SIX
SIXTEEN_ROWS = ("early_exit", {"exit_layer": L, "num_draft": 8})
"""T = 9 verification rows: the 16-row bucket."""


@pytest.fixture(scope="module")
def static(model):
    return Runner.from_model(model, executor="static")


def test_static_equals_eager_for_every_drafter(eager, static, tmp_path):
    assert (eager.executor, static.executor) == ("eager", "static")
    for prompt in PROMPTS:
        ref = run_drafter(eager, "autoregressive", {}, prompt, 32).tokens
        for name, options in drafter_cases(eager, tmp_path, SIXTEEN_ROWS):
            a = run_drafter(eager, name, options, prompt, 32)
            b = run_drafter(static, name, options, prompt, 32)
            assert b.tokens == a.tokens == ref, (name, options, prompt)
            if name != "swift":  # SWIFT's optimiser times itself, so its acceptance may differ run to run
                assert (b.stats.drafted, b.stats.accepted) == (a.stats.drafted, a.stats.accepted), (name, options)


def test_static_equals_eager_when_sampling(eager, static):
    """Same seed, same draws: the sampled acceptance path sees the same probabilities on both executors."""
    from infer.model.sampling import SamplingConfig

    for name, options in [("autoregressive", {}), ("early_exit", {"exit_layer": 3, "num_draft": 4})]:
        for prompt in PROMPTS:
            cfg = DecodeConfig(max_new_tokens=24, sampling=SamplingConfig(temperature=1.0, seed=7))
            a = Engine(eager, build_drafter(name, eager, options)).generate(prompt, cfg)
            b = Engine(static, build_drafter(name, static, options)).generate(prompt, cfg)
            assert b.tokens == a.tokens and b.stats.accepted == a.stats.accepted, (name, prompt)


def test_static_executor_runs_the_decoding_forwards(static):
    engine = Engine(static, build_drafter("early_exit", static, {"exit_layer": 3, "num_draft": 3}))
    res = engine.generate(PROMPTS[0], DecodeConfig(max_new_tokens=12))
    spans = [s.key for s in static.static.spans()]  # kept per (pooled) cache
    assert res.stats.verify_calls > 0
    assert any(k.start == 0 and k.end == 3 and k.logits and k.rows == 1 for k in spans)  # draft steps
    assert any(k.start == 3 and k.end == L and k.logits and k.rows == 4 for k in spans)  # verification of 4




def _verify_once(runner, tokens, parents, prompt):
    engine = Engine(runner, ScriptedDrafter(tokens, parents))
    gen = engine.start(prompt, DecodeConfig(max_new_tokens=20))
    outcome = engine.step(gen)
    n = gen.state.n
    cache = gen.state.cache
    return outcome, n, list(cache.lengths), cache.k[:, :, :n].clone(), cache.v[:, :, :n].clone()


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_padded_verification_equals_unpadded(model, eager, shape):
    """Verifying T = 3 in a 4-row bucket: same tokens, acceptance and cache (after rollback) as unpadded."""
    prompt = PROMPTS[2]
    ref = run_drafter(eager, "autoregressive", {}, prompt, 6).tokens  # ref[0] is the pending token
    wrong = (ref[2] + 1) % 320
    if shape == "chain":
        tokens, parents = [ref[1], wrong], None  # first accepted, second rejected
    else:
        tokens, parents = [wrong, ref[1]], [0, 0]  # two siblings: the second is right
    padded = Runner.from_model(model, executor="static")
    unpadded = Runner.from_model(model, executor="static")
    unpadded.static.buckets = tuple(range(1, 33))  # every T is its own bucket: no padding
    assert bucket(3) == 4
    results = [_verify_once(r, tokens, parents, prompt) for r in (padded, unpadded, eager)]
    (o1, n1, len1, k1, v1), (o2, n2, len2, k2, v2), (o3, n3, len3, k3, v3) = results
    assert o1.tokens == o2.tokens == o3.tokens == ref[1:3]
    assert o1.path == o2.path == o3.path and o1.accepted == 1
    assert n1 == n2 == n3 and len1 == len2 == len3 == [n1] * L
    # padded rows are masked out; only the attention kernel's rounding may depend on the row count
    torch.testing.assert_close(k1, k2, atol=1e-5, rtol=0)
    torch.testing.assert_close(v1, v2, atol=1e-5, rtol=0)
    torch.testing.assert_close(k1, k3, atol=1e-5, rtol=0)  # and the static path matches the eager one
    torch.testing.assert_close(v1, v3, atol=1e-5, rtol=0)


def test_padded_window_rows_see_only_themselves():
    m = padded_window(4, 3, 0, None)  # chain of 3 in a 4-row bucket
    assert m.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]]
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    sub = padded_window(2, 1, 2, tree[2:, :])  # one fresh row behind two earlier window slots
    assert sub.tolist() == [[1, 0, 1, 0], [0, 0, 0, 1]]


def test_span_falls_back_to_eager_when_the_bucket_does_not_fit(model, eager):
    """A 3-token span whose 4-row bucket would run past the cache capacity still runs (eagerly) and agrees."""
    static = Runner.from_model(model, executor="static")
    ids = torch.tensor(PROMPTS[0] + [11, 12, 13])
    outs = []
    for runner in (static, eager):
        cache = runner.new_cache(8)  # 5 prompt + 3 new = 8: the padded 4th row has no slot
        runner.run(Program(0, L), Rows.one(cache, runner.embed(ids[:5]), torch.arange(5), kind=ONCE))
        out = runner.run(Program(0, L, logits=True), Rows.one(cache, runner.embed(ids[5:]), [5, 6, 7]))
        assert cache.lengths == [8] * L
        outs.append(out.logits)
    assert static.static.builds == 0 and not static.static.spans()  # nothing static was built
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


def test_executor_option_errors(model, monkeypatch):
    with pytest.raises(UserError, match="unknown executor"):
        Runner.from_model(model, executor="fast")
    with pytest.raises(UserError, match="CUDA"):
        Runner.from_model(model, executor="graphs")  # CPU runner
    with pytest.raises(UserError, match="unknown executor 'auto'"):
        Runner.from_model(model, executor="auto")  # resolved at the edge (layerskip_core.settings), never here
    monkeypatch.setenv("LAYERSKIP_EXECUTOR", "static")  # read by the settings' resolution only
    run = RunSettings(device="cpu").resolve()
    assert run.executor == "static" and Runner.from_model(model, executor=run.executor).executor == "static"
    assert Runner.from_model(model).executor == "eager"  # the library reads no environment variable
    monkeypatch.delenv("LAYERSKIP_EXECUTOR")
    assert RunSettings(device="cpu").resolve().executor == "eager"  # CPU default: the eager path stays
    with pytest.raises(UserError, match="CUDA graphs need a CUDA device"):
        RunSettings(device="cpu", executor="graphs").resolve()


def test_replayed_forwards_hand_out_copies(model, eager, monkeypatch):
    """With graph replay semantics (outputs overwritten in place) decoding stays exact: outputs are cloned."""
    from infer.model.graphs import StaticExecutor, StaticSpan

    monkeypatch.setattr(StaticSpan, "capture", fake_capture)
    replayed = Runner.from_model(model, executor="eager")
    replayed.static = StaticExecutor(replayed, capture=True)
    spans = []
    for name, options in [("autoregressive", {}), ("early_exit", {"exit_layer": 3, "num_draft": 4})]:
        engine = Engine(replayed, build_drafter(name, replayed, options))
        for prompt in PROMPTS:
            got = engine.generate(prompt, DecodeConfig(max_new_tokens=32)).tokens
            assert got == run_drafter(eager, name, options, prompt, 32).tokens, (name, prompt)
        spans += replayed.static.spans()
    assert any(s.graph is not None for s in spans)  # captured on second use, then replayed
    assert all(s.graph is None for s in spans if s.uses < 2)


def test_failed_capture_warns_once_and_falls_back_to_eager(model, eager, monkeypatch):
    from infer.model.graphs import StaticExecutor, StaticSpan

    def broken(self, cache, steps, pool=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(StaticSpan, "capture", broken)
    runner = Runner.from_model(model, executor="eager")
    runner.static = StaticExecutor(runner, capture=True)
    options = {"exit_layer": 3, "num_draft": 4}
    with pytest.warns(RuntimeWarning, match="capture failed") as record:
        res = run_drafter(runner, "early_exit", options, PROMPTS[0], 32)
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1
    assert runner.executor == "eager"
    assert res.tokens == run_drafter(eager, "early_exit", options, PROMPTS[0], 32).tokens


def test_layers_at_different_lengths(model, eager):
    """Shallow layers ahead of deep ones (early exit): each layer writes and attends at its own length."""
    static = Runner.from_model(model, executor="static")
    ids = torch.tensor(PROMPTS[2])
    outs, lengths, caches = [], [], []
    for runner in (static, eager):
        cache = runner.new_cache(48)
        caches.append(cache)  # the static forwards live as long as their cache
        runner.run(Program(0, L), Rows.one(cache, runner.embed(ids[:10]), torch.arange(10), kind=ONCE))
        rows = Rows.one(cache, runner.embed(ids[10:12]), torch.tensor([10, 11]), kind=ONCE)
        runner.run(Program(0, 2), rows)  # layers 0, 1 ahead
        out = runner.run(Program(0, L, logits=True), Rows.one(cache, runner.embed(ids[12:14]), [12, 13]))
        outs.append(out.logits)
        lengths.append(list(cache.lengths))
    assert lengths[0] == lengths[1] == [14, 14] + [12] * (L - 2)
    (key,) = [s.key for s in static.static.spans(caches[0])]
    assert key.groups == (0, 0) + (2,) * (L - 2)  # two masks per forward, not one per layer
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)


def _bench_like(runner, prompts, drafter="early_exit", options=None, repeats=2):
    """What `layerskip bench` does: a thrown-away warm-up engine (``Engine.warm_up`` over the task's prompts),
    then a fresh engine per repeat over every prompt. Returns the executor's (builds, captures) after the warm-up
    and after each timed generation."""
    options = {"exit_layer": 3, "num_draft": 4} if options is None else options
    config = DecodeConfig(max_new_tokens=16, stop_at_eos=False)
    Engine(runner, build_drafter(drafter, runner, options)).warm_up(prompts, config)
    counts = [(runner.static.builds, runner.static.captures)]
    for _ in range(repeats):
        engine = Engine(runner, build_drafter(drafter, runner, options))
        for prompt in prompts:
            engine.generate(prompt, config)
            counts.append((runner.static.builds, runner.static.captures))
    return counts


LONG = [[(7 * i) % 300 + 3 for i in range(230)], [(11 * i) % 300 + 3 for i in range(300)]]


def test_static_forwards_are_built_once_across_repeats_and_prompt_lengths(model):
    """Caches are the runner's (pooled by power-of-two capacity) and the warm-up covers every shape, so fresh
    engines, bench repeats and prompts of other lengths build nothing in timed runs."""
    runner = Runner.from_model(model, executor="static")
    counts = _bench_like(runner, [PROMPTS[0], PROMPTS[2]] + LONG)  # 5, 14, 230 and 300 tokens: 256 and 512 slots
    assert counts[0][0] > 0 and counts == [counts[0]] * len(counts)
    assert runner.caches.capacities() == {256: 1, 512: 1}


def test_a_longer_prompt_reuses_the_cache_and_its_forwards(model):
    """No warm-up at all: a second, longer prompt in the same capacity bucket builds nothing new."""
    runner = Runner.from_model(model, executor="static")
    engine = Engine(runner, build_drafter("autoregressive", runner))
    config = DecodeConfig(max_new_tokens=8, stop_at_eos=False)
    engine.generate(LONG[0], config)
    built = runner.static.builds
    engine.generate(LONG[1], config)  # 70 tokens longer: the cache stays, and so do the static forwards
    assert runner.static.builds == built


@pytest.mark.parametrize("drafter,options", [
    ("early_exit", {"exit_layer": 3, "num_draft": 4}),
    ("early_exit", {"exit_layer": 2, "num_draft": 8, "confidence": 0.2}),
    ("autoregressive", {}),
])
def test_graphs_are_captured_before_the_timed_runs(model, monkeypatch, drafter, options):
    """With CUDA-graph semantics (stand-in capture on CPU): every capture happens in the warm-up."""
    from infer.model.graphs import StaticExecutor, StaticSpan

    monkeypatch.setattr(StaticSpan, "capture", fake_capture)
    runner = Runner.from_model(model, executor="eager")
    runner.static = StaticExecutor(runner, capture=True)
    counts = _bench_like(runner, PROMPTS + LONG[:1], drafter, options)
    assert counts[0][1] > 0 and counts == [counts[0]] * len(counts)


def test_grouped_attention_equals_sdpa_with_gqa():
    """Folding the query groups into rows (no enable_gqa, so CUDA's memory-efficient kernel takes the masked
    call) gives the grouped-query attention of SDPA with ``enable_gqa``."""
    from infer.model.attention import grouped_attention

    g = torch.Generator().manual_seed(0)
    for Hq, Hkv in ((4, 2), (9, 3), (4, 4)):
        q = torch.randn(Hq, 5, 16, generator=g)  # (Hq, T, D)
        k, v = torch.randn(2, Hkv, 64, 16, generator=g)  # (Hkv, C, D) each
        visible = torch.rand(5, 64, generator=g) > 0.3  # (T, C)
        visible[:, 0] = True
        ref = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=visible,
                                                               enable_gqa=Hq != Hkv)[0]  # (Hq, T, D)
        torch.testing.assert_close(grouped_attention(q, k, v, visible), ref, atol=1e-6, rtol=1e-5)


def test_static_attention_calls_sdpa_without_gqa_and_with_an_aligned_mask(model):
    """What selects the kernel on CUDA, checked where it is decided: every masked SDPA call of a static forward
    has as many query as KV heads (no enable_gqa) and a mask whose width is a multiple of 64 (pooled caches)."""
    from torch.overrides import TorchFunctionMode

    calls = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.nn.functional.scaled_dot_product_attention:
                calls.append((args[0].shape[1], args[1].shape[1], kwargs.get("enable_gqa", False),
                              kwargs["attn_mask"].shape[-1]))
            return func(*args, **kwargs)

    runner = Runner.from_model(model, executor="static")
    assert runner.spec.num_heads != runner.spec.num_kv_heads  # a grouped-KV model
    engine = Engine(runner, build_drafter("early_exit", runner, {"exit_layer": 3, "num_draft": 4}))
    gen = engine.start(PROMPTS[0], DecodeConfig(max_new_tokens=8))  # the prompt prefill runs eagerly
    with Spy():
        while not gen.done:
            engine.step(gen)
    assert calls and all(hq == hkv and not gqa and width % 64 == 0 for hq, hkv, gqa, width in calls)
