"""Stop strings and EOS with multi-token steps (issue 67, item 2): every drafter's output (tokens and finish reason)
equals plain decoding's, with a stop string of 1 or 20 tokens whose last token shares a verification with an EOS,
for ``Engine``, ``BatchEngine`` and ``layerskip generate --stop``; plain decoding stops where the text first holds a
stop string (a match may begin in the prompt, as transformers' ``stop_strings``), whatever the string's length; the
stop-string search decodes a bounded window per token."""

import dataclasses
import json

import pytest
import torch

from infer import hf_generate
from infer.decode.batch import BatchEngine
from infer.decode.cycle import CycleObserver
from infer.decode.engine import DecodeConfig, Engine
from infer.decode.stopping import MAX_PENDING, PREFIX_TOKENS, SPAN_TOKENS, TextTail
from infer.drafters import ExampleModel, build_drafter, example_cases
from infer.drafters.base import Draft
from infer.drafters.registry import DRAFTERS
from infer.model.runner import Runner
from layerskip_core.errors import UserError
from stub_drafters import ScriptedDrafter
from tiny_models import byte_tokenizer, make_model

L = 6
SEED = 7
PROMPT = "hello"
REF_LEN = 72
"""Tokens of the free-running reference (no stop, no EOS): longer than any test's budget plus a draft."""
TOK = byte_tokenizer()


def decode(ids):
    return TOK.decode(ids, skip_special_tokens=True)


def text_ids() -> list[int]:
    """The tokenizer's ids of single printable ASCII characters (and the newline)."""
    chars = {i: TOK.decode([i]) for i in range(3, 259)}
    return [i for i, c in chars.items() if len(c) == 1 and ord(c) < 128 and (c.isprintable() or c == "\n")]


def text_model(seed: int = SEED):
    """A tiny seeded fp32 Llama whose greedy output is readable text: the LM head rows of every other id are zero, so
    their logits (0) lose to the best of ~96 random ones."""
    model = make_model("llama", seed=seed, vocab_size=259, layers=L)
    keep = torch.zeros(259, dtype=torch.bool)
    keep[text_ids()] = True
    with torch.no_grad():
        model.lm_head.weight[~keep] = 0
    return model


@pytest.fixture(scope="module")
def model():
    return text_model()


@pytest.fixture(scope="module")
def runner(model):
    return Runner.from_model(model)


@pytest.fixture(scope="module")
def prompt():
    return TOK(PROMPT)["input_ids"]


@pytest.fixture(scope="module")
def free(runner, prompt):
    """The free-running greedy continuation (no stop string, no EOS)."""
    engine = Engine(runner, build_drafter("autoregressive", runner), decode=decode)
    return engine.generate(prompt, DecodeConfig(max_new_tokens=REF_LEN, stop_at_eos=False)).tokens


def scenario(free: list[int], length: int) -> tuple[str, int, int]:
    """(stop string, its last token's index s, EOS id): the stop string is the text of the ``length`` tokens ending at
    s, and the EOS id is the token right after it, neither seen before (so plain decoding stops at s + 1 tokens on the
    stop string, and a step that commits tokens s and s + 1 together holds the stop's end and an EOS)."""
    fresh = [j for j, t in enumerate(free) if t not in free[:j]]
    s = next(j for j in fresh if j >= max(length - 1, 1) and j + 1 in fresh and j + 1 < 40)
    return decode(free[s - length + 1:s + 1]), s, free[s + 1]


def stops_by_definition(prompt, free, strings, eos, max_new) -> tuple[list[int], str]:
    """Plain decoding's stop by the documented rule, the slow way: after each token j, in order, EOS, then a stop
    string that ends in the text token j added to decode(prompt + tokens so far), then the budget."""
    for j, token in enumerate(free[:max_new]):
        if token in eos:
            return free[:j + 1], "eos"
        before, text = decode(prompt + free[:j]), decode(prompt + free[:j + 1])
        if any(text.find(s, max(0, len(before) - len(s) + 1)) >= 0 for s in strings) and len(text) > len(before):
            return free[:j + 1], "stop_string"
    return free[:max_new], "length"


class Oracle(ScriptedDrafter):
    """Proposes the target's own next ``k`` tokens (from the free-running reference of each prompt), so every
    verification commits k + 1 tokens; it ignores the budget and EOS (a step may run past both)."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], k: int):
        super().__init__([], None)
        self.references, self.k = references, k

    def propose(self, state):
        ref = self.references[tuple(state.tokens[:state.prompt_len])]
        have = len(state.tokens) - state.prompt_len
        return Draft(torch.tensor(ref[have:have + self.k], dtype=torch.long))


def registry_cases() -> dict[str, tuple[str, dict]]:
    """Every registered drafter's examples (``infer.drafters.registry.example_cases``), and the variants that commit
    the most tokens at once on a random model: early exit at the full depth (its drafts are the target's own tokens)
    as a chain and as a tree; and SWIFT's paper mode."""
    full_depth = {"early_exit_full_depth": {"E": L, "k": 7},
                  "early_exit_full_depth_tree": {"E": L, "k": 5, "tree": True, "max_tree_nodes": 8}}
    return example_cases(ExampleModel(L)) | {case: ("early_exit", o) for case, o in full_depth.items()} | {
        "swift_paper": ("swift", {"paper": "true", "context_window": "8", "confidence": "0.3", "num_draft": "4"})}


CASES = registry_cases()


def test_the_cases_cover_the_registry():
    assert {name for name, _ in CASES.values()} == set(DRAFTERS)


def configs(free, prompt) -> dict[str, tuple[DecodeConfig, tuple[int, ...]]]:
    """The stop settings every drafter is checked under: (config, EOS ids) by name."""
    short, s1, eos1 = scenario(free, 1)
    long, s20, eos20 = scenario(free, 20)
    across = decode(prompt)[-3:] + decode(free[:2])  # begins in the prompt's text, ends in the second token's
    return {
        "stop_1_token_then_eos": (DecodeConfig(max_new_tokens=48, stop_strings=(short,)), (eos1,)),
        "stop_20_tokens_then_eos": (DecodeConfig(max_new_tokens=48, stop_strings=(long,)), (eos20,)),
        "both_stops": (DecodeConfig(max_new_tokens=48, stop_strings=(long, short)), (eos1, eos20)),
        "ignore_eos": (DecodeConfig(max_new_tokens=48, stop_strings=(long,), stop_at_eos=False), (eos20,)),
        "eos_only": (DecodeConfig(max_new_tokens=48), (eos20,)),
        "budget_inside_a_step": (DecodeConfig(max_new_tokens=s20 - 2, stop_strings=(long,)), (eos20,)),
        "begins_in_the_prompt": (DecodeConfig(max_new_tokens=48, stop_strings=(across,)), ()),
    }


def plain(runner, prompt, config, eos):
    result = Engine(runner, build_drafter("autoregressive", runner), eos, decode).generate(prompt, config)
    return result.tokens, result.finish_reason


def test_plain_decoding_stops_where_the_text_first_holds_a_stop_string(runner, prompt, free):
    """The rule, checked against a slow whole-text search; a 20-token stop string is found (the old tail of 17 tokens
    never held it), and the scenarios are what they claim: the stop's last token is followed by an EOS."""
    cases = configs(free, prompt)
    for name, (config, eos) in cases.items():
        got = plain(runner, prompt, config, eos)
        assert got == stops_by_definition(prompt, free, config.stop_strings, eos, config.max_new_tokens), name
    for length in (1, 20):
        stop, s, eos = scenario(free, length)
        assert len(TOK(stop)["input_ids"]) == length
        assert plain(runner, prompt, DecodeConfig(max_new_tokens=48, stop_strings=(stop,)), (eos,)) == \
            (free[:s + 1], "stop_string")
        assert plain(runner, prompt, DecodeConfig(max_new_tokens=48), (eos,)) == (free[:s + 2], "eos")
    assert plain(runner, prompt, *cases["begins_in_the_prompt"]) == (free[:2], "stop_string")


@pytest.mark.parametrize("case", list(CASES))
def test_every_drafter_stops_where_plain_decoding_stops(runner, prompt, free, case):
    name, options = CASES[case]
    multi = 0
    for setting, (config, eos) in configs(free, prompt).items():
        engine = Engine(runner, build_drafter(name, runner, options), eos, decode)
        result = engine.generate(prompt, config)
        assert (result.tokens, result.finish_reason) == plain(runner, prompt, config, eos), (case, setting)
        assert result.text == decode(result.tokens)
        multi = max(multi, result.stats.tokens_per_verify)
    if case.startswith("early_exit_full_depth"):
        assert multi > 3  # many tokens committed per verification


@pytest.mark.parametrize("k", [1, 2, 3, 4, 6, 8, 13, 20, 31])
def test_multi_token_commits_stop_where_plain_decoding_stops(runner, prompt, free, k):
    """Every alignment of the verification steps against the stop's last token and the EOS: k + 1 tokens a step puts
    the EOS as the bonus token for some k, the stop's last token as the bonus for others, both in one step for most,
    and the whole output in one step for k = 31; the budget runs out inside a step."""
    for setting, (config, eos) in configs(free, prompt).items():
        engine = Engine(runner, Oracle({tuple(prompt): free}, k), eos, decode)
        result = engine.generate(prompt, config)
        assert (result.tokens, result.finish_reason) == plain(runner, prompt, config, eos), (k, setting)
        assert result.stats.verify_calls <= -(-(len(result.tokens) - 1) // (k + 1)) + 1  # k + 1 tokens a step


def test_batch_rows_stop_where_plain_decoding_stops(runner, prompt, free):
    prompts = [prompt, TOK("hello")["input_ids"], TOK("The quick brown fox")["input_ids"], prompt[:4]]
    references = {tuple(prompt): free}
    for p in prompts[1:]:
        references[tuple(p)] = Engine(runner, build_drafter("autoregressive", runner)).generate(
            p, DecodeConfig(max_new_tokens=REF_LEN, stop_at_eos=False)).tokens
    makers = {"oracle": lambda: Oracle(references, 6),
              "early_exit_full_depth": lambda: build_drafter("early_exit", runner, {"E": L, "k": 6}),
              "self_sd": lambda: build_drafter("self_sd", runner, CASES["self_sd"][1])}
    for setting, (config, eos) in configs(free, prompt).items():
        for maker, make in makers.items():
            with BatchEngine(runner, make, 3, eos, decode) as batch:
                results = batch.generate(prompts, config)
            for p, result in zip(prompts, results, strict=True):
                assert (result.tokens, result.finish_reason) == plain(runner, p, config, eos), (setting, maker, p[:3])


def test_engine_stops_as_transformers_stop_strings(model, runner, prompt, free):
    """Plain decoding here and transformers' ``generate(stop_strings=...)`` stop at the same token, a match that
    begins in the prompt included."""
    ids = torch.tensor([prompt])
    for setting, (config, eos) in configs(free, prompt).items():
        if not config.stop_strings or not config.stop_at_eos:
            continue
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=config.max_new_tokens, do_sample=False, tokenizer=TOK,
                                 stop_strings=list(config.stop_strings), eos_token_id=list(eos) or None,
                                 pad_token_id=0)[0, len(prompt):].tolist()
        assert plain(runner, prompt, config, eos)[0] == ref, setting


def test_hf_generate_stops_per_committed_token(prompt, free):
    """The transformers entry (``infer.hf.rows``: transformers' own criteria, asked after each committed token) with a
    drafter that commits many tokens a step stops where plain ``generate`` stops."""
    model = text_model()  # fresh: hf_generate points the model's parameters at its runner's
    ids = torch.tensor([prompt])
    for setting, (config, eos) in configs(free, prompt).items():
        if not config.stop_strings or not config.stop_at_eos:
            continue
        common = dict(max_new_tokens=config.max_new_tokens, eos_token_id=list(eos) or None, pad_token_id=0)
        with torch.no_grad():
            ref = model.generate(ids, do_sample=False, tokenizer=TOK, stop_strings=list(config.stop_strings),
                                 **common)
            custom = hf_generate("early_exit", exit_layer=L, num_draft=8, tokenizer=TOK,
                                 stop_strings=list(config.stop_strings))
            out = model.generate(ids, custom_generate=custom, **common)
        assert out.tolist() == ref.tolist(), setting


def test_cli_stop_equals_plain_decoding(capsys, tmp_path, prompt, free):
    """``layerskip generate --stop`` with a drafter committing many tokens a step: its tokens and finish reason are
    plain decoding's, for a 1- and a 20-token stop string followed by the model's EOS."""
    from layerskip_cli.main import main

    for length in (1, 20):
        stop, s, eos = scenario(free, length)
        folder = tmp_path / f"model{length}"
        model = text_model()
        model.generation_config.eos_token_id = [2, eos]  # the model's EOS ids: the token after the stop string too
        model.save_pretrained(folder)
        TOK.save_pretrained(folder)
        rows = {}
        for drafter in (["--drafter", "autoregressive"], ["--drafter", "early_exit", "--exit-layer", str(L),
                                                          "--num-draft", "8"]):
            argv = ["generate", "--model", str(folder), "--prompt", PROMPT, "--stop", stop, "--json",
                    "--max-new-tokens", "48", "--threads", "1", *drafter]
            assert main(argv) == 0
            row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
            rows[drafter[1]] = (row["tokens"], row["finish_reason"])
        assert rows["early_exit"] == rows["autoregressive"] == (free[:s + 1], "stop_string"), length


def test_text_tail_gives_the_whole_texts_characters():
    """Characters split over several byte tokens, a decoder's joins and skipped special tokens: the characters pushed
    add up to the whole decode, and none comes before its last byte."""
    ids = TOK("naïve 日本 — ok")["input_ids"]
    for stream in (ids, [1, *ids[:5], 2, 2, *ids[5:]]):
        tail, out = TextTail(decode, [1]), []
        for t in stream:
            out.append(tail.push(t))
        assert "".join(out) == decode(stream)
        assert "\ufffd" not in "".join(out)


def test_text_tail_with_the_default_models_tokenizer(default_model_path):
    """Byte-level BPE with merges (SmolLM2's): accents, CJK and emoji split over tokens, after a chat prompt; the
    characters pushed are the whole text's, and the prompt's text and the output's join as in one decode."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path)
    whole = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    ids = tok("Héllo wörld! 日本語のテキスト 🙂🚀 — naïve café.\n\n  def f(x):\n\treturn x ** 2\n" * 3)["input_ids"]
    tail = TextTail(whole, prompt)
    out = "".join(tail.push(t) for t in ids)
    assert out == whole(ids) and whole(prompt + ids) == whole(prompt) + out


def test_a_stop_string_of_a_multibyte_character(runner, prompt):
    """A stop string whose character takes three byte tokens stops at its last byte (through a scripted stream)."""
    stream = TOK("ab日cd")["input_ids"]
    config = DecodeConfig(max_new_tokens=len(stream), stop_strings=("日",), stop_at_eos=False)
    engine = Engine(runner, Oracle({tuple(prompt): stream}, 0), decode=decode)
    gen = engine.admit(prompt, config)
    engine.take(gen, stream)
    assert engine.finish(gen).tokens == stream[:5] and gen.finish_reason == "stop_string"


def test_the_search_decodes_a_bounded_window_per_token(runner, prompt):
    """256 new tokens with a stop string that never matches: every decode but the prompt's one reads a bounded window
    (no decode of the whole output per step), about one decode per token."""
    lengths = []

    def counting(ids):
        lengths.append(len(ids))
        return decode(ids)

    engine = Engine(runner, build_drafter("early_exit", runner, {"E": L, "k": 7}), decode=counting)
    result = engine.generate(prompt, DecodeConfig(max_new_tokens=256, stop_strings=("never \x00 here",)))
    assert len(result.tokens) == 256 and result.finish_reason == "length"
    during = lengths[:-1]  # the last decode is the result's text
    assert sum(n > PREFIX_TOKENS + SPAN_TOKENS + MAX_PENDING for n in during) <= 1  # the prompt's text, once
    assert len(during) <= 256 + 256 // SPAN_TOKENS + 3


def test_warm_up_runs_its_full_length_whatever_the_stop_strings(runner, prompt, free):
    """A warm-up sets up the shapes of a whole generation: a stop string that ends the first token does not cut it."""
    cycles = []

    class Count(CycleObserver):
        def advanced(self, rows, outcomes):
            cycles.append(len(rows))

    engine = Engine(runner, build_drafter("autoregressive", runner), decode=decode)
    engine.observers.append(Count())
    engine.warm_up([prompt], DecodeConfig(max_new_tokens=8, stop_strings=(decode(free[:1]),)))
    assert len(cycles) == 3  # the eager executor's one short generation: 4 tokens, the prefill's and 3 steps


def test_an_empty_stop_string_is_refused():
    with pytest.raises(UserError, match="stop string"):
        DecodeConfig(stop_strings=("ok", ""))
    assert dataclasses.replace(DecodeConfig(), stop_strings=("x",)).stop_strings == ("x",)
