"""Quantized drafts (issue 64): ``--draft-dtype int8|int4`` for every drafter and ``quant_self`` (the model's own
quantized copy as its drafter). Drafts run quantized copies of the weights only drafts read; verification keeps the
model's own, so greedy output equals plain decoding token for token (fp32 and bf16 models, batches, the transformers
entry), and what cannot run is refused in one line."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from infer import hf_generate, kernels, load_model
from infer.decode.batch import BatchEngine
from infer.decode.engine import DecodeConfig, Engine
from infer.drafters import ExampleModel, build_drafter, drafter_spec, example_cases
from infer.drafters.inputs import draft_quant
from infer.kernels import quant
from infer.model.plan import PlanFile
from infer.model.program import Program, Rows
from infer.model.quant_weights import QuantLinear, quantized
from infer.model.runner import Runner
from layerskip_core.errors import UserError
from tiny_models import family_model, make_model, noisy_adapter

L = 6
PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 250, 17, 42, 42, 8], [11, 12]]
GEN = DecodeConfig(max_new_tokens=24, stop_at_eos=False)
DTYPES = ["fp32", "bf16"]
needs_kernel = pytest.mark.skipif(quant.kernel_op() is None, reason="the quantized kernel does not run on this CPU")


@pytest.fixture(scope="module")
def model():
    return make_model("llama", seed=0, layers=L)


@pytest.fixture(scope="module")
def runners(model):
    return {"fp32": Runner.from_model(model), "bf16": Runner.from_model(model, dtype=torch.bfloat16)}


EXAMPLES = ExampleModel(L, exit_layer=L // 2)
"""The registered drafters' examples on this model (``infer.drafters.examples``): drafting from E = 3, the default
skip plan."""


def plain(runner, prompt):
    return Engine(runner, build_drafter("autoregressive", runner)).generate(prompt, GEN).tokens


def registry_cases():
    return [(case, dt, mdt) for case, (name, _) in example_cases(EXAMPLES, main_only=True).items()
            if name != "autoregressive" for dt in ("int8", "int4") for mdt in DTYPES]


@needs_kernel
@pytest.mark.parametrize(("name", "draft_dtype", "model_dtype"), registry_cases())
def test_every_drafter_at_every_quantized_dtype_is_lossless(runners, name, draft_dtype, model_dtype):
    """Every registered drafter (its main example, ``infer.drafters.examples``) with int8 and int4 drafts, under an
    fp32 and a bf16 model: greedy output equal to plain decoding, drafts proposed, and the draft's layers are a
    quantized copy (nothing exact: verification runs every layer)."""
    runner = runners[model_dtype]
    if model_dtype == "bf16" and not kernels.supports(runner.kernel, torch.bfloat16):
        pytest.skip("no native bf16 kernel here: a bf16 model's verification rounds by T (the near-tie rule)")
    options = example_cases(EXAMPLES, main_only=True)[name][1] | {"draft_dtype": draft_dtype}
    drafter = build_drafter(name, runner, options)
    engine = Engine(runner, drafter)
    drafted = 0
    for prompt in PROMPTS:
        out = engine.generate(prompt, GEN)
        assert out.tokens == plain(runner, prompt), (name, draft_dtype, model_dtype, prompt)
        drafted += out.stats.drafted
    assert drafted > 0
    forward = drafter.forward if hasattr(drafter, "forward") else next(iter(drafter.forwards_at.values()))
    layers = getattr(forward, "prefix", None) or forward.runner
    assert isinstance(layers.layers[0].qkv, QuantLinear) and forward.exact_layers == 0
    assert isinstance(drafter.vocab.linear, QuantLinear) and drafter.vocab.linear.scheme.bits == 8


@needs_kernel
def test_early_exit_at_the_models_depth_is_the_quantized_self_draft(runners):
    """``early_exit --exit-layer L --draft-dtype int4`` (the spelling benchmarks use) drafts the very tokens of
    ``quant_self``: the same code, all L layers of the int4 copy, then the int8 draft head."""
    runner = runners["fp32"]
    drafts = {}
    for name, options in (("early_exit", {"exit_layer": L, "draft_dtype": "int4"}), ("quant_self", {})):
        drafter = build_drafter(name, runner, options | {"num_draft": 4})
        seen, propose = [], drafter.propose
        drafter.propose = lambda state, p=propose, s=seen: s.append((d := p(state)) and d.tokens.tolist()) or d
        out = Engine(runner, drafter).generate(PROMPTS[1], GEN)
        assert out.tokens == plain(runner, PROMPTS[1])
        drafts[name] = seen
        assert drafter.forward.program.end == L and len(drafter.forward.runner.layers) == L
    assert drafts["early_exit"] == drafts["quant_self"] and any(drafts["quant_self"])


@needs_kernel
@pytest.mark.parametrize("options", [{"exit_layer": 3, "draft_dtype": "int4"},
                                     {"exit_layer": L, "draft_dtype": "int8", "prefix": "copy"},
                                     {"exit_layer": 2, "draft_dtype": "int4", "tree": True, "max_tree_nodes": 6,
                                      "confidence": 0.2, "keep_last": True}])
def test_the_prefix_a_quantized_draft_runs_on(runners, options):
    """auto = a quantized copy over the model's own cache (its history rows the model's; the cache's layers lose
    what the draft wrote at verification); copy = a quantized copy with its own cache, following the tokens."""
    runner = runners["fp32"]
    drafter = build_drafter("early_exit", runner, options | {"num_draft": 4})
    own = options.get("prefix") == "copy"
    assert drafter.own_caches == own
    engine = Engine(runner, drafter)
    for prompt in PROMPTS:
        assert engine.generate(prompt, GEN).tokens == plain(runner, prompt)


@needs_kernel
def test_an_exit_adapter_quantized(model, runners, tmp_path):
    """The adapter's own layer and the copy of layers [0, E) quantized (prefix auto: a copy with its own caches):
    lossless; an adapter whose MLP width int4's groups do not divide is refused naming the file."""
    runner = runners["fp32"]
    path = tmp_path / "a.safetensors"
    noisy_adapter(model, path, 3, 0.05, 3, 64, frozen=False)
    drafter = build_drafter("early_exit", runner, {"adapter": str(path), "draft_dtype": "int4", "num_draft": 3})
    assert isinstance(drafter.adapter.layer.layers[0].qkv, QuantLinear)
    assert isinstance(drafter.forward.prefix.layers[0].o, QuantLinear)
    engine = Engine(runner, drafter)
    for prompt in PROMPTS:
        assert engine.generate(prompt, GEN).tokens == plain(runner, prompt)
    narrow = tmp_path / "narrow.safetensors"
    noisy_adapter(model, narrow, 3, 0.05, 3, 48, frozen=False)
    with pytest.raises(UserError, match=r"narrow.safetensors \(an exit adapter\)'s mlp.down_proj has input width 48, "
                                        r"which int4's groups of 64 do not divide; use --draft-dtype int8"):
        build_drafter("early_exit", runner, {"adapter": str(narrow), "draft_dtype": "int4"})
    build_drafter("early_exit", runner, {"adapter": str(narrow), "draft_dtype": "int8"})  # int8 fits any width


@needs_kernel
@pytest.mark.parametrize("case", [case for case, (name, _) in example_cases(EXAMPLES).items()
                                  if name != "autoregressive"])
def test_batched_rows_with_quantized_drafts(runners, case):
    """BatchEngine, every registered drafter's every example with int4 drafts: rows draft from the quantized copy in
    packed forwards, each over its own cache (or the copy's); every row's output equals plain decoding of its
    prompt."""
    runner = runners["fp32"]
    name, options = example_cases(EXAMPLES)[case]
    resolved = drafter_spec(name, options | {"draft_dtype": "int4"}).resolve(runner, None)
    with BatchEngine(runner, lambda: resolved.build(runner), batch_size=3) as batch:
        outs = batch.generate(PROMPTS, GEN)
    assert [o.tokens for o in outs] == [plain(runner, p) for p in PROMPTS]
    assert sum(o.stats.drafted for o in outs) > 0


@needs_kernel
@pytest.mark.parametrize("draft_dtype", ["int8", "int4"])
def test_the_transformers_entry_and_the_python_api(tiny_model_dir, draft_dtype):
    """``hf_generate(..., draft_dtype=...)`` inside transformers' generate equals plain greedy generate, and
    ``load_model(...).generate(..., draft_dtype=...)`` gives the same tokens."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([PROMPTS[1]])
    ref = hf.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    for name, options in (("early_exit", {"exit_layer": 4}), ("quant_self", {})):
        out = hf.generate(ids, custom_generate=hf_generate(name, draft_dtype=draft_dtype, **options),
                          max_new_tokens=24, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref) and out.stats[0].drafted > 0, name
    ours = load_model(str(tiny_model_dir), device="cpu", threads=1)
    text = ours.generate("def add(a, b):", "early_exit", DecodeConfig(max_new_tokens=16, stop_at_eos=False),
                         exit_layer=4, draft_dtype=draft_dtype)
    assert text.tokens == ours.generate("def add(a, b):", "autoregressive",
                                        DecodeConfig(max_new_tokens=16, stop_at_eos=False)).tokens


@needs_kernel
def test_a_quantized_matrix_has_the_linear_interface(runners):
    """QuantLinear: the kernel's product, rows of the matrix its codes stand for, the bytes it reads; a T-row forward
    of the quantized copy gives each row bitwise what it gives alone (drafts of a batch are each row's own)."""
    runner = runners["fp32"]
    lin = runner.layers[0].gate_up
    q = QuantLinear(lin.weight, None, "int4", runner.kernel, torch.float32)
    x = torch.randn(5, lin.shape[1])
    assert torch.equal(q(x), quant.matmul(x, q.qw)) and q.nbytes == q.qw.nbytes < lin.nbytes / 6
    assert torch.equal(q.rows(torch.tensor([3, 0])), quant.dequantize(q.qw)[[3, 0]])
    copy = quantized(runner, "int8")
    assert copy is quantized(runner, "int8") and quantized(runner, "int8", 3).layers[2] is copy.layers[2]
    cache = copy.new_cache(64)
    hidden = runner.embed(torch.tensor(PROMPTS[1]))  # (7, d)
    copy.run(Program(0, L), Rows.one(cache, hidden[:2], [0, 1]))  # a prompt (causal, on SDPA), then decoding rows
    together = copy.run(Program(0, L), Rows.one(cache, hidden[2:], list(range(2, 7)))).hidden  # (5, d)
    cache.rollback(2)
    alone = [copy.run(Program(0, L), Rows.one(cache, hidden[t:t + 1], [t])).hidden for t in range(2, 7)]
    assert torch.equal(together, torch.cat(alone))


def test_settings_a_quantized_draft_cannot_run_are_refused_in_one_line(runners, monkeypatch):
    """int4 on a model whose widths its groups do not divide (names the matrix, width, group and what to use), a
    quantized draft off the CPU, prefix=shared_kv without int8/int4 or with an adapter, quant_self in a float dtype."""
    qwen3 = Runner.from_model(family_model("qwen3", seed=0, layers=4))  # head dim 24: o_proj reads 4 x 24 = 96
    with pytest.raises(UserError, match=r"^draft dtype int4: the model's self_attn.o_proj has input width 96, which "
                                        r"int4's groups of 64 do not divide; use --draft-dtype int8 \(or bf16\)"):
        build_drafter("early_exit", qwen3, {"exit_layer": 2, "draft_dtype": "int4"})
    runner = runners["fp32"]
    monkeypatch.setattr(runner, "device", torch.device("cuda", 0))
    with pytest.raises(UserError, match="quantized drafts run on the CPU kernel only, the model is on cuda:0; use "
                                        "--draft-dtype bf16, fp16 or model there"):
        draft_quant("int8", runner)
    monkeypatch.undo()
    with pytest.raises(UserError, match="exit layer 0 is out of range"):  # 0 is not "the model's depth"
        build_drafter("quant_self", runner, {"exit_layer": 0})
    for name, options, message in [
            ("early_exit", {"prefix": "shared_kv", "draft_dtype": "bf16"}, "needs draft-dtype int8 or int4"),
            ("early_exit", {"prefix": "shared_kv", "draft_dtype": "int4", "adapter": "default"}, "with an adapter"),
            ("quant_self", {"draft_dtype": "bf16"}, "draft-dtype int8 or int4, not 'bf16'"),
            ("quant_self", {"adapter": "default"}, "not an exit adapter")]:
        with pytest.raises(UserError, match=message) as e:
            drafter_spec(name, options)
        assert "\n" not in str(e.value)


@needs_kernel
def test_a_plan_found_with_the_quantized_full_head_records_the_full_head(runners, tmp_path):
    """SWIFT with draft_vocab off and int8 drafts scores with a quantized copy of every row of the head: the plan it
    saves records the full head (not 320 ids), so Self-SD drafts it with the full head again."""
    runner = runners["fp32"]
    path = tmp_path / "swift.json"
    options = {"draft_vocab": "off", "draft_dtype": "int8", "save_plan": str(path), "adaptive": False,
               "context_window": 4, "remember": "off"}
    with Engine(runner, build_drafter("swift", runner, options)) as engine:
        engine.generate(PROMPTS[1], GEN)
    assert PlanFile.load(path).draft_head == {"vocab": "full"}
