"""Reduced-vocabulary draft heads: counting, top-N, files tied to a model, coverage, resolution, the command."""

import json
from collections import Counter

import pytest

from infer.decode.engine import DecodeConfig
from infer.loading import load_model
from infer.measure.vocab_counting import count_tokens, greedy_generations, heldout_tokens, text_tokens
from layerskip_cli.main import main
from layerskip_core.draft_vocab import (
    BUNDLED_DIR,
    DraftVocab,
    TokenCounts,
    bundled_counts,
    check_model,
    coverage,
    coverage_report,
    model_record,
    resolve_draft_vocab,
    special_ids,
    tokenizer_fingerprint,
)
from layerskip_core.errors import UserError
from layerskip_core.prompts import PromptItem
from tiny_models import byte_tokenizer, save_tiny

ITEMS = [PromptItem("0", "def add(a, b):", "    return a + b", "calib"),
         PromptItem("1", "hello there, hello again", "", "calib"),
         PromptItem("2", "x = [1, 2, 3]", "", "other")]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir))


def counts_of(model, counts: dict, backoff: dict | None = None) -> TokenCounts:
    return TokenCounts(counts, backoff or {}, special_ids(model.tokenizer, model.eos_token_ids),
                       model_record(model.runner.identity(), model.tokenizer), {"mode": "test"})


def one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# --------------------------------------------------------------------------- counting and top-N
def test_text_counts_are_the_tokenizers_tokens(tiny):
    counts = count_tokens(tiny, ITEMS, "text")
    expected = Counter(t for item in ITEMS for t in tiny.tokenizer(
        item.prompt + ("\n" + item.reference if item.reference else ""), add_special_tokens=False)["input_ids"])
    assert counts.counts == dict(expected) and counts.backoff == {}
    assert counts.tokens == sum(expected.values()) == counts.source["text_tokens"]
    assert counts.source["mode"] == "text" and counts.source["items"] == 3
    assert len(text_tokens(ITEMS[1], tiny.tokenizer)) == len(ITEMS[1].prompt)  # one byte token per character
    assert len(text_tokens(ITEMS[0], tiny.tokenizer)) == len(ITEMS[0].prompt + "\n" + ITEMS[0].reference)


def test_generate_counts_are_the_models_own_greedy_output(tiny):
    counts = count_tokens(tiny, ITEMS[:2], "generate", max_new_tokens=10, text_items=ITEMS)
    engine = tiny.engine("autoregressive")
    outputs = [engine.generate(tiny.encode(it.prompt), DecodeConfig(max_new_tokens=10)).tokens for it in ITEMS[:2]]
    assert counts.counts == dict(Counter(t for out in outputs for t in out))  # generated tokens only
    assert counts.backoff == dict(count_tokens(tiny, ITEMS, "text").counts)  # the texts break ties
    assert counts.source["generated_tokens"] == sum(map(len, outputs)) == counts.tokens
    assert greedy_generations(tiny, ITEMS[:2], 10) == outputs


def test_top_n_is_most_frequent_with_deterministic_ties(tiny):
    counts = counts_of(tiny, {50: 9, 40: 5, 41: 5, 60: 5, 70: 1}, {60: 3, 70: 100})
    ranking = counts.ranking()
    assert ranking[:5] == [50, 60, 40, 41, 70]  # count, then back-off count, then the smaller id
    assert sorted(ranking) == list(range(320))
    vocab = counts.top(7)
    assert vocab.ids == (0, 1, 2, 40, 41, 50, 60)  # the specials and the top 4, sorted
    assert counts.top(9).ids == (0, 1, 2, 3, 40, 41, 50, 60, 70)  # then unseen ids, smallest first
    assert vocab.size == 7 and vocab.head_share == pytest.approx(7 / 320)
    assert counts.top(7) == vocab  # deterministic


def test_special_tokens_are_always_in(tiny):
    assert special_ids(tiny.tokenizer, tiny.eos_token_ids) == (0, 1, 2)  # <unk>, <s>, </s>
    counts = counts_of(tiny, {100: 5, 101: 4})
    assert counts.top(4).ids == (0, 1, 2, 100)  # never counted, still kept
    for bad in (3, 0, 321, "8"):
        with pytest.raises(UserError, match="must be an integer in") as e:
            counts.top(bad)
        one_line_error(e)


# --------------------------------------------------------------------------- files tied to a model
def test_save_load_round_trip(tiny, tmp_path):
    counts = count_tokens(tiny, ITEMS, "generate", max_new_tokens=6)
    counts.save(tmp_path / "c.json")
    again = TokenCounts.load(tmp_path / "c.json")
    assert (again.counts, again.backoff, again.special, again.model, again.source) == (
        counts.counts, counts.backoff, counts.special, counts.model, counts.source)
    assert again.ranking() == counts.ranking()
    vocab = DraftVocab(counts.top(20).ids, counts.model, counts.top(20).source, {"calib": {"coverage": 0.5,
                                                                                           "tokens": 4}})
    vocab.save(tmp_path / "sub" / "v.json")
    assert DraftVocab.load(tmp_path / "sub" / "v.json") == vocab
    d = json.loads((tmp_path / "sub" / "v.json").read_text())
    assert d["format"] == "layerskip-draft-vocab/1" and d["size"] == 20 and d["ids"] == list(vocab.ids)
    assert d["model"]["tokenizer"] == tokenizer_fingerprint(tiny.tokenizer)


def test_another_models_file_is_refused(tiny, tmp_path):
    vocab = counts_of(tiny, {100: 1}).top(8)
    check_model(vocab.model, tiny.runner, tiny.tokenizer)  # its own model
    check_model(vocab.model, tiny.runner.identity())  # no tokenizer: the weights must match
    finetuned = tiny.runner.identity() | {"weight_fingerprint": "0123456789abcdef"}
    check_model(vocab.model, finetuned, tiny.tokenizer)  # same architecture and tokenizer, other weights: fits
    with pytest.raises(UserError, match="weight_fingerprint") as e:
        check_model(vocab.model, finetuned, None, "v.json")
    assert "layerskip draft-vocab" in one_line_error(e)
    with pytest.raises(UserError, match="vocab_size: file has 320, model has 300") as e:
        check_model(vocab.model, tiny.runner.identity() | {"vocab_size": 300}, tiny.tokenizer, "v.json")
    one_line_error(e)
    other = byte_tokenizer()
    other.add_tokens(["<extra>"])
    with pytest.raises(UserError, match="tokenizer: file has") as e:
        check_model(vocab.model, tiny.runner, other, "v.json")
    one_line_error(e)
    vocab.save(tmp_path / "v.json")
    with pytest.raises(UserError, match="was made for another model"):
        resolve_draft_vocab(str(tmp_path / "v.json"), tiny.runner.identity() | {"num_layers": 6}, tiny.tokenizer)


VOCAB_DAMAGE = [
    ("not json {", "not JSON"),
    ("[1, 2]", "JSON list, not an object"),
    ('{"format": "layerskip-plan/1"}', "format is 'layerskip-plan/1'"),
    ('{"format": "layerskip-draft-vocab/1", "ids": [1]}', "'model' must be an object"),
    ('{"format": "layerskip-draft-vocab/1", "model": {"vocab_size": 10}, "ids": [1, 10]}', "outside [0, 10)"),
    ('{"format": "layerskip-draft-vocab/1", "model": {"vocab_size": 10}, "ids": [1, 1]}', "repeats ids"),
    ('{"format": "layerskip-draft-vocab/1", "model": {"vocab_size": 10}, "ids": ["a"]}', "integer token ids"),
    ('{"format": "layerskip-draft-vocab/1", "model": {"vocab_size": 10}, "ids": []}', "'ids' is empty"),
]
"""(text, what the one-line error says) of damaged draft-vocabulary files."""
COUNTS_DAMAGE = [
    (b"\xff\xfe garbage", "not JSON"),
    (b'{"format": "layerskip-token-counts/1", "model": {"vocab_size": 10}, "counts": [[1, 2]], "special_ids": []}',
     "[id, count, backoff] rows"),
    (b'{"format": "layerskip-token-counts/1", "model": {"vocab_size": 10}, "counts": [[1, -2, 0]], '
     b'"special_ids": []}', "non-negative"),
    (b'{"format": "layerskip-token-counts/1", "model": {"vocab_size": 10}, "counts": []}', "'special_ids' must be"),
]
"""(bytes, what the one-line error says) of damaged token-counts files."""


@pytest.mark.parametrize("load,kind,data,message",
                         [(DraftVocab.load, "draft vocabulary", t.encode(), m) for t, m in VOCAB_DAMAGE]
                         + [(TokenCounts.load, "token counts", b, m) for b, m in COUNTS_DAMAGE])
def test_damaged_vocabulary_and_counts_files_are_one_line(tmp_path, load, kind, data, message):
    path = tmp_path / "file.json"
    path.write_bytes(data)
    with pytest.raises(UserError, match=f"is not a valid {kind} file") as e:
        load(path)
    assert message in one_line_error(e)


def test_missing_file_names_the_command(tmp_path):
    with pytest.raises(UserError, match="does not exist") as e:
        DraftVocab.load(tmp_path / "none.json")
    assert "layerskip draft-vocab" in one_line_error(e)


# --------------------------------------------------------------------------- coverage
def test_coverage_arithmetic():
    assert coverage([1, 2, 3], [1, 1, 4, 5]) == 0.5
    assert coverage(DraftVocab((7, 3), {"vocab_size": 10}), [3, 3, 3, 9]) == 0.75
    assert coverage(range(10), [9]) == 1.0
    with pytest.raises(ValueError):
        coverage([1], [])
    report = coverage_report([1, 2], {"a": [1, 2, 3, 4], "b": [2, 2], "c": []})
    assert report == {"a": {"coverage": 0.5, "tokens": 4}, "b": {"coverage": 1.0, "tokens": 2},
                      "all": {"coverage": 0.6667, "tokens": 6}}
    assert coverage_report([1], {"a": [1, 5]}) == {"a": {"coverage": 0.5, "tokens": 2}}  # one task: no 'all'


def test_heldout_tokens_are_generations_grouped_by_task(tiny):
    tokens = heldout_tokens(tiny, ITEMS, max_new_tokens=5)
    outputs = greedy_generations(tiny, ITEMS, 5)
    assert tokens == {"calib": outputs[0] + outputs[1], "other": outputs[2]}


# --------------------------------------------------------------------------- resolving --draft-vocab
def test_resolve_size_from_bundled_counts_and_path(tiny, tmp_path):
    counts = counts_of(tiny, {100: 5, 200: 4, 150: 4})
    with pytest.raises(UserError, match="no token counts ship") as e:
        resolve_draft_vocab(8, tiny.runner, tiny.tokenizer, directory=tmp_path)
    assert "layerskip draft-vocab" in one_line_error(e)
    counts.save(tmp_path / "tiny.json")
    for spec in (5, "5", " 5 "):
        assert resolve_draft_vocab(spec, tiny.runner, tiny.tokenizer, directory=tmp_path).ids == (0, 1, 2, 100, 150)
    assert resolve_draft_vocab(5, tiny.runner.identity(), directory=tmp_path).size == 5
    with pytest.raises(UserError, match="no token counts ship"):
        resolve_draft_vocab(5, tiny.runner.identity() | {"hidden_size": 32}, tiny.tokenizer, directory=tmp_path)
    counts.top(6).save(tmp_path / "v6.json")
    assert resolve_draft_vocab(str(tmp_path / "v6.json"), tiny.runner, tiny.tokenizer).size == 6
    with pytest.raises(UserError, match="is empty"):
        resolve_draft_vocab("  ", tiny.runner, tiny.tokenizer)


def test_bundled_counts_file_is_valid():
    files = sorted(BUNDLED_DIR.glob("*.json"))
    assert [f.name for f in files] == ["smollm2-135m-instruct.json"]
    counts = TokenCounts.load(files[0])
    assert counts.model["vocab_size"] == 49152 and counts.model["num_layers"] == 30
    # counted on the model's own answers of the exit adapter's nine training kinds (train.self_distill's files)
    assert counts.source["mode"] == "text" and counts.tokens > 400_000
    assert all(path.startswith("runs/self-distill") for path in counts.source["data"])
    assert {0, 1, 2} <= set(counts.special)
    assert counts.top(8192).size == 8192


@pytest.mark.real_model
def test_bundled_counts_fit_the_default_model(default_model_path):
    model = load_model(str(default_model_path))
    vocab = resolve_draft_vocab(8192, model.runner, model.tokenizer)
    assert vocab.size == 8192 and set(model.eos_token_ids) | {0, 1, 2} <= set(vocab.ids)
    assert resolve_draft_vocab("1024", model.runner).ids == bundled_counts(model.runner).top(1024).ids
    text = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    assert coverage(vocab, model.encode(text)) > 0.9  # common code tokens are in
    prose = "Choosing the right laptop for university is crucial for your academic journey: here is a short guide."
    assert coverage(vocab, model.encode(prose)) > 0.9  # and common English words (counts from code alone missed 5)


# --------------------------------------------------------------------------- tensors
# --------------------------------------------------------------------------- the command
@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "calib.jsonl"
    prompts = ["def add(a, b):", "hello there", "x = 1", "for i in range(3):", "print('hi')", "import os"]
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def test_command_writes_a_vocabulary_tied_to_the_model(capsys, tiny, tiny_model_dir, prompts_file, tmp_path):
    out, counts_out = tmp_path / "v.json", tmp_path / "counts" / "c.json"
    code = main(["draft-vocab", "--model", str(tiny_model_dir), "--data", str(prompts_file), "--size", "40",
                 "--n", "3", "--heldout", "2", "--max-new-tokens", "8", "--report-sizes", "10,300",
                 "--out", str(out), "--counts-out", str(counts_out), "--quiet"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out.strip() == str(out)
    assert "draft vocabulary: 40 of 320 ids (12.5% of the LM head)" in captured.err
    assert "N=10 " in captured.err and "N=40 " in captured.err and "N=300 " in captured.err
    vocab = resolve_draft_vocab(str(out), tiny.runner, tiny.tokenizer)
    counts = TokenCounts.load(counts_out)
    assert vocab.size == 40 and vocab.ids == counts.top(40).ids and {0, 1, 2} <= set(vocab.ids)
    held = [PromptItem(str(i), p, "", "calib") for i, p in enumerate(["print('hi')", "import os"])]
    calib = [PromptItem(str(i), p, "", "calib") for i, p in enumerate(["def add(a, b):", "hello there", "x = 1"])]
    assert counts.counts == count_tokens(tiny, calib, max_new_tokens=8).counts  # the front, generated
    assert vocab.coverage == coverage_report(vocab, heldout_tokens(tiny, held, 8))  # the end, generated
    assert vocab.source["heldout"] == 2 and vocab.source["data"] == [str(prompts_file)]


def test_command_text_mode_on_the_stdlib(capsys, tiny_model_dir, tmp_path):
    out = tmp_path / "v.json"
    code = main(["draft-vocab", "--model", str(tiny_model_dir), "--data", "stdlib", "--mode", "text", "--size", "100",
                 "--n", "3", "--heldout", "0", "--out", str(out), "--quiet"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    vocab = DraftVocab.load(out)
    assert vocab.source["mode"] == "text" and vocab.source["items"] == 3 and vocab.coverage == {}
    assert "held-out coverage" not in captured.err


def test_command_text_mode_on_files_of_texts(capsys, tiny, tiny_model_dir, tmp_path):
    """A .jsonl of texts ('text' fields, as train.self_distill writes) is counted whole (any --n), none held out."""
    texts = ["def add(a, b):\n    return a + b", "hello there, hello again", "x = 1"]
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps({"id": f"t{i}", "kind": "chat", "text": t}) + "\n" for i, t in enumerate(texts)))
    out, counts_out = tmp_path / "v.json", tmp_path / "c.json"
    code = main(["draft-vocab", "--model", str(tiny_model_dir), "--data", str(path), "--mode", "text", "--size", "30",
                 "--n", "1", "--out", str(out), "--counts-out", str(counts_out), "--quiet"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    counts = TokenCounts.load(counts_out)
    items = [PromptItem(f"t{i}", t, "", "answers") for i, t in enumerate(texts)]
    assert counts.counts == count_tokens(tiny, items, "text").counts and counts.source["items"] == 3
    assert "held-out coverage" not in captured.err  # texts are never prompts: none held out (the default is 8)


def test_command_measures_coverage_on_sets_it_never_counts(capsys, tiny, tiny_model_dir, prompts_file, tmp_path):
    path = tmp_path / "answers.jsonl"
    path.write_text(json.dumps({"text": "hello there, hello again"}) + "\n")
    out, counts_out = tmp_path / "v.json", tmp_path / "c.json"
    code = main(["draft-vocab", "--model", str(tiny_model_dir), "--data", str(path), "--mode", "text", "--size", "30",
                 "--heldout-data", str(prompts_file), "--heldout", "2", "--max-new-tokens", "8", "--out", str(out),
                 "--counts-out", str(counts_out), "--quiet"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert TokenCounts.load(counts_out).counts == count_tokens(tiny, [PromptItem("1", "hello there, hello again", "",
                                                                                 "answers")], "text").counts
    held = [PromptItem(str(i), p, "", "calib") for i, p in enumerate(["print('hi')", "import os"])]
    vocab = DraftVocab.load(out)
    assert vocab.coverage == coverage_report(vocab, heldout_tokens(tiny, held, 8)) and vocab.source["heldout"] == 2
    assert f"and of {prompts_file}" in captured.err


@pytest.mark.parametrize("line,mode,message", [
    ({"text": "some words"}, "generate", "holds texts ('text' fields), not prompts: count them with --mode text"),
    ({"text": ""}, "text", ":2: expected a non-empty string 'text' field"),
])
def test_command_refuses_texts_it_cannot_count(capsys, tiny_model_dir, tmp_path, line, mode, message):
    path = tmp_path / "answers.jsonl"
    path.write_text(json.dumps({"text": "first"}) + "\n" + json.dumps(line) + "\n")
    code = main(["draft-vocab", "--model", str(tiny_model_dir), "--data", str(path), "--mode", mode, "--size", "30",
                 "--heldout", "0", "--out", str(tmp_path / "v.json"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "v.json").exists()


@pytest.mark.parametrize("args,message", [
    (["--out", "v.txt"], "should be a .json file"),
    (["--counts-out", "c.yaml"], "should be a .json file"),
    (["--mode", "text", "--text-n", "4"], "--text-n applies to --mode generate only"),
    (["--n", "0"], "--size, --n and --max-new-tokens must be >= 1"),
    (["--size", "0"], "--size, --n and --max-new-tokens must be >= 1"),
    (["--heldout", "6"], "all taken by --heldout 6"),
    (["--report-sizes", "8,x"], "give comma-separated sizes"),
    (["--size", "321"], "size 321 is out of range: /"),
    (["--size", "3"], "3 of them special tokens that every subset keeps; give 4..320"),
    (["--report-sizes", "100,2"], "size 2 is out of range"),
    (["--data", " , "], "--data is empty"),
    (["--data", "/no/such/set"], "unknown prompt source"),
    (["--heldout-data", "humaneval", "--heldout", "0"], "give --heldout 1 or more"),
    (["--max-new-tokens", "510"], "leave no room for 510 new tokens"),
    (["--model", "/definitely/not/here"], "does not exist"),
])
def test_command_bad_input_is_one_clear_line(capsys, tiny_model_dir, prompts_file, tmp_path, args, message):
    argv = ["draft-vocab", "--model", str(tiny_model_dir), "--data", str(prompts_file), "--size", "20",
            "--n", "2", "--heldout", "1", "--max-new-tokens", "4", "--out", str(tmp_path / "v.json"), "--quiet"]
    for i in range(0, len(args), 2):  # later flags override earlier ones
        argv += args[i:i + 2]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "v.json").exists()


def test_command_module_keeps_torch_out_until_run():
    import subprocess
    import sys

    code = ("import argparse, sys\nfrom layerskip_cli.commands import draft_vocab\n"
            "draft_vocab.register(argparse.ArgumentParser().add_subparsers())\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_saved_tiny_model_with_other_vocab_is_refused(tmp_path, tiny):
    other = load_model(str(save_tiny(tmp_path / "m", vocab_size=300)))
    vocab = counts_of(tiny, {5: 1}).top(10)
    with pytest.raises(UserError, match="vocab_size: file has 320, model has 300"):
        check_model(vocab.model, other.runner, other.tokenizer)
