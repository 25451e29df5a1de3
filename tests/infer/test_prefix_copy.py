"""early_exit:prefix=copy: drafts on a copy of layers [0, E) in draft_dtype with caches of their own; the output is
still the model's (greedy identical, sampling exact), and a copy in the model's own dtype drafts exactly what the
shared prefix drafts."""

from __future__ import annotations

import pytest
import torch
from lossless_stats import P_THRESHOLD, sampling_pvalue

from infer import kernels
from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter
from infer.drafters.prefix_copy import CopiedPrefixForward, prefix_copy
from infer.model.program import BULK, STEP
from infer.model.runner import Runner
from infer.model.sampling import SamplingConfig
from layerskip_core.draft_vocab import DraftVocab
from layerskip_core.errors import UserError
from tiny_models import make_model, noisy_adapter

L = 6
PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 250, 17], [42] * 12 + [7, 8], [11]]


@pytest.fixture(scope="module")
def model():
    return make_model("llama", seed=0, layers=L)


@pytest.fixture(scope="module")
def runner(model):
    return Runner.from_model(model)


@pytest.fixture(scope="module")
def adapter(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("adapter") / "a.safetensors"
    noisy_adapter(model, path, 5, 0.05, 3, 16, frozen=False)
    return str(path)


def _ar(runner, prompt, n=32):
    return Engine(runner, build_drafter("autoregressive", runner)).generate(prompt, DecodeConfig(max_new_tokens=n))


def _run(runner, options, prompt, n=32):
    """(output, every draft's tokens, the drafter) of early exit with ``options``."""
    drafter = build_drafter("early_exit", runner, options)
    drafts, propose = [], drafter.propose

    def recorded(state):
        draft = propose(state)
        drafts.append(None if draft is None else (draft.tokens.tolist(), draft.exact_layers))
        return draft

    drafter.propose = recorded
    return Engine(runner, drafter).generate(prompt, DecodeConfig(max_new_tokens=n)), drafts, drafter


def _cases(runner, adapter):
    vocab = DraftVocab(ids=list(range(0, 320, 2)), model=runner.identity())
    return [{"E": 2, "k": 4}, {"E": 4, "k": 3, "draft_vocab": vocab, "confidence": 0.05, "keep_last": True},
            {"adapter": adapter, "k": 4}, {"adapter": adapter, "k": 3, "draft_vocab": vocab, "confidence": 0.01}]


def test_a_copy_in_the_model_dtype_drafts_what_the_shared_prefix_drafts(runner, adapter):
    """Same weights, same kernel: every draft token equals the shared prefix's; only ``exact_layers`` differs (0:
    verification reruns layers [0, E)); the output is plain decoding's."""
    for options in _cases(runner, adapter):
        for prompt in PROMPTS:
            shared = _run(runner, {**options, "draft_dtype": "model"}, prompt)
            copied = _run(runner, {**options, "prefix": "copy", "draft_dtype": "model"}, prompt)
            assert [d and d[0] for d in copied[1]] == [d and d[0] for d in shared[1]], (options, prompt)
            assert {d[1] for d in copied[1] if d} <= {0} and copied[0].tokens == _ar(runner, prompt).tokens
            assert copied[2].forward.prefix.dtype == torch.float32


@pytest.mark.parametrize("exit_layer", [1, 3, L])
def test_a_bf16_copy_is_lossless(runner, adapter, exit_layer):
    """The copy in bf16 under the fp32 model (kept by the runner per E and dtype): greedy output equals plain
    decoding at every exit, with and without an adapter, a draft vocabulary and a confidence stop."""
    for options in [{"E": exit_layer, "k": 4}] + _cases(runner, adapter)[1:]:
        drafted = 0
        for prompt in PROMPTS:
            out, _, drafter = _run(runner, {**options, "prefix": "copy", "draft_dtype": "bf16"}, prompt)
            assert out.tokens == _ar(runner, prompt).tokens, (options, prompt)
            drafted += out.stats.drafted
        prefix = drafter.forward.prefix
        assert prefix is prefix_copy(runner, prefix.num_layers, torch.bfloat16) and prefix.dtype == torch.bfloat16
        assert prefix.layers[0].qkv.weight.dtype == torch.bfloat16 and runner.dtype == torch.float32
        assert drafted > 0


def test_auto_copies_an_adapters_prefix_where_drafts_are_narrower(runner, adapter):
    """prefix=auto: a copy with an exit adapter where draft-dtype resolves narrower than the model's (bf16 under fp32
    on a CPU kernel with native bf16), else the shared prefix; never without an adapter."""
    native = kernels.supports(runner.kernel, torch.bfloat16)
    with_adapter = build_drafter("early_exit", runner, {"adapter": adapter}).forward
    assert isinstance(with_adapter, CopiedPrefixForward) == native
    assert not isinstance(build_drafter("early_exit", runner, {"adapter": adapter, "draft_dtype": "model"}).forward,
                          CopiedPrefixForward)
    assert isinstance(build_drafter("early_exit", runner, {"adapter": adapter, "draft_dtype": "bf16"}).forward,
                      CopiedPrefixForward)
    assert not isinstance(build_drafter("early_exit", runner, {"E": 3, "draft_dtype": "bf16"}).forward,
                          CopiedPrefixForward)


def test_bad_prefix_is_a_one_line_error(runner):
    with pytest.raises(UserError, match="prefix must be one of auto, shared, copy"):
        build_drafter("early_exit", runner, {"prefix": "half"})


@pytest.mark.slow
def test_sampling_with_a_copied_prefix_matches_the_target(tmp_path):
    """q is the bf16 copy's distribution; the target's joint is matched (chi-square)."""
    model = make_model("llama", seed=7, vocab_size=5, layers=3)
    path = tmp_path / "a.safetensors"
    noisy_adapter(model, path, 1, 0.3, 0, 0, frozen=False)
    runner = Runner.from_model(model)
    engine = Engine(runner, build_drafter("early_exit", runner, {"adapter": str(path), "k": 3, "prefix": "copy",
                                                                 "draft_dtype": "bf16"}))
    pvalue, totals = sampling_pvalue(engine, model, [1, 2, 3], SamplingConfig(temperature=1.0), samples=2500,
                                     seed=4321)
    assert 0.1 < totals["accepted"] / totals["drafted"] < 0.95
    assert pvalue > P_THRESHOLD


def test_the_default_model_with_its_adapter_on_a_copied_prefix(default_model_path):
    """The real model and its shipped adapter, prefix=copy at the draft dtype auto picks: plain decoding's output."""
    from infer import load_model

    model = load_model(default_model_path, device="cpu", dtype="fp32")
    config = DecodeConfig(max_new_tokens=24)
    for text in ("def fibonacci(n):", "Natalia sold clips to 48 of her friends in April, and then"):
        want = model.generate(text, "autoregressive", config).tokens
        got = model.generate(text, "early_exit", config, adapter="default", num_draft=6, confidence=0.5,
                             keep_last=True, prefix="copy")  # in bf16 where the CPU has it natively (draft-dtype auto)
        assert got.tokens == want and got.stats.drafted > 0


@pytest.mark.parametrize("plain_steps", [[0, 1, 3, 6], [0, 1, 3, 30]])
@pytest.mark.parametrize("with_adapter", [False, True])
def test_a_batch_catches_up_in_one_packed_forward(runner, adapter, with_adapter, plain_steps, monkeypatch):
    """After plain steps each sequence's copy lacks the rows of the tokens verification took (here 0, 1, 3 and 6 or
    30): ``rows`` runs them in front of each sequence's token in one packed forward (from 32 rows as a prompt's rows,
    ``BULK``) and gives what each sequence's own forward gives (the same draft token, logits equal to rounding), with
    each copy's cache as long."""
    from infer.assets.adapter import ExitAdapter

    exit_adapter = ExitAdapter.load(adapter, runner) if with_adapter else None
    E = exit_adapter.exit_layer if with_adapter else 3

    def started(prompt, steps):
        forward = CopiedPrefixForward(runner, E, torch.float32, exit_adapter)
        cache = runner.new_cache(64)
        tokens = list(prompt) + [(7 * j + 3) % 300 for j in range(steps)]
        runner.forward(cache, torch.tensor(tokens))  # the model's cache: the prompt, then the plain steps' tokens
        forward.start(cache, tokens[:len(prompt)])
        forward.catch_up(cache, tokens, len(tokens))
        return forward, cache, tokens

    seqs = [started(p, m) for p, m in zip(PROMPTS, plain_steps, strict=True)]
    pending = torch.tensor([17, 29, 4, 250])
    positions = [len(t) for _, _, t in seqs]
    for f, _, _ in seqs:
        f.fill()  # the prompts' rows (each its own forward, or a copy of the model's keys and values)
    prefix, runs = seqs[0][0].prefix, []
    run = prefix.run
    monkeypatch.setattr(prefix, "run", lambda program, rows: runs.append((rows.size, rows.kind)) or run(program, rows))
    hidden, logits = seqs[0][0].rows([f for f, _, _ in seqs], [c for _, c, _ in seqs], pending, positions)
    monkeypatch.undo()
    N = sum(plain_steps) + 4
    assert runs == [(N, BULK if N >= 32 else STEP)]  # one forward: every missing row and every token
    assert hidden.shape == (4, runner.spec.hidden_size) and logits.shape == (4, runner.spec.vocab_size)
    for j, (p, m) in enumerate(zip(PROMPTS, plain_steps, strict=True)):
        forward, cache, tokens = started(p, m)
        h, lg = forward(cache, pending[j:j + 1], positions[j])  # (1, d), (1, V)
        assert torch.allclose(lg, logits[j:j + 1], atol=1e-4) and lg.argmax() == logits[j].argmax(), j
        assert torch.allclose(h, hidden[j:j + 1], atol=1e-4), j
        assert forward.cache.lengths == seqs[j][0].cache.lengths, j
        if with_adapter:
            assert forward.adapter_cache.lengths == seqs[j][0].adapter_cache.lengths == [positions[j] + 1]
