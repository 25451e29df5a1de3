"""Real clients of transformers' ``generate`` running our drafters: a text-generation pipeline, an evaluation harness
(lm-eval's ``generate_until`` with stop sequences, batched), and the default model with a repetition penalty and a
caller's stopping criterion. Each equals the same client's plain run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList, pipeline

from infer import hf_generate
from infer.hf.decoding import FOLDER
from tiny_models import byte_tokenizer, make_model

PROMPTS = ["def add(a, b):", "x = 1", "import os\n", "class A:"]


def tiny():
    """A tiny Llama whose every token id is a byte the tokenizer decodes (so stop sequences can match)."""
    return make_model("llama", seed=3, vocab_size=259), byte_tokenizer()


def test_text_generation_pipeline():
    model, tok = tiny()
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    plain = pipe(PROMPTS[:2], max_new_tokens=16, do_sample=False, repetition_penalty=1.2)
    ours = pipe(PROMPTS[:2], max_new_tokens=16, do_sample=False, repetition_penalty=1.2,
                custom_generate=hf_generate("early_exit", exit_layer=2, num_draft=3))
    assert ours == plain


def stop_sequence(model, tok) -> str:
    """A character the plain greedy continuation of the first prompt produces after a few tokens."""
    ids = tok(PROMPTS[0], return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    return tok.decode(out[0, ids.shape[1] + 5:ids.shape[1] + 6])


def local_task(folder: Path, until: list[str]) -> str:
    """A generate_until task on a JSON-lines file (no hub): its name."""
    data = folder / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "target": ""}) + "\n" for p in PROMPTS))
    (folder / "task.yaml").write_text(
        "task: layerskip_local\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
        "test_split: test\noutput_type: generate_until\n"
        'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
        f"generation_kwargs:\n  until: {json.dumps(until)}\n  max_gen_toks: 16\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    return "layerskip_local"


def test_lm_eval_generate_until_through_our_drafter(tmp_path, monkeypatch):
    """lm-eval's HF model, batch size 2 (left padding, its stateful stop-sequence criteria), with the folder form
    given as generation keywords (what `lm_eval --gen_kwargs` passes): the same responses as its plain run."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    model, tok = tiny()
    until = stop_sequence(model, tok)
    task = local_task(tmp_path, [until])

    def responses(gen_kwargs: str | None) -> list[str]:
        lm = HFLM(pretrained=model, tokenizer=tok, batch_size=2)
        result = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=TaskManager(include_path=str(tmp_path)),
                                         gen_kwargs=gen_kwargs, log_samples=True)
        return [s["resps"][0][0] for s in result["samples"][task]]

    plain = responses(None)
    ours = responses(f"custom_generate={FOLDER},trust_remote_code=True,drafter=early_exit,exit_layer=2,num_draft=3")
    assert ours == plain
    assert any(len(tok(r)["input_ids"]) < 15 for r in plain)  # a stop sequence ended at least one response early


class StopAfterNewline(StoppingCriteria):
    """A caller's own criterion: stop a row once its output holds three newlines."""

    def __init__(self, tokenizer, prompt_len: int):
        self.tokenizer, self.prompt_len = tokenizer, prompt_len

    def __call__(self, input_ids, scores, **kwargs):
        return torch.tensor([self.tokenizer.decode(row).count("\n") >= 3 for row in input_ids[:, self.prompt_len:]])


@pytest.mark.real_model
def test_default_model_repetition_penalty_and_a_callers_criterion(default_model_path):
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(default_model_path)
    inputs = tok("def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"\n", return_tensors="pt")
    P = inputs["input_ids"].shape[1]
    kw = dict(max_new_tokens=40, repetition_penalty=1.3)
    ref = model.generate(**inputs, do_sample=False, stopping_criteria=StoppingCriteriaList([StopAfterNewline(tok, P)]),
                         **kw)
    assert ref.shape[1] < P + 40  # the criterion stopped it
    for name, options in (("early_exit", {"exit_layer": 8}), ("swift", {})):
        out = model.generate(**inputs, custom_generate=hf_generate(name, tokenizer=tok, **options),
                             stopping_criteria=StoppingCriteriaList([StopAfterNewline(tok, P)]), **kw)
        assert torch.equal(out, ref), name
