"""Exit adapters: the file ties to its model, both forwards agree, and early exit with an adapter is lossless."""

from __future__ import annotations

import pytest
import torch
from executor_cases import fake_capture
from lossless_stats import P_THRESHOLD, sampling_pvalue

from infer.assets.adapter import ExitAdapter
from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter
from infer.model.graphs import StaticExecutor, StaticSpan
from infer.model.runner import Runner
from infer.model.sampling import SamplingConfig
from layerskip_core.draft_vocab import DraftVocab
from layerskip_core.errors import UserError
from tiny_models import make_model, noisy_adapter
from train.adapter import AdapterLM, model_identity
from train.config import AdapterConfig

L = 6
PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 250, 17], [42] * 12 + [7, 8]]


@pytest.fixture(scope="module")
def model():
    return make_model("llama", seed=0, layers=L)


def write_adapter(model, path, exit_layer: int, mlp_size: int = 0, noise: float = 0.0, seed: int = 0):
    """``tiny_models.noisy_adapter`` leaving the model trainable (the tests here train and compare forwards)."""
    return noisy_adapter(model, path, exit_layer, noise, seed, mlp_size, frozen=False)


def test_train_and_infer_forwards_agree(model, tmp_path):
    """The training module and the decoding forward (the adapter as a layer on the runner, token by token over its
    one-layer cache) compute the same logits."""
    for mlp in (0, 24):
        lm = write_adapter(model, tmp_path / "a.safetensors", exit_layer=2, mlp_size=mlp, noise=0.2, seed=mlp)
        runner = Runner.from_model(model)
        adapter = ExitAdapter.load(tmp_path / "a.safetensors", runner)
        hidden = torch.randn(1, 7, runner.spec.hidden_size, generator=torch.Generator().manual_seed(1))
        rope = model.model.rotary_emb(hidden, torch.arange(7)[None])
        with torch.no_grad():
            want = lm.adapter_logits(hidden, rope)[0]  # (7, V)
        cache = adapter.new_cache(16)
        assert cache.num_layers == 1
        got = torch.cat([adapter.forward(cache, hidden[0, :3], 0, logits=True).logits] +
                        [adapter.forward(cache, hidden[0, i:i + 1], i, logits=True).logits
                         for i in range(3, 7)])  # (7, V)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_file_records_the_runners_identity(model, tmp_path):
    assert model_identity(model) == Runner.from_model(model).identity()


def test_an_untrained_adapter_drafts_as_the_plain_exit(model, tmp_path):
    """Zero output projections and the final norm's weights: the same drafts, so the same acceptance."""
    write_adapter(model, tmp_path / "a.safetensors", exit_layer=3)
    runner = Runner.from_model(model)
    config = DecodeConfig(max_new_tokens=24)
    plain = Engine(runner, build_drafter("early_exit", runner, {"E": 3, "k": 4, "draft_vocab": "off"}))
    adapted = Engine(runner, build_drafter("early_exit", runner, {"k": 4, "draft_vocab": "off",
                                                                  "adapter": str(tmp_path / "a.safetensors")}))
    for prompt in PROMPTS:
        a, b = plain.generate(prompt, config), adapted.generate(prompt, config)
        assert a.tokens == b.tokens and (a.stats.accepted, a.stats.drafted) == (b.stats.accepted, b.stats.drafted)


def test_the_adapter_cache_is_filled_from_the_prefill_stream(model, tmp_path):
    """The prefill keeps the prompt's stream entering layer E (``Needs``), and the adapter's cache is filled from it:
    layers [0, E) run over the prompt once (the prefill), not a second time, and the adapter's K/V rows equal those
    of a second pass over layers [0, E) to rounding."""
    write_adapter(model, tmp_path / "a.safetensors", exit_layer=3, noise=0.2)
    runner = Runner.from_model(model)
    drafter = build_drafter("early_exit", runner, {"k": 4, "draft_vocab": "off", "prefix": "shared",
                                                   "adapter": str(tmp_path / "a.safetensors")})
    engine, prompt = Engine(runner, drafter), PROMPTS[2]
    runner.counters.reset()
    gen = engine.start(prompt, DecodeConfig(max_new_tokens=8))
    assert runner.counters.layer_tokens == [len(prompt)] * L  # one prefill pass, no second one over [0, 3)
    kept = gen.state.prompt_observed[3]  # (P, d)
    assert kept.shape[0] == len(prompt)
    filled = drafter.forward.cache
    drafter.forward.start(gen.state.cache, prompt)  # no kept stream: layers [0, 3) again in a scratch cache
    torch.testing.assert_close(filled.k[:, :, :len(prompt)], drafter.forward.cache.k[:, :, :len(prompt)])
    engine.close()


def _ar(runner, prompt, n=32):
    return Engine(runner, build_drafter("autoregressive", runner)).generate(prompt, DecodeConfig(max_new_tokens=n))


@pytest.mark.parametrize("executor", ["eager", "static"])
@pytest.mark.parametrize("exit_layer", [1, 3, 5])
def test_greedy_with_an_adapter_equals_plain_decoding(model, tmp_path, executor, exit_layer):
    """Several E, with and without a confidence stop, a reduced draft head and an MLP; drafts are accepted and
    rejected, and the adapter's cache is refilled from verification after fully accepted chains."""
    path = tmp_path / "a.safetensors"
    write_adapter(model, path, exit_layer, mlp_size=16 if exit_layer == 3 else 0, noise=0.05, seed=exit_layer)
    runner = Runner.from_model(model, executor=executor)
    totals = [0, 0]
    for options in ({"k": 4}, {"k": 3, "confidence": 0.3}, {"k": 5, "draft_vocab": DraftVocab(
            ids=list(range(0, 320, 2)), model=runner.identity())}):
        engine = Engine(runner, build_drafter("early_exit", runner, {"adapter": str(path), **options}))
        for prompt in PROMPTS:
            out = engine.generate(prompt, DecodeConfig(max_new_tokens=32))
            assert out.tokens == _ar(runner, prompt).tokens, (options, prompt)
            totals[0] += out.stats.accepted
            totals[1] += out.stats.drafted
    assert 0 < totals[0] < totals[1]  # drafts were used, and some were rejected


def test_keep_last_proposes_the_stopping_token_and_stays_exact(model, tmp_path):
    """Kangaroo's stop (``keep_last``): a chain that falls under the threshold proposes that token too, so it drafts
    one token more per stopped chain than the dropping stop does, with the same greedy output. On this tiny model
    every draft's top-1 probability is under the threshold: the dropping stop never drafts, the kept one proposes
    each chain's first token and some are accepted."""
    path = tmp_path / "a.safetensors"
    write_adapter(model, path, 5, noise=0.05, seed=3)
    runner = Runner.from_model(model)
    totals = {}
    for keep in (False, True):
        engine = Engine(runner, build_drafter("early_exit", runner, {"adapter": str(path), "k": 4, "confidence": 0.05,
                                                                     "keep_last": keep}))
        outs = [engine.generate(p, DecodeConfig(max_new_tokens=32)) for p in PROMPTS]
        assert [o.tokens for o in outs] == [_ar(runner, p).tokens for p in PROMPTS]
        totals[keep] = sum(o.stats.drafted for o in outs), sum(o.stats.accepted for o in outs)
    assert totals[True][0] > totals[False][0] and totals[True][1] > totals[False][1], totals  # drafts, some accepted


def _drafts(runner, path, prompt, options):
    """(output tokens, every draft's tokens) of early exit with the adapter at ``path`` on ``runner``."""
    drafter = build_drafter("early_exit", runner, {"adapter": str(path), **options})
    drafts, propose = [], drafter.propose

    def recorded(state):
        draft = propose(state)
        drafts.append(None if draft is None else draft.tokens.tolist())
        return draft

    drafter.propose = recorded
    out = Engine(runner, drafter).generate(prompt, DecodeConfig(max_new_tokens=24))
    return out.tokens, drafts, drafter.adapter


@pytest.mark.parametrize("executor", ["static", "graphs"])
def test_the_adapter_drafts_identically_on_every_executor(model, tmp_path, monkeypatch, executor):
    """The adapter's layer runs on the runner's executor (static forwards; with graph-replay semantics, a stand-in
    capture on CPU): every draft equals the eager executor's."""
    path = tmp_path / "a.safetensors"
    write_adapter(model, path, 2, mlp_size=16, noise=0.05, seed=3)
    eager = Runner.from_model(model)
    runner = Runner.from_model(model, executor="static")
    if executor == "graphs":
        monkeypatch.setattr(StaticSpan, "capture", fake_capture)
        runner.static = StaticExecutor(runner, capture=True)
    vocab = DraftVocab(ids=list(range(0, 320, 2)), model=runner.identity())
    # in the model's dtype: in bf16 the static forwards' torch ops and the eager kernel round differently
    cases = [{"k": 4, "draft_dtype": "model"}, {"k": 3, "draft_vocab": vocab, "draft_dtype": "model"}]
    for options in cases[:1] if executor == "graphs" else cases:
        for prompt in PROMPTS:
            want, got = _drafts(eager, path, prompt, options), _drafts(runner, path, prompt, options)
            assert got[:2] == want[:2] and any(got[1]), (options, prompt)
            spans = got[2].layer.static.spans()  # the adapter layer's own static forwards ran the drafts
            assert any(s.key.logits and s.key.rows == 1 for s in spans)
            assert executor == "static" or any(s.graph is not None for s in spans)
    built = runner.static.builds, got[2].layer.static.builds
    again = _drafts(runner, path, PROMPTS[0], cases[0])  # a fresh drafter: the runner kept the adapter's layer
    assert again[2].layer is got[2].layer and (runner.static.builds, again[2].layer.static.builds) == built


@pytest.mark.parametrize("prefix", ["shared", "copy"])
def test_adaptive_plain_steps_then_drafting_stays_exact(model, tmp_path, prefix):
    """Plain steps leave the adapter's cache (and a copied prefix's) behind; the next draft fills it in first (the
    copy: the missing rows run in front of the draft's first token)."""
    path = tmp_path / "a.safetensors"
    write_adapter(model, path, 2, noise=0.05)
    runner = Runner.from_model(model)
    drafter = build_drafter("early_exit", runner, {"adapter": str(path), "k": 3, "adaptive": True, "prefix": prefix,
                                                   "recheck_interval": 3, "remember": "off"})
    drafter.gate.mode = "plain"  # start in plain steps, as a gate that measured drafting slower would
    engine = Engine(runner, drafter)
    for prompt in PROMPTS:
        out = engine.generate(prompt, DecodeConfig(max_new_tokens=40))
        assert out.tokens == _ar(runner, prompt, 40).tokens


@pytest.mark.slow
@pytest.mark.parametrize("draft_dtype", ["model", "bf16"])
def test_sampling_with_an_adapter_matches_the_target(tmp_path, draft_dtype):
    """Also with the adapter in bf16 under an fp32 model: q is then the bf16 draft's distribution."""
    model = make_model("llama", seed=7, vocab_size=5, layers=3)
    path = tmp_path / "a.safetensors"
    write_adapter(model, path, 1, noise=0.3)
    runner = Runner.from_model(model)
    engine = Engine(runner, build_drafter("early_exit", runner, {"adapter": str(path), "k": 3,
                                                                 "draft_dtype": draft_dtype}))
    assert engine.drafter.adapter.layer.dtype == (torch.float32 if draft_dtype == "model" else torch.bfloat16)
    pvalue, totals = sampling_pvalue(engine, model, [1, 2, 3], SamplingConfig(temperature=1.0), samples=2500,
                                     seed=4321)
    assert 0.1 < totals["accepted"] / totals["drafted"] < 0.95
    assert pvalue > P_THRESHOLD


def test_a_bf16_adapter_under_an_fp32_model(model, tmp_path):
    """draft_dtype=bf16: the adapter's layer, cache and draft head in bf16 (its own runner; the model's stays fp32),
    logits close to the fp32 adapter's, and greedy decoding still equals plain decoding (verification is fp32)."""
    path = tmp_path / "a.safetensors"
    write_adapter(model, path, 5, mlp_size=16, noise=0.05, seed=3)
    runner = Runner.from_model(model)
    full, half = ExitAdapter.load(path, runner), ExitAdapter.load(path, runner, torch.bfloat16)
    assert half.layer is not full.layer and half.layer.dtype == torch.bfloat16 and runner.dtype == torch.float32
    assert half.new_cache(8).k.dtype == torch.bfloat16 and ExitAdapter.load(path, runner, torch.bfloat16).layer is \
        half.layer  # kept by the runner per dtype
    hidden = torch.randn(5, runner.spec.hidden_size, generator=torch.Generator().manual_seed(2))  # fp32
    want = full.forward(full.new_cache(8), hidden, 0, logits=True).logits
    got = half.forward(half.new_cache(8), hidden, 0, logits=True).logits  # (5, V) fp32
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)
    vocab = DraftVocab(ids=list(range(0, 320, 2)), model=runner.identity())
    for options in ({"k": 4}, {"k": 3, "draft_vocab": vocab, "confidence": 0.05, "keep_last": True}):
        drafter = build_drafter("early_exit", runner, {"adapter": str(path), "draft_dtype": "bf16", **options})
        assert drafter.adapter.layer is half.layer
        assert drafter.vocab is None or drafter.vocab.linear.weight.dtype == torch.bfloat16
        engine = Engine(runner, drafter)
        outs = [engine.generate(p, DecodeConfig(max_new_tokens=32)) for p in PROMPTS]
        assert [o.tokens for o in outs] == [_ar(runner, p).tokens for p in PROMPTS]
        assert sum(o.stats.accepted for o in outs) > 0, (options, [o.stats.drafted for o in outs])


def test_bad_adapters_are_one_line_errors(model, tmp_path):
    path = tmp_path / "a.safetensors"
    write_adapter(model, path, 2)
    other = Runner.from_model(make_model("llama", seed=1, layers=L))
    with pytest.raises(UserError, match="exit adapter for another model.*weight_fingerprint"):
        build_drafter("early_exit", other, {"adapter": str(path)})
    runner = Runner.from_model(model)
    with pytest.raises(UserError, match="trained at exit layer 2"):
        build_drafter("early_exit", runner, {"adapter": str(path), "E": 4})
    with pytest.raises(UserError, match="does not exist"):
        build_drafter("early_exit", runner, {"adapter": str(tmp_path / "missing.safetensors")})
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="not a readable safetensors"):
        build_drafter("early_exit", runner, {"adapter": str(tmp_path / "junk.safetensors")})
    with pytest.raises(UserError, match="no exit adapter is shipped"):
        build_drafter("early_exit", runner, {"adapter": "default"})
    with pytest.raises(UserError, match="1 <= E < 6"):
        AdapterLM(model, AdapterConfig(enabled=True, exit_layer=6))


def test_a_header_that_lies_about_the_head_layout_is_refused(model, tmp_path):
    """Two heads of width 32 instead of four of 16: the same tensor shapes, another attention; refused in one line."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    write_adapter(model, tmp_path / "a.safetensors", 2)
    with safe_open(str(tmp_path / "a.safetensors"), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    meta["shape"] = json.dumps(json.loads(meta["shape"]) | {"num_heads": 2, "num_kv_heads": 1, "head_dim": 32})
    save_file(tensors, str(tmp_path / "lies.safetensors"), metadata=meta)
    runner = Runner.from_model(model)
    with pytest.raises(UserError, match=r"head layout is not the model's \(num_heads: file has 2, model has 4; "
                       r"num_kv_heads: file has 1, model has 2; head_dim: file has 32, model has 16\)"):
        build_drafter("early_exit", runner, {"adapter": str(tmp_path / "lies.safetensors")})


@pytest.mark.real_model
def test_the_shipped_adapter_drafts_losslessly_on_the_default_model(default_model_path):
    """--adapter default: the file shipped for the default model, its E taken from the file, output unchanged."""
    from infer.loading import load_model

    model = load_model(str(default_model_path), device="cpu")
    prompt = model.encode("def fibonacci(n):\n    ")
    with model.engine("autoregressive") as engine:
        plain = engine.generate(prompt, DecodeConfig(max_new_tokens=24))
    with model.engine("early_exit", adapter="default", num_draft=4, prefix="shared") as engine:
        assert engine.drafter.adapter.exit_layer == engine.drafter.forward.exact_layers == 4  # the file's E
        out = engine.generate(prompt, DecodeConfig(max_new_tokens=24))
    assert out.tokens == plain.tokens and out.stats.drafted > 0


@pytest.mark.real_model
def test_auto_drafts_from_the_vocabulary_size_the_adapter_was_trained_on(default_model_path, tmp_path):
    """With an adapter, draft_vocab=auto is the size its head was trained on (the top N of the shipped counts);
    an explicit size, a file or 'off' is used as given, and a vocabulary file in the provenance leaves auto at the
    shipped AUTO_SIZE."""
    import json

    from safetensors.torch import save_file

    from infer.assets.adapter import adapter_path
    from infer.loading import load_model
    from layerskip_core.adapter_spec import read_file
    from layerskip_core.draft_vocab import AUTO_SIZE

    model = load_model(str(default_model_path), device="cpu")
    shipped = adapter_path("default", model.runner)
    meta, tensors = read_file(shipped)
    provenance = json.loads(meta["provenance"])

    def sized(option, size: int):
        path = tmp_path / f"adapter-{size}-{option.replace('/', '_')}.safetensors"
        provenance["draft_vocab"] = {**provenance["draft_vocab"], "option": option, "size": size}
        save_file(tensors, str(path), {**meta, "provenance": json.dumps(provenance)})
        return str(path)

    def head_size(adapter, **options):
        with model.engine("early_exit", adapter=adapter, num_draft=2, **options) as engine:
            return engine.drafter.vocab.size
    assert head_size("default") == AUTO_SIZE  # the shipped adapter: trained on auto
    assert head_size(sized("16384", 16384)) == 16384
    assert head_size(sized("auto", 4096)) == 4096
    assert head_size(sized("runs/vocab.json", 16384)) == AUTO_SIZE  # a file: auto keeps its meaning
    assert head_size(sized("16384", 16384), draft_vocab="2048") == 2048
