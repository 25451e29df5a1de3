"""Every drafter on every family of issue 47 (and the windowed ones): greedy output equals plain decoding, and plain
decoding equals transformers' greedy ``generate``, for generations that run past the sliding window."""

import pytest
import torch

from infer import hf_generate
from infer.decode.batch import BatchEngine
from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import ExampleModel, build_drafter, example_cases
from infer.model import fused_span
from infer.model.plan import LayerPlan, PlanFile
from infer.model.runner import Runner
from layerskip_core.draft_vocab import DraftVocab
from tiny_models import FAMILY_KINDS, TINY_WINDOW, family_model, noisy_adapter

L = 6
NEW = TINY_WINDOW + 16  # prompt + new tokens run past the window
PROMPTS = [[5, 17, 99, 3, 44, 120, 7], list(range(60, 90))]
PLAIN = "autoregressive"
SWIFT = {"context_window": 8, "opt_budget": 0.95, "fallback_opt_budget": 0.95, "remember": "off",
         "confidence": 0.013, "costs": "weights"}


@pytest.fixture(scope="module", params=FAMILY_KINDS)
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def model(kind):
    return family_model(kind, seed=5, layers=L)


@pytest.fixture(scope="module")
def runner(model):
    return Runner.from_model(model)


@pytest.fixture(scope="module")
def plain(runner):
    config = DecodeConfig(max_new_tokens=NEW)
    return [Engine(runner, build_drafter("autoregressive", runner)).generate(p, config).tokens for p in PROMPTS]


@pytest.fixture(scope="module")
def adapter_path(model, tmp_path_factory):
    """An exit adapter at E = 3 trained for no steps but perturbed (its drafts differ from the plain exit's)."""
    path = tmp_path_factory.mktemp("adapter") / "a.safetensors"
    noisy_adapter(model, path, 3, noise=0.05)
    return str(path)


def cases(runner, adapter: str) -> dict[str, tuple[str, dict]]:
    """Every registered drafter's examples but plain decoding (with the exit adapter), and early exit with a reduced
    draft vocabulary."""
    vocab = DraftVocab(ids=list(range(3, 300)), model=runner.identity())
    drafting = {case: c for case, c in example_cases(ExampleModel(L, adapter=adapter)).items() if c[0] != PLAIN}
    return drafting | {"early_exit_vocab": ("early_exit", {"E": 3, "k": 4, "draft_vocab": vocab})}


def _fused_runs(runner, what: str = "runs") -> int:
    """How many programs the runner's fused executor ran (``packed``: over several sequences); the runner has one
    on the kernel's AVX-512 path (every family of these tests qualifies)."""
    if runner.kernel is None or runner.kernel.path() != "avx512":
        pytest.skip("the fused executor runs on the kernel's AVX-512 path only")
    assert runner.fused is not None, fused_span.unfit(runner)
    return getattr(runner.fused, what)


def test_plain_decoding_equals_transformers_generate(model, plain):
    for prompt, ours in zip(PROMPTS, plain, strict=True):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(prompt):].tolist()
        assert ours == ref
        assert len(prompt) + NEW > TINY_WINDOW


def test_every_drafter_greedy_equals_plain_decoding(runner, plain, adapter_path):
    config = DecodeConfig(max_new_tokens=NEW)
    for case, (name, options) in cases(runner, adapter_path).items():
        drafted, fused = 0, _fused_runs(runner)
        for prompt, ref in zip(PROMPTS, plain, strict=True):
            result = Engine(runner, build_drafter(name, runner, options)).generate(prompt, config)
            assert result.tokens == ref, (case, prompt[:3])
            drafted += result.stats.drafted
        assert drafted > 0, case
        assert _fused_runs(runner) > fused, case  # drafts and verifications ran on the fused executor


@pytest.mark.parametrize("how", ["static", "compiled", "captured"])
def test_drafters_on_the_static_executor(model, plain, how, monkeypatch):
    """The static forwards, their steps compiled (dynamo with the cheap 'eager' backend on a CPU: the same traced layer
    math the GPU's inductor compiles), and with CUDA-graph replay semantics (``executor_cases.fake_capture``: outputs
    overwritten in place)."""
    from executor_cases import fake_capture

    from infer.model.compiled import StepCache
    from infer.model.graphs import StaticExecutor, StaticSpan

    runner = Runner.from_model(model, executor="static", compile=StepCache("eager") if how == "compiled" else False)
    if how == "captured":
        monkeypatch.setattr(StaticSpan, "capture", fake_capture)
        runner.static = StaticExecutor(runner, capture=True)
    config = DecodeConfig(max_new_tokens=NEW)
    for name, options in [("early_exit", {"E": 2, "k": 3}), ("swift", SWIFT)]:
        for prompt, ref in zip(PROMPTS, plain, strict=True):
            assert Engine(runner, build_drafter(name, runner, options)).generate(prompt, config).tokens == ref, name
    spans = runner.static.spans()
    assert spans and (how != "captured" or any(s.graph is not None for s in spans))  # graphs replayed


def test_batched_rows_equal_plain_decoding(runner, plain, adapter_path):
    config = DecodeConfig(max_new_tokens=NEW)
    for case, (name, options) in cases(runner, adapter_path).items():
        packed = _fused_runs(runner, "packed")
        with BatchEngine(runner, lambda name=name, options=options: build_drafter(name, runner, options), 2) as batch:
            results = batch.generate(PROMPTS, config)
        assert [r.tokens for r in results] == plain, case
        assert _fused_runs(runner, "packed") > packed, case  # the two rows' forwards ran packed, fused


def test_hf_generate_equals_plain_generate(kind, tmp_path):
    model = family_model(kind, seed=5, layers=L)  # fresh: hf_generate points its parameters at the runner's
    plan = tmp_path / "plan.json"
    PlanFile(LayerPlan(L, frozenset({2}), frozenset({3})), Runner.from_model(model).identity(), task="t").save(plan)
    ids = torch.tensor(PROMPTS[:1])
    ref = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    for case, (name, options) in example_cases(ExampleModel(L, plan=str(plan)), main_only=True).items():
        out = model.generate(ids, custom_generate=hf_generate(name, **options), max_new_tokens=NEW,
                             eos_token_id=None, pad_token_id=0)
        assert torch.equal(out, ref), case
