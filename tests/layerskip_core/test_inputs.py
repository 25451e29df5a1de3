"""Every file a command reads is a regular file of sane size: a FIFO, a device, a socket, a folder or a huge file
is refused in one line naming it, never opened for a read that blocks or never ends (issue 37)."""

from __future__ import annotations

import os
import socket

import pytest

from deadline import deadline
from infer.model.plan import PlanFile
from layerskip_core import inputs
from layerskip_core.adapter_spec import read_file
from layerskip_core.draft_vocab import DraftVocab
from layerskip_core.errors import UserError
from layerskip_core.prompts import load_prompts
from train.recipe import load_config

READERS = {
    "plan file": PlanFile.load,
    "draft vocabulary file": DraftVocab.load,
    "prompts file": lambda p: load_prompts(str(p)),
    "config file": load_config,
    "adapter file": read_file,
}


def fifo(path):
    os.mkfifo(path)
    return path


def unix_socket(path):
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    return path


def huge(path):
    with open(path, "wb") as f:
        f.truncate(inputs.MAX_BYTES + 1)  # sparse: no disk used
    return path


def to_dev_zero(path):
    os.symlink("/dev/zero", path)
    return path


KINDS = {"fifo": (fifo, "named pipe"), "socket": (unix_socket, "socket"), "device": (to_dev_zero, "character device"),
         "huge": (huge, "larger than")}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("reader", list(READERS))
def test_a_path_that_is_not_a_regular_file_is_refused_in_one_line(tmp_path, reader, kind):
    make, message = KINDS[kind]
    if (reader, kind) == ("adapter file", "huge"):  # no size bound (safetensors maps it), but it holds no header
        message = "not a readable safetensors file"
    path = make(tmp_path / "input.jsonl")
    with deadline(20), pytest.raises(UserError, match=message) as e:
        READERS[reader](path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("reader", list(READERS))
def test_a_folder_or_a_missing_path_is_refused_in_one_line(tmp_path, reader):
    with deadline(20):
        for path, message in [(tmp_path, "folder|directory"), (tmp_path / "missing.jsonl", "does not exist")]:
            with pytest.raises(UserError, match=message) as e:
                READERS[reader](path)
            assert "\n" not in str(e.value)


def test_a_text_folder_of_prompts_reads_only_what_it_keeps(tmp_path):
    """A prompt folder reads each text file's head, not a whole huge file, and skips what is not a regular file."""
    huge(tmp_path / "a.txt")
    with open(tmp_path / "a.txt", "r+b") as f:
        f.write(b"def f():\n")
    fifo(tmp_path / "b.txt")
    to_dev_zero(tmp_path / "c.txt")
    with deadline(20):
        items = load_prompts(str(tmp_path), max_chars=100)
    assert [i.id for i in items] == ["a.txt"] and items[0].prompt.startswith("def f():")


def test_a_regular_file_reads_whole(tmp_path):
    path = tmp_path / "f.txt"
    path.write_text("héllo\n")
    assert inputs.read_text(path, "test file") == "héllo\n"
    path.write_bytes(b"caf\xe9\n")
    with pytest.raises(UserError, match=r"not UTF-8 text \(byte b'\\xe9' on line 1\)"):
        inputs.read_text(path, "test file")


@pytest.mark.parametrize("argv", [["generate", "--prompts-file", "{p}"], ["plan", "show", "{p}"],
                                  ["generate", "--prompt", "x", "--drafter", "self_sd", "--plan", "{p}"]])
def test_commands_refuse_a_fifo_input_in_one_line(tmp_path, capsys, argv):
    from layerskip_cli.main import main

    path = fifo(tmp_path / "input.json")
    with deadline(60):
        code = main([a.format(p=path) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and "named pipe (FIFO)" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
