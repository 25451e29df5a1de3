"""The fused executor over a quantized draft copy (issue 64: ``infer.model.quant_weights.quantized``): the int8 / int4
codes run on ``quant.cpp``'s matmul inside ``layer_span.cpp``, so a quantized draft no longer runs the Python layer
loop. A quantized copy need not equal the model's float math, but its fused forward must equal the Python loop over
the same ``QuantLinear`` weights bitwise: every family whose widths int4's groups of 64 divide (Qwen3's o_proj reads
96: int8 only), fp32 and bf16, programs (full, a skip plan after a cut, observed layers, sub-ranges) over one sequence
and packed sequences with token-tree masks; row t of a T-row forward bitwise the 1-row forward; and every drafter's
greedy output still equals plain decoding with int4 drafts, with its quantized layers run fused."""

from __future__ import annotations

import pytest
import torch
from test_fused_families import DTYPES, KINDS, PROGRAMS, SHAPES, _caches, _run, _runner, _same_caches, _same_output
from test_fused_families import _segments as segments_of

from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import ExampleModel, build_drafter, example_cases
from infer.kernels import quant
from infer.model import fused_span
from infer.model.program import Program, Rows
from infer.model.quant_weights import QuantLinear, quantized
from infer.model.runner import Runner
from tiny_models import make_model

needs_kernel = pytest.mark.skipif(quant.kernel_op() is None, reason="the quantized kernel does not run on this CPU")
CASES = [(kind, scheme) for kind in KINDS for scheme in ("int8", "int4") if not (kind == "qwen3" and scheme == "int4")]
COPY_SHAPES = {name: SHAPES[name] for name in ("one", "one tree", "B=4")}
"""One row, a token tree, four packed sequences (B=2 adds nothing the others miss)."""


def _copy(kind: str, dtype: torch.dtype, scheme: str):
    copy = quantized(_runner(kind, dtype), scheme)
    assert isinstance(copy.layers[0].qkv, QuantLinear) and isinstance(copy.layers[-1].down, QuantLinear)
    return copy


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("kind", "scheme"), CASES)
def test_fused_is_the_loop_on_a_quantized_copy(kind, scheme, dtype):
    """The quantized copy has a fused executor (it declined them before), and its fused programs equal the loop's
    over the same codes: streams, logits, K/V rows, windowed slots, lengths, counters; each packed row bitwise its
    sequence alone."""
    copy = _copy(kind, dtype, scheme)
    assert fused_span.unfit(copy) is None and copy.fused is not None
    caches = _caches(copy)
    for shape_name, shape in COPY_SHAPES.items():
        segments = segments_of(copy, caches, shape)
        N = sum(s.size for s in segments)
        hidden = copy.embed((torch.arange(N) * 11) % 300 + 5)  # (N, d)
        for name, program in PROGRAMS.items():
            label = (kind, scheme, dtype, shape_name, name)
            loop, loop_caches, loop_counts = _run(copy, False, program, hidden, segments)
            out, fused_caches, counts = _run(copy, True, program, hidden, segments)
            _same_output(loop, out, label)
            _same_caches(loop_caches, fused_caches, label)
            assert loop_counts == counts, label
            a = 0
            for s in segments if len(segments) > 1 else []:
                alone, alone_caches, _ = _run(copy, True, program, hidden[a:a + s.size], [s])
                _same_output(out, alone, label + ("alone", a), slice(a, a + s.size))
                _same_caches(alone_caches, [fused_caches[segments.index(s)]], label + ("alone", a))
                a += s.size


@needs_kernel
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_rows_product_is_its_one_row_product_fused(scheme):
    """Row t of a T-row fused forward of the quantized copy is bitwise that row's 1-row fused forward (drafts of a
    verified block, or of a batch, are each row's own), and both ran fused."""
    copy = _copy("llama", torch.float32, scheme)
    cache = copy.new_cache(64)
    hidden = copy.embed(torch.tensor([100, 3, 250, 17, 42, 42, 8]))  # (7, d)
    copy.run(Program(0, copy.num_layers), Rows.one(cache, hidden[:2], [0, 1]))  # a prompt: causal, on SDPA
    runs = copy.fused.runs
    full = Program(0, copy.num_layers, logits=True)
    together = copy.run(full, Rows.one(cache, hidden[2:], list(range(2, 7))))  # (5, d)
    cache.rollback(2)
    alone = [copy.run(full, Rows.one(cache, hidden[t:t + 1], [t])) for t in range(2, 7)]
    assert torch.equal(together.hidden, torch.cat([a.hidden for a in alone]))
    assert torch.equal(together.logits, torch.cat([a.logits for a in alone]))
    assert copy.fused.runs == runs + 6


GEN = DecodeConfig(max_new_tokens=24, stop_at_eos=False)
PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 250, 17, 42, 42, 8]]
EXAMPLES = ExampleModel(6, exit_layer=3)


def _quantized_layers(drafter):
    """The runners of the drafter's quantized layers (its prefix copy, or the copy its forwards run)."""
    forwards = [drafter.forward] if hasattr(drafter, "forward") else list(drafter.forwards_at.values())
    out = [getattr(f, "prefix", None) or f.runner for f in forwards]
    adapter = getattr(drafter, "adapter", None)
    return out + ([adapter.layer] if adapter is not None else [])


@pytest.fixture(scope="module")
def drafting_runner():
    """The drafting tests' own fp32 model (its quantized copies' fused counters start at 0 in this module)."""
    return Runner.from_model(make_model("llama", seed=0, layers=6))


@needs_kernel
@pytest.mark.parametrize("name", sorted({name for name, _ in example_cases(EXAMPLES, main_only=True).values()}
                                        - {"autoregressive"}))
def test_every_drafter_drafts_int4_on_the_fused_executor(drafting_runner, name):
    """Every registered drafter (its main example) with int4 drafts: greedy output equal to plain decoding, and its
    quantized layers ran fused (programs of the copy taken by ``FusedSpan``, none declined for the matrices)."""
    runner = drafting_runner
    options = next(o for n, o in example_cases(EXAMPLES, main_only=True).values() if n == name)
    drafter = build_drafter(name, runner, options | {"draft_dtype": "int4"})
    engine = Engine(runner, drafter)
    plain = Engine(runner, build_drafter("autoregressive", runner))
    for prompt in PROMPTS:
        assert engine.generate(prompt, GEN).tokens == plain.generate(prompt, GEN).tokens, (name, prompt)
    copies = [c for c in _quantized_layers(drafter) if isinstance(c.layers[0].qkv, QuantLinear)]
    assert copies, name
    assert all(c.fused is not None for c in copies), [fused_span.unfit(c) for c in copies]
    assert sum(c.fused.runs for c in copies) > 0, name


@needs_kernel
@pytest.mark.parametrize("draft_dtype", ["int8", "int4"])
def test_dynamic_exit_measures_a_quantized_copy_shallower_than_the_model(drafting_runner, draft_dtype):
    """dynamic_exit's measured costs time the quantized copy's exits (layers [0, 3) here): the copy's own depth bounds
    what is timed (it timed layer L - 1 = 5 of a 3-layer copy: an error on either executor; the default model's
    ``dynamic_exit --draft-dtype int4`` failed), and the drafts stay lossless."""
    runner = drafting_runner
    drafter = build_drafter("dynamic_exit", runner, {"exits": "1/3", "costs": "measured", "draft_dtype": draft_dtype})
    assert drafter.drafting.num_layers == 3 < runner.num_layers and set(drafter.prices) == {1, 3}
    plain = Engine(runner, build_drafter("autoregressive", runner))
    assert Engine(runner, drafter).generate(PROMPTS[1], GEN).tokens == plain.generate(PROMPTS[1], GEN).tokens
