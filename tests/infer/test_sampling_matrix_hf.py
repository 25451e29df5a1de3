"""The sampling matrix at the transformers entry: ``model.generate(custom_generate=hf_generate(...))`` with logits
processors given by the caller and by the generation config, in several orders, samples what ``generate`` would: the
first three tokens of many rows (``num_return_sequences``) fit the exact joint under the very processor list that
``generate`` builds (chi-square on a 5-token model). The drafter is early exit with a confidence stop, so the second
and third tokens are drafted positions."""

from __future__ import annotations

import pytest
import torch
from lossless_stats import P_THRESHOLD, TIE_TOP_P, chi2_pvalue, tied_model
from transformers.generation import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from infer import hf_generate
from tiny_models import make_model

PROMPT = [1, 2, 3]
STEPS, NEW_TOKENS, ROWS = 3, 4, 1200


def generate_processors(model, **kwargs) -> LogitsProcessorList:
    """The processor list ``generate`` builds for ``kwargs`` (the caller's own merged before the config's warpers),
    captured from the list it hands a ``custom_generate`` callable."""
    seen = {}

    def capture(model, input_ids, logits_processor=None, **rest):
        seen["processors"] = logits_processor
        return input_ids

    model.generate(torch.tensor([PROMPT]), custom_generate=capture, max_new_tokens=1, **kwargs)
    return seen["processors"]


def processed_joint(model, processors: LogitsProcessorList) -> torch.Tensor:
    """(V, V, V) exact joint of the first three tokens under ``processors`` applied as ``generate`` applies them."""
    V = model.config.vocab_size

    def dist(prefix: list[int]) -> torch.Tensor:
        ids = torch.tensor([prefix])
        return torch.softmax(processors(ids, model(ids).logits[:, -1].float()), -1)[0]  # (V,)

    with torch.no_grad():
        first = dist(PROMPT)
        joint = torch.zeros(V, V, V)
        for a in range(V):
            second = dist(PROMPT + [a])
            for b in range(V):
                joint[a, b] = first[a] * second[b] * dist(PROMPT + [a, b])
    return joint


HF_CASES = {
    "caller-topp-then-temperature": ({"logits_processor": LogitsProcessorList([TopPLogitsWarper(0.6)]),
                                      "temperature": 0.5}),
    "caller-temperature-and-config-temperature": ({"logits_processor": LogitsProcessorList(
        [TemperatureLogitsWarper(0.5)]), "temperature": 0.5}),
    "caller-topk-then-config-topp": ({"logits_processor": LogitsProcessorList([TopKLogitsWarper(3)]),
                                      "top_p": 0.9}),
    "config-temperature-topk-topp": ({"temperature": 0.8, "top_k": 4, "top_p": 0.9}),
    "min-p": ({"min_p": 0.1, "temperature": 0.9}),
    "typical": ({"typical_p": 0.8}),
    "repetition-penalty-and-caller-min-p": ({"repetition_penalty": 1.5, "logits_processor": LogitsProcessorList(
        [MinPLogitsWarper(0.05)])}),
    "caller-typical-before-config-temperature": ({"logits_processor": LogitsProcessorList(
        [TypicalLogitsWarper(0.7)]), "temperature": 0.6}),
}


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_transformers_entry_samples_what_generate_would(case):
    """``model.generate(custom_generate=hf_generate(early_exit with a stop))`` with processors given by the caller and
    by the config: the first three tokens of many rows fit the exact joint under the very processor list that
    ``generate`` builds (chi-square)."""
    model = make_model("llama", seed=7, vocab_size=5, layers=4)  # fresh: hf_generate re-points its parameters
    kwargs = HF_CASES[case] | {"top_k": HF_CASES[case].get("top_k", 0)}  # the tiny model's config has top_k 50
    joint = processed_joint(model, generate_processors(model, do_sample=True, **kwargs)).reshape(-1)
    torch.manual_seed(0)
    custom = hf_generate("early_exit", exit_layer=1, num_draft=2, confidence=0.4)
    out = model.generate(torch.tensor([PROMPT]), custom_generate=custom, max_new_tokens=NEW_TOKENS, do_sample=True,
                         num_return_sequences=ROWS, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True,
                         **kwargs)
    new = out.sequences[:, len(PROMPT):len(PROMPT) + STEPS]  # (rows, 3)
    cells = (new[:, 0] * 25 + new[:, 1] * 5 + new[:, 2]).bincount(minlength=125).double()
    assert sum(s.drafted for s in out.stats) > 100  # the rows drafted
    assert chi2_pvalue(cells.numpy(), joint.double().numpy()) > P_THRESHOLD


def test_tied_tokens_at_the_nucleus_boundary_through_generate():
    """Two tokens with equal logits (identical LM-head rows), the top-p boundary between them: the fast path of
    ``hf_generate`` keeps the one transformers' TopPLogitsWarper keeps (it kept the other: p = 2e-15 in the issue)."""
    model = tied_model()
    kwargs = {"top_p": TIE_TOP_P, "top_k": 0}
    joint = processed_joint(model, generate_processors(model, do_sample=True, **kwargs))  # (V, V, V)
    assert joint[1].sum() == 0 and joint[2].sum() > 0.1  # the boundary splits the tie at the first position
    torch.manual_seed(0)
    custom = hf_generate("early_exit", exit_layer=1, num_draft=2)
    out = model.generate(torch.tensor([PROMPT]), custom_generate=custom, max_new_tokens=NEW_TOKENS, do_sample=True,
                         num_return_sequences=ROWS // 2, eos_token_id=None, pad_token_id=0,
                         return_dict_in_generate=True, **kwargs)
    new = out.sequences[:, len(PROMPT):len(PROMPT) + STEPS]  # (rows, 3)
    cells = (new[:, 0] * 25 + new[:, 1] * 5 + new[:, 2]).bincount(minlength=125).double()
    assert sum(s.drafted for s in out.stats) > 100  # the rows drafted
    assert chi2_pvalue(cells.numpy(), joint.reshape(-1).double().numpy()) > P_THRESHOLD
