"""hf_generate's contract with transformers' ``generate``: every argument honoured or refused in one line, logits
processors and stopping criteria of any kind with the output of plain ``generate``, and streamers that always end."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TextIteratorStreamer,
    TopKLogitsWarper,
)

from infer import hf_generate
from infer.hf.contract import FIELDS, HARMLESS, HONOURED, NEUTRAL, REFUSED, check_config
from infer.hf.decoding import FOLDER
from layerskip_core.errors import UserError
from tiny_models import byte_tokenizer, make_model

PROMPT = [[5, 17, 99, 3, 44, 120, 7]]
EARLY = ("early_exit", {"exit_layer": 2, "num_draft": 3})
SWIFT = ("swift", {"adaptive": False, "context_window": 8, "remember": "off"})  # tree drafts


def early(**extra):
    """hf_generate with a drafting early exit on the tiny model."""
    return hf_generate(EARLY[0], **EARLY[1], **extra)


@pytest.fixture
def model():
    return make_model("llama", seed=3)  # fresh per test: hf_generate re-points its parameters


def test_every_generation_config_field_is_classified():
    """A field a newer transformers adds fails here until it is classified (honoured, refused or harmless)."""
    fields = set(GenerationConfig().to_dict()) | set(vars(GenerationConfig()))
    fields = {f for f in fields if not (f.startswith("_") and f != "_from_model_config")}
    assert fields - set(FIELDS) == set(), "classify these in infer/hf/contract.py and docs/HF_GENERATE.md"
    assert {verdict for verdict, _ in FIELDS.values()} == {HONOURED, REFUSED, HARMLESS}
    assert all(why for _, why in FIELDS.values())


def test_the_docs_table_says_what_the_code_does():
    text = (Path(__file__).resolve().parents[2] / "docs" / "HF_GENERATE.md").read_text()
    missing = [f for f, (verdict, _) in FIELDS.items() if f"| `{f}` | {verdict} |" not in text]
    assert not missing, "docs/HF_GENERATE.md's table lacks or misstates these fields"


@pytest.mark.parametrize("name", sorted(f for f, (v, _) in FIELDS.items() if v == REFUSED))
def test_each_refused_field_is_refused_naming_it(name):
    config = GenerationConfig()
    setattr(config, name, "quantized" if name == "cache_implementation" else 2)  # a value asking for something
    with pytest.raises(UserError, match=f"^{name}=") as err:
        check_config(config)
    assert "\n" not in str(err.value)
    for value in NEUTRAL.get(name, (None,)):  # and the values that ask for nothing pass
        setattr(config, name, value)
        check_config(config)


@pytest.mark.parametrize("kwargs, message", [
    ({"penalty_alpha": 0.6, "top_k": 4}, "penalty_alpha=0.6"),
    ({"dola_layers": "high"}, "dola_layers='high'"),
    ({"assistant_early_exit": 2}, "assistant_early_exit=2"),
    ({"prompt_lookup_num_tokens": 3}, "prompt_lookup_num_tokens=3"),
    ({"low_memory": True}, "low_memory=True"),
    ({"cache_implementation": "offloaded"}, "cache_implementation='offloaded'"),
    ({"inputs_embeds": torch.zeros(1, 7, 64)}, "inputs_embeds"),
    ({"guidance_scale": 1.5}, "guidance_scale=1.5"),
])
def test_what_would_change_the_tokens_is_refused_in_one_line(model, kwargs, message):
    with pytest.raises(UserError, match=message) as err:
        model.generate(torch.tensor(PROMPT), custom_generate=early(), max_new_tokens=6, **kwargs)
    assert "\n" not in str(err.value)


def test_assistant_model_and_a_cache_to_fill_are_refused(model):
    from transformers import DynamicCache
    custom = early()
    with pytest.raises(UserError, match="assistant_model"):
        model.generate(torch.tensor(PROMPT), custom_generate=custom, max_new_tokens=6,
                       assistant_model=make_model("llama", seed=4))
    with pytest.raises(UserError, match="past_key_values"):
        model.generate(torch.tensor(PROMPT), custom_generate=custom, max_new_tokens=6,
                       cache=DynamicCache(config=model.config))


def test_position_ids_other_than_generates_are_refused(model):
    ids = torch.tensor(PROMPT)
    with pytest.raises(UserError, match="position_ids"):
        model.generate(ids, custom_generate=early(), max_new_tokens=4, position_ids=torch.arange(7)[None] + 3)
    ref = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(ids, custom_generate=early(), max_new_tokens=4,
                                      position_ids=torch.arange(7)[None]), ref)


def test_harmless_settings_leave_the_tokens_as_plain_generate(model):
    ids = torch.tensor(PROMPT)
    ref = model.generate(ids, max_new_tokens=12, do_sample=False)
    out = model.generate(ids, custom_generate=early(), max_new_tokens=12, use_cache=False,
                         cache_implementation="static", length_penalty=2.0, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref) and out.cache is None


class PenaliseLast(LogitsProcessor):
    """A caller's own prefix-dependent processor: the last token's logit down by 5."""

    def __call__(self, input_ids, scores):
        return scores.scatter_add(1, input_ids[:, -1:], torch.full_like(scores[:, :1], -5.0))


class BanTopK(TopKLogitsWarper):
    """A subclass of a transformers warper with behaviour of its own (bans token 222 and 272)."""

    def __call__(self, input_ids, scores):
        return scores.index_fill(1, torch.tensor([222, 272]), float("-inf"))


@pytest.mark.parametrize("drafter", [EARLY, SWIFT], ids=["chain", "tree"])
def test_prefix_dependent_processors_equal_plain_generate(model, drafter):
    """Repetition penalty, no-repeat n-grams, bad words, a minimum length, a caller's processor and a subclassed
    warper, applied at every verified position: greedy output is plain generate's."""
    ids = torch.tensor(PROMPT)
    kw = dict(max_new_tokens=24, repetition_penalty=1.3, no_repeat_ngram_size=3, bad_words_ids=[[41]],
              min_new_tokens=8, eos_token_id=7, pad_token_id=0,
              logits_processor=LogitsProcessorList([PenaliseLast(), BanTopK(top_k=5)]))
    ref = model.generate(ids, do_sample=False, **kw)
    out = model.generate(ids, custom_generate=hf_generate(drafter[0], **drafter[1]), return_dict_in_generate=True,
                         **kw)
    assert torch.equal(out.sequences, ref)
    assert out.stats[0].drafted > 0


def test_sampling_uses_the_processed_distribution(model):
    """min-p and a repetition penalty with top-k 1: sampling from the processed scores is greedy with the penalty."""
    ids = torch.tensor(PROMPT)
    ref = model.generate(ids, max_new_tokens=20, do_sample=False, repetition_penalty=1.4)
    out = model.generate(ids, custom_generate=early(), max_new_tokens=20, do_sample=True, top_k=1,
                         min_p=0.05, repetition_penalty=1.4)
    assert torch.equal(out, ref)


def test_prefix_allowed_tokens_fn_sees_each_rows_batch_id(model):
    ids = torch.tensor([[0, 0, 9, 8, 7], [1, 2, 3, 4, 5]])

    def allowed(batch_id, prefix):
        return list(range(10, 60)) if batch_id == 0 else list(range(100, 200, 3))

    kw = dict(attention_mask=(ids != 0).long(), max_new_tokens=12, pad_token_id=0, prefix_allowed_tokens_fn=allowed)
    ref = model.generate(ids, do_sample=False, **kw)
    assert torch.equal(model.generate(ids, custom_generate=early(), **kw), ref)


class StopAtTokens(StoppingCriteria):
    """A caller's criterion keeping state across calls: once a row has produced one of ``tokens`` it is done; answers
    per row, or (``whole_batch``) for the whole batch at once, as evaluation harnesses' stop sequences do."""

    def __init__(self, prompt_len: int, batch: int, tokens: set[int], whole_batch: bool):
        self.prompt_len, self.done, self.tokens, self.whole_batch = prompt_len, [False] * batch, tokens, whole_batch
        self.calls = 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        for i, row in enumerate(input_ids[:, self.prompt_len:].tolist()):
            self.done[i] = self.done[i] or row[-1] in self.tokens
        return all(self.done) if self.whole_batch else torch.tensor(self.done)


@pytest.mark.parametrize("whole_batch", [True, False], ids=["whole batch", "per row"])
def test_stateful_batch_criteria_see_what_plain_generate_shows_them(model, whole_batch):
    """A left-padded batch: the criterion is called as often, on the same (B, length) tensors, and the rows stop
    (and are padded) where plain generate stops them."""
    ids = torch.tensor([[0, 0, 0, 9, 8, 7], [1, 2, 3, 4, 5, 6], [0, 11, 12, 13, 14, 15]])
    kw = dict(attention_mask=(ids != 0).long(), max_new_tokens=30, pad_token_id=0, eos_token_id=300,
              repetition_penalty=1.0 if whole_batch else 1.1)  # per row: its processor skips each row's padding
    criteria = [StopAtTokens(6, 3, {136, 111, 8}, whole_batch) for _ in range(2)]
    ref = model.generate(ids, do_sample=False, stopping_criteria=StoppingCriteriaList([criteria[0]]), **kw)
    out = model.generate(ids, custom_generate=early(), stopping_criteria=StoppingCriteriaList([criteria[1]]), **kw)
    assert torch.equal(out, ref) and criteria[0].calls == criteria[1].calls and ref.shape[1] < 6 + 30
    assert whole_batch or (ref[:, -1] == 0).any()  # per row: a row that finished first is padded


def test_stop_strings_stop_where_plain_generate_stops(model):
    tok = byte_tokenizer()
    ids = torch.tensor(PROMPT)
    free = model.generate(ids, max_new_tokens=30, do_sample=False)
    stop = tok.decode(free[0, 10:12])  # a string the greedy continuation reaches after 4 tokens
    ref = model.generate(ids, max_new_tokens=30, do_sample=False, stop_strings=[stop], tokenizer=tok)
    out = model.generate(ids, custom_generate=early(stop_strings=[stop], tokenizer=tok),
                         max_new_tokens=30)
    assert torch.equal(out, ref) and ref.shape[1] <= 12
    folder = model.generate(ids, custom_generate=str(FOLDER), trust_remote_code=True, drafter="early_exit",
                            exit_layer=2, max_new_tokens=30, stop_strings=[stop], tokenizer=tok)
    assert torch.equal(folder, ref)
    with pytest.raises(UserError, match="tokenizer"):
        early(stop_strings=["x"])


def consume(streamer) -> tuple[threading.Thread, list[str]]:
    """A consumer thread reading ``streamer`` to its end, as a UI thread does."""
    texts: list[str] = []
    thread = threading.Thread(target=lambda: texts.extend(streamer), daemon=True)
    thread.start()
    return thread, texts


def test_an_iterator_streamer_given_to_generate_ends(model):
    tok = byte_tokenizer()
    ids = torch.tensor(PROMPT)
    streamer = TextIteratorStreamer(tok, timeout=60)
    thread, texts = consume(streamer)
    out = model.generate(ids, custom_generate=early(), max_new_tokens=16, streamer=streamer)
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert "".join(texts) == tok.decode(out[0])  # the prompt once, then every committed token


class Boom(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.shape[1] > 10:
            raise RuntimeError("a criterion failed")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("case", ["refused", "raises", "both ways", "folder refused", "bad option", "batch"])
def test_the_streamer_ends_on_every_error(model, case):
    tok = byte_tokenizer()
    ids = torch.tensor(PROMPT)
    streamer = TextIteratorStreamer(tok, timeout=60)
    thread, _ = consume(streamer)
    other = TextIteratorStreamer(tok, timeout=60)
    other_thread, _ = consume(other)
    with pytest.raises((UserError, RuntimeError)):
        if case == "refused":
            model.generate(ids, custom_generate=early(), max_new_tokens=8, penalty_alpha=0.6, top_k=4,
                           streamer=streamer)
        elif case == "raises":
            model.generate(ids, custom_generate=early(), max_new_tokens=8, streamer=streamer,
                           stopping_criteria=StoppingCriteriaList([Boom()]))
        elif case == "bad option":
            hf_generate("early_exit", no_such_option=1, streamer=streamer)
        elif case == "batch":
            model.generate(torch.tensor(PROMPT * 2), custom_generate=early(streamer=streamer), max_new_tokens=8)
        elif case == "both ways":
            model.generate(ids, custom_generate=early(streamer=other), max_new_tokens=8,
                           streamer=streamer)
        else:
            model.generate(ids, custom_generate=str(FOLDER), trust_remote_code=True, drafter="early_exit",
                           exit_layer=2, max_new_tokens=8, streamer=streamer, cache_implementation="paged")
    if case != "both ways":
        other.end()
    for t in (thread, other_thread):
        t.join(timeout=60)
        assert not t.is_alive()


def test_one_streamer_given_both_ways_gets_the_prompt_once(model):
    class Collect:
        def __init__(self):
            self.puts, self.ends = [], 0

        def put(self, value):
            self.puts.append(value.reshape(-1).tolist())

        def end(self):
            self.ends += 1

    streamer = Collect()
    ids = torch.tensor(PROMPT)
    out = model.generate(ids, custom_generate=early(streamer=streamer), max_new_tokens=10,
                         streamer=streamer)
    assert streamer.puts[0] == PROMPT[0] and streamer.ends == 1
    assert sum(streamer.puts[1:], []) == out[0, len(PROMPT[0]):].tolist()


def test_sampling_with_processors_follows_the_processed_distribution():
    """Speculative sampling against processed scores: the first two tokens (the second drafted and verified) of 600
    rows follow softmax(repetition penalty, then temperature) of the model, chi-square against the exact joint."""
    scipy_stats = pytest.importorskip("scipy.stats")
    model = make_model("llama", seed=5, vocab_size=12)
    prompt = [3, 7, 3, 1]
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5), TemperatureLogitsWarper(0.8)])

    def processed(prefix):
        ids = torch.tensor([prefix])
        return torch.softmax(processors(ids, model(ids).logits[:, -1].float()), -1)[0]  # (V,)

    with torch.no_grad():
        first = processed(prompt)
        joint = torch.stack([first[a] * processed(prompt + [a]) for a in range(12)])  # (V, V)
    torch.manual_seed(0)
    out = model.generate(torch.tensor([prompt]), custom_generate=hf_generate("early_exit", exit_layer=2, num_draft=1),
                         max_new_tokens=3, do_sample=True, temperature=0.8, top_k=0, repetition_penalty=1.5,
                         num_return_sequences=600, eos_token_id=None, pad_token_id=0)
    pairs = out[:, 4] * 12 + out[:, 5]
    observed = torch.bincount(pairs, minlength=144).double()
    expected = joint.reshape(-1).double() * len(pairs)
    keep = expected >= 5  # cells too rare for the test are pooled into one
    obs = torch.cat([observed[keep], observed[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    assert scipy_stats.chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue > 1e-3


def test_token_healing_is_refused_with_the_way_to_heal_first(model):
    """transformers heals the prompt before a custom loop runs and needs the tokenizer for it, which it does not keep
    for one: the folder form refuses in one line naming the workaround, and the workaround decodes."""
    from infer.hf.decoding import FOLDER
    from tiny_models import byte_tokenizer

    tok = byte_tokenizer()
    with pytest.raises(UserError, match="token_healing.*model.heal_tokens") as err:
        model.generate(torch.tensor(PROMPT), custom_generate=str(FOLDER), trust_remote_code=True, max_new_tokens=4,
                       token_healing=True, tokenizer=tok, drafter="early_exit", exit_layer=2)
    assert "\n" not in str(err.value)
    healed = model.heal_tokens(torch.tensor(PROMPT), tok)
    out = model.generate(healed, custom_generate=early(), max_new_tokens=4, do_sample=False)
    assert torch.equal(out, model.generate(healed, max_new_tokens=4, do_sample=False))
