"""core.prompts: every bad prompts file is one line naming the file and the real line."""

from __future__ import annotations

import gzip

import pytest

from layerskip_core.errors import UserError
from layerskip_core.prompts import load_prompts, read_prompts_file


def test_non_utf8_bytes_name_the_line(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n\n{"prompt": "caf\xe9"}\n')
    for read in (read_prompts_file, load_prompts):
        with pytest.raises(UserError, match=r"f\.jsonl:3: not UTF-8"):
            read(path if read is read_prompts_file else str(path))


def test_line_numbers_count_blank_lines(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_text('\n\n{"id": 1}\n')
    with pytest.raises(UserError, match="line 3 has no string 'prompt'"):
        read_prompts_file(path)
    path.write_text('{"prompt": "a"}\n\n\n{oops\n')
    with pytest.raises(UserError, match=r"f\.jsonl:4: not valid JSON"):
        read_prompts_file(path)


def test_directory_and_missing_file_say_so(tmp_path):
    with pytest.raises(UserError, match="is a folder"):
        read_prompts_file(tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        read_prompts_file(tmp_path / "missing.jsonl")
    with pytest.raises(UserError, match="missing.jsonl does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))  # bench --data / search --data
    with pytest.raises(UserError, match="unknown prompt source"):
        load_prompts("humaneva")


def test_broken_gzip_is_one_line(tmp_path):
    path = tmp_path / "f.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"prompt": "a"}\n' * 50)[:30])
    with pytest.raises(UserError, match="gzip"):
        read_prompts_file(path)


def test_utf8_bom_and_crlf_are_accepted(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "caf\xc3\xa9"}\r\n\r\n{"prompt": "b"}\r\n')
    assert [item.prompt for item in read_prompts_file(path)] == ["café", "b"]


def test_skip_leaves_out_the_held_out_end_for_tuning():
    """--skip S: the n prompts before the last S (a tuning span), disjoint from the held-out last S."""
    every = load_prompts("humaneval")
    held_out = load_prompts("humaneval", 4, from_end=True)
    tuning = load_prompts("humaneval", 4, from_end=True, skip_end=4)
    assert held_out == every[-4:] and tuning == every[-8:-4]
    assert not {p.prompt for p in tuning} & {p.prompt for p in held_out}
    with pytest.raises(UserError, match="cannot leave out the last"):
        load_prompts("humaneval", 4, from_end=True, skip_end=len(every))


def test_auto_chat_needs_a_chat_template():
    """--chat auto wraps question-answer tasks (GSM8K) in the model's chat template only where it has one: a base
    model's tokenizer (Gemma 3 270M) gets the question as plain text, not a refusal."""
    from types import SimpleNamespace

    from layerskip_core.prompts import use_chat_template

    base, chat = SimpleNamespace(chat_template=None), SimpleNamespace(chat_template="{{ messages }}")
    assert use_chat_template("gsm8k", "auto", chat) and not use_chat_template("gsm8k", "auto", base)
    assert use_chat_template("gsm8k") and not use_chat_template("humaneval", "auto", chat)
    assert use_chat_template("humaneval", "always", base)  # asked for: refused later, naming the model
