"""The sampling matrix: every drafter, and every option that changes what gets proposed (confidence stops, dynamic
choices, token trees, a reduced draft vocabulary, an exit adapter, batched rows, the transformers entry with a
caller's processors in several orders: ``test_sampling_matrix_hf.py``), samples from the exact target distribution.

Each case draws the first tokens of many generations on a 5-token, 4-layer model whose target joint is computed
exactly by enumeration, and asks a chi-square test whether the sample fits it (seeded, so deterministic). Each
case also checks that drafting was really exercised: drafts were proposed, some accepted and some rejected.
Tokens 2 and 3 are drafted positions (4 tokens are generated: the prefill's token, then a chain of 2).
"""

from __future__ import annotations

import pytest
import torch
from lossless_stats import (
    P_THRESHOLD,
    TIE_TOP_P,
    batch_sampling_pvalue,
    sampling_pvalue,
    tied_model,
    transformers_probs,
)

from infer.decode.batch import BatchEngine
from infer.decode.batch_gate import BatchGate
from infer.decode.engine import Engine
from infer.drafters import ExampleModel, build_drafter, drafter_spec, example_cases
from infer.kernels import quant
from infer.model.plan import LayerPlan
from infer.model.runner import Runner
from infer.model.sampling import SamplingConfig
from layerskip_core.draft_vocab import DraftVocab
from tiny_models import make_model, noisy_adapter

PROMPT = [1, 2, 3]
STEPS, NEW_TOKENS, SAMPLES = 3, 4, 1200
STOP = 0.4
"""A confidence stop this model's exit-1 draft falls below at about three positions in four."""
T1 = SamplingConfig(temperature=1.0)
WARPED = {"t07-topk3": SamplingConfig(temperature=0.7, top_k=3), "topp08": SamplingConfig(temperature=1.0, top_p=0.8)}
FORCED_DYNAMIC = {"min_speedup": 0, "adaptive": False, "observe_every": 1, "calibrate": False, "exits": "1/2", "k": 2,
                  "costs": "weights"}
"""dynamic_exit always drafting its best (E, k) from weight-count prices, observing every cycle (no clock involved)."""


@pytest.fixture(scope="module")
def model():
    return make_model("llama", seed=7, vocab_size=5, layers=4)


@pytest.fixture(scope="module")
def runner(model):
    return Runner.from_model(model)


@pytest.fixture(scope="module")
def adapter_file(model, tmp_path_factory):
    """An exit adapter at E = 1, perturbed by seeded noise (a stand-in for training: its drafts differ from the plain
    exit's and the target's)."""
    path = tmp_path_factory.mktemp("adapter") / "a.safetensors"
    noisy_adapter(model, path, 1, noise=0.3)
    return str(path)


def example_model(adapter: str) -> ExampleModel:
    """This model for the registered drafters' examples: one-exit drafting from exit 1 (where ``STOP`` is tuned), a
    plan skipping attention at layer 2 and the MLPs of layers 1 and 3, the exit adapter at E = 1."""
    return ExampleModel(4, exit_layer=1, plan=LayerPlan(4, frozenset({2}), frozenset({1, 3})), adapter=adapter)


REGISTRY = [case for case, (name, _) in example_cases(example_model("adapter")).items() if name != "autoregressive"]
"""Every registered drafter's examples (plain decoding drafts nothing to test)."""


def variants(runner: Runner, adapter: str) -> dict[str, dict]:
    """Options of one drafter that change what it proposes, each labelled ``DRAFTER-what``: confidence stops, a
    reduced draft vocabulary (the target's likely token left out: the residual), an exit adapter with a stop and with
    its stopping token kept, dynamic exit's stops, SWIFT's token trees from a uniform plan."""
    likely = 2  # a token the target often picks first: leaving it out of the draft vocabulary tests the residual
    stop = {"exit_layer": 1, "num_draft": 3, "confidence": STOP}
    tree = {"confidence": 0.99, "num_draft": 2, "adaptive": False, "max_opt_steps": 0, "skip_ratio": 0.3}
    return {
        "early_exit-stop": stop,
        "early_exit-vocab-stop": stop | {"draft_vocab": DraftVocab(ids=[t for t in range(5) if t != likely],
                                                                   model=runner.identity())},
        "early_exit-adapter-stop": {"adapter": adapter, "num_draft": 3, "confidence": STOP},
        "early_exit-adapter-keep": {"adapter": adapter, "num_draft": 3, "confidence": STOP, "keep_last": True},
        "dynamic_exit-stop": FORCED_DYNAMIC | {"stops": str(STOP)},
        "dynamic_exit-stops": FORCED_DYNAMIC | {"stops": "0/0.3/0.5"},
        "self_sd-stop": {"plan": LayerPlan(4, frozenset({2}), frozenset({1, 3})), "num_draft": 3, "confidence": 0.5},
        "swift-tree": tree,
        "swift-tree-vocab": tree | {"draft_vocab": DraftVocab(ids=[0, 1, 2, 3], model=runner.identity())},
        # quantized drafts (issue 64): the draft's layers and head are int8 / int4 copies
        "quant_self-int4": {"draft_dtype": "int4", "num_draft": 3},
        "early_exit-int4-stop": stop | {"draft_dtype": "int4"},
        "early_exit-int8-copy": {"exit_layer": 2, "num_draft": 3, "prefix": "copy", "draft_dtype": "int8"},
        "early_exit-adapter-int4": {"adapter": adapter, "num_draft": 3, "draft_dtype": "int4"},
        "dynamic_exit-int8": FORCED_DYNAMIC | {"stops": "0/0.3/0.5", "draft_dtype": "int8"},
        "self_sd-int4": {"plan": LayerPlan(4, frozenset({2}), frozenset({1, 3})), "num_draft": 3, "confidence": 0.5,
                         "draft_dtype": "int4"},
        "swift-tree-int8": tree | {"draft_dtype": "int8"},
    }


def options(case: str, runner: Runner, adapter: str) -> tuple[str, dict]:
    """The drafter and its options for a case of the matrix: a registered drafter's example, or a variant (its
    drafter the label's first part)."""
    if case in REGISTRY:
        return example_cases(example_model(adapter))[case]
    return case.split("-")[0], variants(runner, adapter)[case]


def check(pvalue: float, totals: dict) -> None:
    """The sample fits the target, and drafting was exercised (drafts proposed, some accepted, some rejected)."""
    assert totals["drafted"] > SAMPLES // 6, totals
    assert 0.05 < totals["accepted"] / totals["drafted"] < 0.98, totals
    assert pvalue > P_THRESHOLD


CASES = [*REGISTRY, "early_exit-stop", "early_exit-vocab-stop", "early_exit-adapter-stop", "early_exit-adapter-keep",
         "dynamic_exit-stop", "dynamic_exit-stops", "self_sd-stop", "swift-tree", "swift-tree-vocab"]
QUANT_CASES = ["quant_self-int4", "early_exit-int4-stop", "early_exit-int8-copy", "early_exit-adapter-int4",
               "dynamic_exit-int8", "self_sd-int4", "swift-tree-int8"]
"""Quantized drafts: run where the quantized kernel runs (its portable route dequantizes, slowly)."""


@pytest.mark.parametrize("case", CASES)
def test_every_drafter_samples_the_target(case, model, runner, adapter_file):
    name, opts = options(case, runner, adapter_file)
    engine = Engine(runner, build_drafter(name, runner, opts))
    check(*sampling_pvalue(engine, model, PROMPT, T1, STEPS, SAMPLES, seed=11, new_tokens=NEW_TOKENS))


@pytest.mark.skipif(quant.kernel_op() is None, reason="the quantized kernel does not run on this CPU")
@pytest.mark.parametrize("case", QUANT_CASES)
def test_quantized_drafts_sample_the_target(case, model, runner, adapter_file):
    """Drafts from int8 / int4 copies (their own distributions q, further from the target's p) are still accepted by
    min(1, p / q) and corrected from the residual: the output samples the target."""
    name, opts = options(case, runner, adapter_file)
    engine = Engine(runner, build_drafter(name, runner, opts))
    check(*sampling_pvalue(engine, model, PROMPT, T1, STEPS, SAMPLES, seed=15, new_tokens=NEW_TOKENS))


@pytest.mark.parametrize(("case", "warp"), [("early_exit-stop", "t07-topk3"), ("dynamic_exit-stops", "topp08"),
                                            ("self_sd", "t07-topk3"), ("swift-tree", "topp08"),
                                            ("early_exit-vocab-stop", "topp08")])
def test_temperature_top_k_and_top_p_with_drafting(case, warp, model, runner, adapter_file):
    name, opts = options(case, runner, adapter_file)
    engine = Engine(runner, build_drafter(name, runner, opts))
    check(*sampling_pvalue(engine, model, PROMPT, WARPED[warp], STEPS, SAMPLES, seed=12, new_tokens=NEW_TOKENS))


@pytest.mark.parametrize("case", ["early_exit-stop", "dynamic_exit-stops", "swift-tree", "early_exit-int4-stop"])
def test_batched_rows_sample_the_target(case, model, runner, adapter_file):
    """Rows of one batch (drafted in packed forwards, verified together), each its own generation."""
    name, opts = options(case, runner, adapter_file)
    resolved = drafter_spec(name, opts).resolve(runner, None)  # once: a fresh drafter per row is built from it
    with BatchEngine(runner, lambda: resolved.build(runner), batch_size=8) as batch:
        check(*batch_sampling_pvalue(batch, model, PROMPT, T1, STEPS, SAMPLES, seed=13, new_tokens=NEW_TOKENS))


class CappedGate(BatchGate):
    """The batch's gate drafting every cycle at most ``fixed`` tokens a row (``DecodeState.draft_cap``)."""

    def __init__(self, fixed: int):
        super().__init__()
        self.fixed = fixed

    def drafts(self, rows: int) -> bool:
        return True

    def cap(self, rows: int) -> int:
        return self.fixed


@pytest.mark.parametrize("case", ["early_exit-stop", "swift-tree"])
def test_batched_rows_with_capped_drafts_sample_the_target(case, model, runner, adapter_file):
    """The batch's gate caps each row's draft (a chain cut at 1 token, a tree at 1 node): still the target."""
    name, opts = options(case, runner, adapter_file)
    resolved = drafter_spec(name, opts).resolve(runner, None)
    with BatchEngine(runner, lambda: resolved.build(runner), batch_size=8) as batch:
        batch.gate = CappedGate(1)
        check(*batch_sampling_pvalue(batch, model, PROMPT, T1, STEPS, SAMPLES, seed=14, new_tokens=NEW_TOKENS))


def test_the_old_confidence_stop_rule_is_detected(model, runner, monkeypatch):
    """The matrix would have caught the defect it was written for: a chain that drops a sampled token because the
    token's own draft probability is low proposes from q restricted to likely tokens, and the test sees it."""
    import infer.drafters.chain as chain

    real = chain._next_token
    monkeypatch.setattr(chain, "_next_token", lambda *a, top1=True, **k: real(*a, top1=False, **k))
    engine = Engine(runner, build_drafter("early_exit", runner, {"exit_layer": 1, "num_draft": 3, "confidence": STOP}))
    pvalue, totals = sampling_pvalue(engine, model, PROMPT, T1, STEPS, SAMPLES, seed=11, new_tokens=NEW_TOKENS)
    assert totals["drafted"] > 0 and pvalue < P_THRESHOLD


def test_the_reported_reproduction_matches_the_target():
    """The review's case: a 2-layer 5-token model, early exit at layer 1 with confidence stop 0.3, sampling at T=1
    (token 0 came out at 0.688 against a target 0.472 with the old rule)."""
    model = make_model("llama", seed=7, vocab_size=5, layers=2)
    runner = Runner.from_model(model)
    engine = Engine(runner, build_drafter("early_exit", runner, {"exit_layer": 1, "num_draft": 3, "confidence": 0.3}))
    pvalue, totals = sampling_pvalue(engine, model, PROMPT, T1, STEPS, SAMPLES, seed=8, new_tokens=NEW_TOKENS)
    assert totals["drafted"] > 0 and pvalue > P_THRESHOLD


@pytest.mark.parametrize("kind", ["qwen3"])
def test_new_families_sample_the_target(kind):
    """The matrix's core case on Qwen3 (per-head q/k norms): early exit with a confidence stop at T = 1 (Gemma 3 runs
    the matrix's drafter cases in ``test_families_sampling.py``)."""
    from tiny_models import family_model

    model = family_model(kind, seed=7, layers=4, vocab_size=5)
    runner = Runner.from_model(model)
    engine = Engine(runner, build_drafter("early_exit", runner, {"exit_layer": 1, "num_draft": 3, "confidence": 0.3}))
    check(*sampling_pvalue(engine, model, PROMPT, T1, STEPS, SAMPLES, seed=21, new_tokens=NEW_TOKENS))


def test_tied_tokens_at_the_nucleus_boundary_sample_what_transformers_keeps():
    """Two tokens with equal logits, the top-p boundary between them: transformers' TopPLogitsWarper drops token 1 and
    keeps 2; the engine's draws (drafted positions included) fit its processed joint (a descending sort kept 1 and
    dropped 2: about one draw in nine began with a token transformers rules out)."""
    model = tied_model()
    cfg = SamplingConfig(temperature=1.0, top_p=TIE_TOP_P)
    with torch.no_grad():
        first = transformers_probs(model(torch.tensor([PROMPT])).logits[0, -1], cfg)  # (V,)
    assert first[1] == 0 and first[2] > 0.1  # the boundary splits the tie
    runner = Runner.from_model(model)
    engine = Engine(runner, build_drafter("early_exit", runner, {"exit_layer": 1, "num_draft": 3}))
    check(*sampling_pvalue(engine, model, PROMPT, cfg, STEPS, SAMPLES // 2, seed=14, new_tokens=NEW_TOKENS))
