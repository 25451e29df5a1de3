"""Issue 49 item 3 and 7: one lock rule for output folders (a second run into a folder in use is refused, naming the
holder), result files written whole, and a lock's holder always named (never "pid 0 on unknown host")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from layerskip_cli.main import main
from layerskip_core.cli import OUTPUT_LOCK, holding_output_dir
from layerskip_core.errors import UserError
from layerskip_core.locks import FileLock, Holder

REPO = Path(__file__).resolve().parents[2]


def test_an_unreadable_stamp_is_not_called_pid_0():
    text = Holder(0, "unknown host", "unknown time").describe()
    assert "pid 0" not in text and "unknown host" not in text and "could not be read" in text


def test_a_holder_that_has_not_written_its_stamp_yet_is_named(tmp_path):
    """The race of two runs started together: the second finds the lock taken and the stamp not yet written."""
    lock = tmp_path / "x.lock"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, json, os, sys, time
        fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("locked", flush=True)
        time.sleep(0.3)
        os.pwrite(fd, json.dumps({{"pid": os.getpid(), "host": "h", "started": "t"}}).encode(), 0)
        time.sleep(30)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        found = FileLock(lock).acquire()
        assert found is not None and found.pid == holder.pid
    finally:
        holder.kill()
        holder.wait()


def test_a_folder_in_use_is_refused_naming_its_holder(tmp_path):
    out = tmp_path / "new" / "out"
    with holding_output_dir(out, "--out"):
        assert (out / OUTPUT_LOCK).exists()
        with pytest.raises(UserError, match=f"--out {out} is in use by another run \\(pid {os.getpid()} on ") as e:
            with holding_output_dir(out, "--out"):
                pass
        assert "\n" not in str(e.value)
    assert not out.exists()  # made for a run that wrote nothing: not left behind
    out.mkdir(parents=True)
    (out / "mine.txt").write_text("x")
    with holding_output_dir(out, "--out"):
        pass
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]  # the lock file goes, the folder stays


def test_a_second_bench_into_a_folder_in_use_is_refused_before_loading(capsys, tmp_path):
    out = tmp_path / "out"
    with holding_output_dir(out, "--out"):
        code = main(["bench", "--model", "default", "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "is in use by another run" in err and len(err.strip().splitlines()) == 1, err
    assert not (out / "records.jsonl").exists()


def test_a_comparison_into_a_folder_in_use_is_refused(tmp_path):
    out = tmp_path / "compare"
    out.mkdir()
    lock = FileLock(out / OUTPUT_LOCK)
    assert lock.acquire() is None
    try:
        proc = subprocess.run(["bash", str(REPO / "tools/results/compare_trained_vs_free.sh")], capture_output=True,
                              text=True, timeout=60, env=os.environ | {"OUT": str(out), "BIN": "/nonexistent"})
    finally:
        lock.release()
    assert proc.returncode == 2 and "is in use by another comparison" in proc.stderr
    assert not (out / "commands.txt").exists()


def test_bench_results_are_written_whole_and_results_json_last(monkeypatch, tmp_path, tiny_model_dir):
    from layerskip_core import jsonfile

    written = []
    real = jsonfile.write
    monkeypatch.setattr(jsonfile, "write", lambda path, text: (written.append(Path(path).name), real(path, text)))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f():"}) + "\n")
    code = main(["bench", "--model", str(tiny_model_dir), "--drafters", "autoregressive", "--peers", "none",
                 "--data", str(prompts), "--n", "1", "--max-new-tokens", "4", "--repeats", "1",
                 "--quality-data", "none", "--out", str(tmp_path / "out"), "--quiet"])
    assert code == 0
    results = [n for n in written if n.startswith("results.")]
    assert sorted(results) == ["results.csv", "results.json", "results.md"] and results[-1] == "results.json"
    assert not list((tmp_path / "out").glob(".*.tmp")) and not (tmp_path / "out" / OUTPUT_LOCK).exists()
