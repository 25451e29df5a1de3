"""Gemma 3 270M, the real checkpoint (`layerskip fetch-model gemma3-270m`): what was fetched, and every drafter's greedy
output equal to plain decoding and plain decoding equal to transformers' ``generate``, in fp32, on a prompt that runs
past the 512-token sliding window of 15 of its 18 layers. Skipped when the model is not fetched (CI fetches only the
default model; docs/MODELS.md says why); ``LAYERSKIP_REQUIRE_GEMMA=1`` makes that a failure."""

from __future__ import annotations

import json
import os

import pytest
import torch

from infer.decode.engine import DecodeConfig
from infer.drafters.examples import ExampleModel
from infer.drafters.registry import DRAFTERS, example_cases
from infer.loading import load_model
from layerskip_core.draft_vocab import DraftVocab
from layerskip_core.families import layer_windows
from layerskip_core.models import COMPLETE_FILE, PROVENANCE_FILE, converted_folder_problem, is_model_dir, model_dir
from layerskip_core.shipped import GEMMA3_270M

pytestmark = pytest.mark.real_model
NEW = 10
"""Tokens generated per case: enough for several draft-verify cycles, all of them past the window."""
SENTENCES = ("The river carried {n} boats past the mill before noon.", "def step_{n}(x):\n    return x * {n} + 1\n",
             "Question {n}: what is {n} plus {n}? Answer: {m}.", "In {n} the council voted to rebuild the bridge.")


@pytest.fixture(scope="module")
def gemma_path():
    path = model_dir(GEMMA3_270M.name)
    if not is_model_dir(path):
        if os.environ.get("LAYERSKIP_REQUIRE_GEMMA"):
            pytest.fail(f"Gemma 3 270M missing at {path}; run `layerskip fetch-model gemma3-270m`")
        pytest.skip("Gemma 3 270M not fetched (run `layerskip fetch-model gemma3-270m`)")
    return path


def test_the_fetched_folder_is_gemma_3_270m(gemma_path):
    """Its shape as docs/MODELS.md gives it, its provenance (the pinned GGUF) and license, complete by its marker."""
    config = json.loads((gemma_path / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == \
        ("gemma3_text", 18, 640, 2048)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 1, 256)
    assert config["vocab_size"] == 262144 and config.get("tie_word_embeddings", True)
    from transformers import AutoConfig

    windows = layer_windows(AutoConfig.from_pretrained(gemma_path))
    assert windows.count(512) == 15 and [i for i, w in enumerate(windows) if w is None] == [5, 11, 17]
    provenance = json.loads((gemma_path / PROVENANCE_FILE).read_text())
    assert provenance["sha256"] == GEMMA3_270M.source.sha256 and len(provenance["parts"]) == 4
    assert provenance["license"].startswith("Gemma Terms of Use") and (gemma_path / "GEMMA_TERMS.html").is_file()
    assert (gemma_path / COMPLETE_FILE).is_file() and converted_folder_problem(gemma_path) is None


@pytest.fixture(scope="module")
def model(gemma_path):
    return load_model(str(gemma_path), threads=torch.get_num_threads())


@pytest.fixture(scope="module")
def prompt(model) -> list[int]:
    """About 620 tokens of prose, code and arithmetic: every generated position is past the 512-token window."""
    text = " ".join(SENTENCES[n % 4].format(n=n, m=2 * n) for n in range(1, 40))
    ids = model.encode(text)
    assert 560 <= len(ids) <= 900, len(ids)
    return ids


@pytest.fixture(scope="module")
def plain(model, prompt) -> list[int]:
    with model.engine("autoregressive") as engine:
        return engine.generate(prompt, DecodeConfig(max_new_tokens=NEW)).tokens


@pytest.mark.slow
def test_plain_decoding_equals_transformers_generate_past_the_window(gemma_path, prompt, plain):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(gemma_path, dtype=torch.float32)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert out == plain and len(prompt) > 512


EXAMPLE = ExampleModel(18, exit_layer=14)
"""Gemma 3 270M's drafting examples: exit 14 (teacher-forced agreement 0.41 with the last layer untrained)."""
EARLY_EXIT = {"early_exit_vocab_stop": {"exit_layer": 16, "num_draft": 3, "confidence": 0.2, "keep_last": True},
              "early_exit_adaptive": {"exit_layer": 17, "num_draft": 3, "adaptive": True, "watch": False,
                                      "remember": "off", "recheck_interval": 1, "draft_vocab": "off"}}
"""Early exit's variants: a given reduced head (no vocabulary built: seconds, not minutes) with a stop; its gate."""


def cases(identity: dict) -> dict[str, tuple[str, dict]]:
    """Every registered drafter's examples (``infer.drafters.registry.example_cases``) with the full draft head, and
    early exit's variants; ``identity``: the model's (``Runner.identity()``)."""
    vocab = DraftVocab(ids=list(range(32768)), model=identity)  # the first ids: a cheap stand-in
    out = {case: (name, options | ({"draft_vocab": "off"} if name != "autoregressive" else {}))
           for case, (name, options) in example_cases(EXAMPLE).items()}
    return out | {case: ("early_exit", {"draft_vocab": vocab} | options) for case, options in EARLY_EXIT.items()}


def test_the_cases_cover_every_registered_drafter():
    names = {name for name, _ in cases({"num_layers": 18, "vocab_size": 262144}).values()}
    assert names == set(DRAFTERS)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(cases({"num_layers": 18, "vocab_size": 262144})))
def test_every_drafter_equals_plain_decoding_past_the_window(model, prompt, plain, case):
    name, options = cases(model.runner.identity())[case]
    with model.engine(name, options) as engine:
        result = engine.generate(prompt, DecodeConfig(max_new_tokens=NEW))
    assert result.tokens == plain, case
    if name != "autoregressive":
        assert result.stats.drafted > 0, case  # drafting was exercised, not only plain steps
