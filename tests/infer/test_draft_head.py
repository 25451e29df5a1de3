"""Reduced-vocabulary draft heads: drafts score N token ids, verification the full head; still lossless."""

import pytest
import torch
from lossless_stats import P_THRESHOLD, sampling_pvalue

from infer import kernels
from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import build_drafter
from infer.drafters.inputs import draft_dtype
from infer.model.runner import Runner
from infer.model.sampling import SamplingConfig
from layerskip_core.draft_vocab import DraftVocab
from layerskip_core.errors import UserError
from tiny_models import make_model

L = 6
PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 250, 17], [42] * 12 + [7, 8]]


@pytest.fixture(scope="module")
def model():
    return make_model("llama", seed=0, layers=L)


@pytest.fixture(scope="module", params=["eager", "static"])
def runner(model, request):
    return Runner.from_model(model, executor=request.param)


def _vocab(runner, ids) -> DraftVocab:
    return DraftVocab(ids=sorted(set(ids)), model=runner.identity())


def _ar(runner, prompt, n=32):
    return Engine(runner, build_drafter("autoregressive", runner)).generate(prompt, DecodeConfig(max_new_tokens=n))


def test_draft_head_scores_only_its_ids(runner):
    """Logits equal the full head's on the subset and are -inf elsewhere; the gathered rows are built once."""
    ids = [0, 2, 7, 100, 319]
    head = runner.draft_head(ids)
    assert runner.draft_head(list(reversed(ids))) is head and head.size == 5
    hidden = torch.randn(3, runner.spec.hidden_size)
    full, sub = runner.head(hidden), runner.head(hidden, head)  # (3, V) each
    torch.testing.assert_close(sub[:, ids], full[:, ids], atol=1e-5, rtol=0)
    outside = torch.ones(runner.spec.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(sub[:, outside]).all() and (sub[:, outside] < 0).all()


def test_draft_dtype_puts_the_draft_head_in_it(runner):
    """The head's rows in bf16 (half the bytes), kept apart from the model-dtype head; fp32 logits close to the full
    head's on the subset, -inf elsewhere. 'auto' is bf16 exactly where the model runs fp32 on the eager executor and a
    CPU kernel with native bf16 dot products, else the model's dtype; a name outside the list is refused."""
    ids = [0, 2, 7, 100, 319]
    head = runner.draft_head(ids, torch.bfloat16)
    assert head is not runner.draft_head(ids) and head is runner.draft_head(ids, torch.bfloat16)
    assert head.linear.weight.dtype == torch.bfloat16 and runner.draft_head(ids).linear.weight.dtype == torch.float32
    hidden = torch.randn(3, runner.spec.hidden_size)
    full, sub = runner.head(hidden), runner.head(hidden, head)  # (3, V) fp32 each
    assert sub.dtype == torch.float32 and torch.isinf(sub[:, 1]).all()
    torch.testing.assert_close(sub[:, ids], full[:, ids], atol=0.05, rtol=0.02)
    native = kernels.supports(runner.kernel, torch.bfloat16) and runner.executor == "eager"  # not CUDA's executors
    assert draft_dtype("auto", runner) == (torch.bfloat16 if native else torch.float32)
    assert (draft_dtype("model", runner), draft_dtype("fp16", runner)) == (torch.float32, torch.float16)
    with pytest.raises(UserError, match="draft-dtype must be one of auto, model"):
        build_drafter("early_exit", runner, {"draft_dtype": "int3"})


@pytest.mark.parametrize("draft_dtype", ["model", "bf16"])
def test_a_bf16_draft_head_is_lossless(runner, draft_dtype):
    """Greedy early exit and SWIFT with a bf16 draft head under an fp32 model equal plain decoding."""
    vocab = _vocab(runner, range(0, 320, 2))
    for name, options in (("early_exit", {"exit_layer": 3, "k": 4}), ("swift", {})):
        drafter = build_drafter(name, runner, {"draft_vocab": vocab, "draft_dtype": draft_dtype, **options})
        assert drafter.vocab.linear.weight.dtype == (torch.float32 if draft_dtype == "model" else torch.bfloat16)
        engine = Engine(runner, drafter)
        for prompt in PROMPTS:
            assert engine.generate(prompt, DecodeConfig(max_new_tokens=24)).tokens == _ar(runner, prompt, 24).tokens


@pytest.mark.parametrize("exit_layer", range(1, L + 1))
def test_greedy_early_exit_with_a_subset_equals_autoregressive(runner, exit_layer):
    """For every exit layer, with a subset that leaves out some of the tokens the model will choose."""
    for prompt in PROMPTS:
        ref = _ar(runner, prompt).tokens
        vocab = _vocab(runner, (set(range(0, 320, 2)) | set(ref)) - {ref[1]})  # even ids, the output but one
        assert ref[1] not in vocab.ids  # the subset misses a token the target picks
        options = {"exit_layer": exit_layer, "num_draft": 4, "draft_vocab": vocab}
        engine = Engine(runner, build_drafter("early_exit", runner, options))
        out = engine.generate(prompt, DecodeConfig(max_new_tokens=32))
        assert out.tokens == ref, (exit_layer, prompt)
        assert out.stats.drafter.draft_vocab == vocab.size


def test_a_subset_head_drafts_only_subset_tokens(model):
    """At E = L the draft is the full model restricted to the subset: drafts inside the subset are accepted,
    drafts can never be outside it."""
    runner = Runner.from_model(model)
    ref = _ar(runner, PROMPTS[0], 24).tokens
    vocab = _vocab(runner, ref)  # exactly the tokens of the output: every draft is right
    engine = Engine(runner, build_drafter("early_exit", runner, {"exit_layer": L, "num_draft": 4,
                                                                  "draft_vocab": vocab}))
    gen = engine.start(PROMPTS[0], DecodeConfig(max_new_tokens=24))
    while not gen.done:
        outcome = engine.step(gen)
        if outcome.draft is not None:
            assert set(outcome.draft.tokens.tolist()) <= set(vocab.ids)
    assert engine.finish(gen).stats.acceptance_rate == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("draft_dtype", ["model", "bf16"])
def test_sampling_with_a_subset_that_excludes_likely_tokens_matches_target(draft_dtype):
    """The draft distribution is zero outside the subset; the residual at rejection covers the rest exactly. Also with
    the draft head in bf16 under the fp32 model (q is then the bf16 head's distribution)."""
    model = make_model("llama", seed=7, vocab_size=5, layers=2)
    runner = Runner.from_model(model)
    with torch.no_grad():
        likely = int(model(torch.tensor([[1, 2, 3]])).logits[0, -1].argmax())
    vocab = _vocab(runner, [t for t in range(5) if t != likely])  # the target's favourite first token is out
    engine = Engine(runner, build_drafter("early_exit", runner, {"exit_layer": 1, "num_draft": 3,
                                                                  "draft_vocab": vocab, "draft_dtype": draft_dtype}))
    assert engine.drafter.vocab.linear.weight.dtype == (torch.float32 if draft_dtype == "model" else torch.bfloat16)
    pvalue, totals = sampling_pvalue(engine, model, [1, 2, 3], SamplingConfig(temperature=1.0), samples=2500,
                                     seed=4321)
    assert 0.1 < totals["accepted"] / totals["drafted"] < 0.95  # drafts are used and sometimes rejected
    assert pvalue > P_THRESHOLD


def test_bad_draft_vocab_options_are_one_line_errors(model, tmp_path):
    runner = Runner.from_model(model)
    with pytest.raises(UserError, match="draft-vocab file .*missing.json' does not exist; give a file made by"):
        build_drafter("early_exit", runner, {"draft_vocab": str(tmp_path / "missing.json")})
    with pytest.raises(UserError, match="neither a size"):
        build_drafter("early_exit", runner, {"draft_vocab": "nonsense"})
    with pytest.raises(UserError, match="size >= 1"):
        build_drafter("early_exit", runner, {"draft_vocab": "0"})
    with pytest.raises(UserError, match="bundled|draft-vocab"):
        build_drafter("early_exit", runner, {"exit_layer": 2, "draft_vocab": "64"})  # no counts for the tiny model


def test_self_sd_and_swift_with_a_subset_equal_autoregressive(runner, tmp_path):
    """Every drafter takes a draft vocabulary; greedy output stays the plain output (trees included)."""
    from infer.model.plan import LayerPlan, PlanFile

    plan = tmp_path / f"plan-{runner.executor}.json"
    PlanFile(LayerPlan(L, frozenset({2, 4}), frozenset({3})), runner.identity(), task="test").save(plan)
    for prompt in PROMPTS:
        ref = _ar(runner, prompt).tokens
        vocab = _vocab(runner, (set(range(0, 320, 2)) | set(ref)) - {ref[1]})
        for name, options in (("self_sd", {"plan": str(plan)}),
                              ("swift", {"plan": str(plan), "adaptive": False, "context_window": 8,
                                         "remember": "off", "opt_budget": 0.95})):
            drafter = build_drafter(name, runner, options | {"draft_vocab": vocab})
            out = Engine(runner, drafter).generate(prompt, DecodeConfig(max_new_tokens=32))
            assert out.tokens == ref, (name, prompt)
            assert out.stats.drafted > 0 and out.stats.drafter.draft_vocab == vocab.size


def test_auto_is_the_full_head_where_no_counts_ship(model):
    """The default, draft_vocab=auto, needs counts made for the model: the tiny model has none (full head)."""
    runner = Runner.from_model(model)
    for name, options in (("early_exit", {"exit_layer": 2}), ("swift", {"remember": "off"})):
        drafter = build_drafter(name, runner, options)
        assert drafter.config.draft_vocab == "auto" and drafter.vocab is None
        assert drafter.stats().draft_vocab is None
    assert build_drafter("early_exit", runner, {"exit_layer": 2, "draft_vocab": "off"}).vocab is None


@pytest.mark.real_model
def test_auto_takes_the_shipped_counts_on_the_default_model(default_model_path):
    """On the default model (and, through its tokenizer, checkpoints trained from it) auto is the top 8192 ids."""
    from infer.loading import load_model

    model = load_model(str(default_model_path), device="cpu")
    with model.engine("early_exit", exit_layer=24) as engine:
        assert engine.drafter.vocab.size == 8192
    with model.engine("early_exit", exit_layer=24, draft_vocab="off") as engine:
        assert engine.drafter.vocab is None
    assert build_drafter("early_exit", model.runner, {"exit_layer": 24}).vocab.size == 8192  # weights match too
