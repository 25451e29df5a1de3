"""Our drafters inside transformers' ``generate`` (``custom_generate=hf_generate(...)`` and the folder form): greedy
output identical to plain ``generate`` and to our own API, weights shared with the model, the generation config
honoured, and what is not implemented refused in one line."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from infer import hf_generate, load_model
from infer.decode.engine import DecodeConfig
from infer.drafters import ExampleModel, example_cases
from infer.drafters.examples import default_plan
from infer.hf.decoding import FOLDER
from infer.model.plan import PlanFile
from infer.model.runner import Runner
from layerskip_core.errors import UserError
from tiny_models import make_model

PROMPT = [[5, 17, 99, 3, 44, 120, 7]]


def drafters(model, tmp_path) -> dict[str, tuple[str, dict]]:
    """Every registered drafter's examples on a 4-layer tiny model (their skip plan as a plan file, as
    ``hf_generate``'s keywords take one)."""
    plan = tmp_path / "plan.json"
    identity = Runner.from_model(model).identity()
    PlanFile(default_plan(4), identity, task="test").save(plan)
    return example_cases(ExampleModel(4, plan=str(plan)))


@pytest.fixture(params=["llama", "qwen2"])
def model(request):
    return make_model(request.param, seed=3)  # fresh per test: hf_generate re-points its parameters


def test_greedy_equals_plain_generate_for_every_drafter(model, tmp_path):
    ids = torch.tensor(PROMPT)
    ref = model.generate(ids, max_new_tokens=40, do_sample=False)
    for case, (name, options) in drafters(model, tmp_path).items():
        out = model.generate(ids, custom_generate=hf_generate(name, **options), max_new_tokens=40,
                             return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref), case
        stats = out.stats[0]
        assert stats.new_tokens == 40 and (name == "autoregressive" or stats.drafted > 0), case
    assert torch.equal(model.generate(ids, max_new_tokens=40, do_sample=False), ref)  # the model still decodes


def test_same_tokens_as_our_own_api(tiny_model_dir):
    """The tokens of ``load_model(folder).generate`` (what ``layerskip generate`` prints) for the same prompt."""
    ours = load_model(str(tiny_model_dir), device="cpu", threads=1)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = DecodeConfig(max_new_tokens=24, stop_at_eos=False)
    expected = ours.generate("def add(a, b):", "early_exit", config, exit_layer=2).tokens
    ids = tok("def add(a, b):", return_tensors="pt")
    out = hf.generate(**ids, custom_generate=hf_generate("early_exit", exit_layer=2), max_new_tokens=24,
                      eos_token_id=None, pad_token_id=0)
    assert out[0, ids["input_ids"].shape[1]:].tolist() == expected


def test_the_runner_shares_the_models_weights(model):
    """No weight is held twice where the runner keeps plain matrices: its fused q/k/v and gate/up matrices back the
    model's parameters. Where the kernel holds them packed only (its AVX-512 path) nothing can be shared: the model
    keeps every parameter of its own, with the values it had."""
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    custom = hf_generate("early_exit", exit_layer=2)
    model.generate(torch.tensor(PROMPT), custom_generate=custom, max_new_tokens=4)
    runner = custom.runner_for(model)
    linears = [m for layer in runner.layers for m in (layer.qkv, layer.gate_up, layer.o, layer.down)]
    model_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    if all(m.plain is None for m in linears):  # packed only
        assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
        assert not {m.panels.untyped_storage().data_ptr() for m in linears} & model_storages
    else:
        runner_storages = {m.plain.untyped_storage().data_ptr() for m in linears}
        runner_storages.add(runner.embed_w.untyped_storage().data_ptr())
        assert runner_storages <= model_storages
        q_proj = model.model.layers[1].self_attn.q_proj
        assert q_proj.weight.untyped_storage().data_ptr() == runner.layers[1].qkv.plain.untyped_storage().data_ptr()
    assert custom.runner_for(model) is runner  # built once per model


def test_left_padded_batch_and_num_return_sequences(model):
    short, long = [9, 8, 7], [1, 2, 3, 4, 5, 6]
    ids = torch.tensor([[0] * 3 + short, long])
    mask = torch.tensor([[0] * 3 + [1] * 3, [1] * 6])
    custom = hf_generate("early_exit", exit_layer=2)
    out = model.generate(input_ids=ids, attention_mask=mask, custom_generate=custom, max_new_tokens=12,
                         pad_token_id=0)
    for row, prompt in zip(out, (short, long), strict=True):
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert row[6:].tolist() == alone[0, len(prompt):].tolist()
    torch.manual_seed(0)
    sampled = model.generate(torch.tensor(PROMPT), custom_generate=custom, max_new_tokens=12, do_sample=True,
                             temperature=0.9, top_k=50, top_p=0.95, num_return_sequences=3)
    torch.manual_seed(0)
    again = model.generate(torch.tensor(PROMPT), custom_generate=custom, max_new_tokens=12, do_sample=True,
                           temperature=0.9, top_k=50, top_p=0.95, num_return_sequences=3)
    assert sampled.shape == (3, 19) and torch.equal(sampled, again)  # torch.manual_seed makes it repeatable
    assert len({tuple(r.tolist()) for r in sampled}) > 1  # each row draws its own tokens


def test_top_k_one_sampling_is_greedy_and_eos_stops(model):
    ids = torch.tensor(PROMPT)
    greedy = model.generate(ids, max_new_tokens=20, do_sample=False)
    custom = hf_generate("early_exit", exit_layer=2)
    assert torch.equal(model.generate(ids, custom_generate=custom, max_new_tokens=20, do_sample=True, top_k=1), greedy)
    eos = int(greedy[0, len(PROMPT[0]) + 4])
    ref = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=0)
    out = model.generate(ids, custom_generate=custom, max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, ref) and int(out[0, -1]) == eos


def test_streamer_gets_the_prompt_then_each_accepted_token(model):
    class Collect:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    streamer = Collect()
    ids = torch.tensor(PROMPT)
    out = model.generate(ids, custom_generate=hf_generate("early_exit", exit_layer=2, streamer=streamer),
                         max_new_tokens=16)
    assert streamer.puts[0] == PROMPT[0] and streamer.ended
    assert sum(streamer.puts[1:], []) == out[0, len(PROMPT[0]):].tolist()


@pytest.mark.parametrize("kwargs, message", [
    ({"output_scores": True, "return_dict_in_generate": True}, "output_scores=True is not supported"),
    ({"num_beams": 2}, "num_beams=2 is not supported"),
])
def test_unsupported_settings_are_refused_in_one_line(model, kwargs, message):
    with pytest.raises(UserError, match=message) as err:
        model.generate(torch.tensor(PROMPT), custom_generate=hf_generate("swift"), max_new_tokens=8, **kwargs)
    assert "\n" not in str(err.value)


def test_bad_drafter_options_and_right_padding_are_refused(model):
    with pytest.raises(UserError, match="no_such_option"):
        hf_generate("early_exit", no_such_option=1)
    with pytest.raises(UserError):
        hf_generate("no_such_drafter")
    with pytest.raises(UserError, match="left padding"):
        model.generate(input_ids=torch.tensor([[4, 5, 0], [4, 5, 6]]),
                       attention_mask=torch.tensor([[1, 1, 0], [1] * 3]),
                       custom_generate=hf_generate(), max_new_tokens=4, pad_token_id=0)


def test_folder_form(model, tmp_path):
    """``custom_generate=<folder>, trust_remote_code=True``: drafter options as keywords of generate."""
    ids = torch.tensor(PROMPT)
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)
    out = model.generate(ids, custom_generate=str(FOLDER), trust_remote_code=True, drafter="early_exit",
                         exit_layer=2, num_draft=3, max_new_tokens=24, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref) and out.stats[0].drafted > 0


@pytest.mark.real_model
def test_default_model_greedy_equals_plain_generate(default_model_path):
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(default_model_path)
    inputs = tok("def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"\n", return_tensors="pt")
    ref = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    for name, options in (("early_exit", {"exit_layer": 8}), ("swift", {})):
        custom = hf_generate(name, tokenizer=tok, **options)
        out = model.generate(**inputs, custom_generate=custom, max_new_tokens=32)
        assert torch.equal(out, ref), name
