"""Issue 67 items 13 and 16: bad input and lost work (two searches into one --out, damaged journals, duplicate
prompt ids, a damaged bench log)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tiny_models import save_tiny

REPO = Path(__file__).resolve().parents[2]
CLI = "import sys; from layerskip_cli.main import main; sys.exit(main(sys.argv[1:]))"


def _search_argv(model: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-c", CLI, "search", "--model", str(model), "--data", str(prompts), "--out", str(out),
            "--n", "2", "--max-new-tokens", "8", "--cost", "weights", "--quiet", "--threads", "1", *extra]


def _wait_for(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.1)
    return predicate()


def test_a_second_search_into_the_same_out_is_refused_while_the_first_runs(tmp_path):
    """Two searches with --force into one --out both ran to exit 0, the second deleting the first's journal mid-run
    and mixing its trials into it; now the second is refused in one line naming the first, and the journal is left
    to the first."""
    model = save_tiny(tmp_path / "model", layers=12)  # 2^24 plans: the first search is still running when asked
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "import os"}\n')
    out, study = tmp_path / "plans" / "p.json", tmp_path / "plans" / "p.study.log"
    first = subprocess.Popen(_search_argv(model, prompts, out, "--trials", "100000", "--timeout", "600", "--force"),
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait_for(lambda: out.is_file() or first.poll() is not None, 400), "the first search wrote no plan"
        assert first.poll() is None, first.communicate()[1]
        head = study.read_bytes()[:200]
        second = subprocess.run(_search_argv(model, prompts, out, "--trials", "5", "--force"), cwd=REPO,
                                capture_output=True, text=True, timeout=400)
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "in use by another search" in lines[0] and f"pid {first.pid}" in lines[0], lines
        assert first.poll() is None and study.read_bytes()[:200] == head  # the first's journal was not deleted
        again = subprocess.run(_search_argv(model, prompts, tmp_path / "q.json", "--trials", "5", "--study",
                                            str(study), "--force"), cwd=REPO, capture_output=True, text=True,
                               timeout=400)
        assert again.returncode == 2 and "in use by another search" in again.stderr, again.stderr  # its journal too
    finally:
        os.kill(first.pid, signal.SIGINT)
        try:
            first.communicate(timeout=300)  # a trial under way finishes first: on a loaded 2-core CI box, a minute+
        except subprocess.TimeoutExpired:
            first.kill()
            first.communicate()
            raise
    assert not list(out.parent.glob(".*.lock"))  # released by the interrupted search


def test_a_journal_line_optuna_cannot_replay_is_refused_naming_the_line(capsys, tiny_model_dir, tmp_path):
    """A valid-JSON line that is no journal operation ended in optuna's AssertionError traceback on --resume."""
    from layerskip_cli.main import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "import os"}\n')
    out, study = tmp_path / "p.json", tmp_path / "p.study.log"
    argv = ["search", "--model", str(tiny_model_dir), "--data", str(prompts), "--trials", "2", "--out", str(out),
            "--cost", "weights", "--n", "2", "--max-new-tokens", "8", "--quiet"]
    assert main(argv) == 0, capsys.readouterr().err
    good = study.read_text()
    count = len(good.splitlines())
    for line in ('{"op_code": 99, "worker_id": "w"}', '{"foo": 1}', "[1, 2]",
                 '{"op_code": 8, "worker_id": "w", "trial_id": 0, "user_attr": {}}'):
        study.write_text(good + line + "\n")
        capsys.readouterr()
        assert main([*argv, "--resume"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(study) in err[0] and f"line {count + 1} " in err[0] and "--force" in err[0], err


def _exit_code(main, argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's refusals exit at once
        return e.code


def _no_gpu() -> bool:
    import torch

    return not torch.cuda.is_available()


SCRIPT_FLAGS = [("bench_matmul_routes", ["--threads", "100000"], "--threads must be an integer in [1, "),
                ("bench_matmul_routes", ["--threads", "-1"], "--threads must be an integer in [1, "),
                ("adapter_kinds", ["--group", "validation", "--out", "{tmp}/k", "--threads", "100000"],
                 "--threads must be an integer in [1, "),
                ("bench_train_step", ["--threads", "1,100000"], "must be an integer in [1, "),
                ("bench_train_step", ["--threads", "1,x"], "expected comma-separated integers"),
                ("train_bench", ["--device", "tpu"], "unknown device 'tpu'"),
                *([("train_bench", ["--device", "cuda"], "CUDA is not available")] if _no_gpu() else [])]


def test_the_scripts_check_threads_and_devices_as_every_command_does(capsys, tmp_path):
    """Issue 67 item 12's neighbours: scripts with their own --threads / --device passed 100000 threads to torch
    (a crash in libgomp) or a device name to torch.device (a traceback); each is one line and exit code 2 now."""
    from script_modules import load_script

    for name, argv, says in SCRIPT_FLAGS:
        module = load_script(name)
        code = _exit_code(module.main, [a.format(tmp=tmp_path) for a in argv])
        err = capsys.readouterr().err
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, (name, argv, err)
    assert not (tmp_path / "k").exists()


def test_duplicate_prompt_ids_are_refused_naming_the_file_the_id_and_both_lines(capsys, tiny_model_dir, tmp_path):
    """Two prompts with one id (an explicit ``"id": 0`` beside the implicit "0" of an id-less first line, or ``0``
    beside ``"0"``) were accepted, and their results shared one name."""
    import pytest

    from layerskip_cli.main import main
    from layerskip_core.errors import UserError
    from layerskip_core.prompts import load_prompts

    path = tmp_path / "p.jsonl"
    cases = {'{"prompt": "a"}\n\n{"prompt": "b", "id": 0}\n': ("'0'", "line 1 (no 'id'", "line 3"),
             '{"prompt": "a", "id": "x"}\n{"prompt": "b", "id": "y"}\n{"prompt": "c", "id": "x"}\n':
                 ("'x'", "line 1 and line 3", ""),
             '{"prompt": "a", "id": 7}\n{"prompt": "b", "id": "7"}\n': ("'7'", "line 1 and line 2", "")}
    for text, says in cases.items():
        path.write_text(text)
        with pytest.raises(UserError) as e:
            load_prompts(str(path))
        assert str(path) in str(e.value) and all(s in str(e.value) for s in says), str(e.value)
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"prompt": "a"}\n{"prompt": "b", "id": "one"}\n{"prompt": "c"}\n')
    assert [it.id for it in load_prompts(str(ok))] == ["0", "one", "2"]
    code = main(["generate", "--model", str(tiny_model_dir), "--prompts-file", str(path), "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "prompt id '7'" in err[0], err


def _records(tmp_path: Path, *lines: str) -> Path:
    from infer.measure.report import RECORDS_FILE

    (tmp_path / RECORDS_FILE).write_text("".join(line + "\n" for line in lines[:-1]) + lines[-1])
    return tmp_path / RECORDS_FILE


def test_a_damaged_bench_record_that_is_not_the_last_is_refused_naming_the_line(tmp_path, capsys):
    """``report.rebuild``, the recovery of a killed bench, raised JSONDecodeError on a damaged line that was not the
    last; only the last line can be cut by a kill (dropped with a note), any other is refused naming file and line."""
    import pytest

    from infer.measure.report import read_records, rebuild
    from layerskip_core.errors import UserError

    header = '{"command": "layerskip bench", "config": {}}'
    for damaged in ('{"record": {"model": "m", "ta', "[1]", '{"record": {"model": "m"}}', '{"quality": 3}', ""):
        path = _records(tmp_path, header, damaged, '{"quality": {"m": {}}}', "")
        for read in (read_records, rebuild):
            with pytest.raises(UserError) as e:
                read(tmp_path)
            assert f"{path}: line 2 is damaged" in str(e.value), str(e.value)
    path = _records(tmp_path, header, '{"quality": {"m": {}}}', '{"record": {"model": "m", "ta')
    found_header, records = read_records(tmp_path)
    assert found_header["command"] == "layerskip bench" and records == []
    assert f"{path}: last line 3 cut short" in capsys.readouterr().err
    with pytest.raises(UserError, match="bench records file"):
        read_records(tmp_path / "missing")


def test_every_adapter_error_names_the_adapter_file(tmp_path):
    """An adapter whose provenance records a damaged draft vocabulary size was refused by the vocabulary code without
    naming the adapter file (or, for -3, as a missing vocabulary file '-3'); so were wrong tensors and exit layers
    given to ``ExitAdapter`` itself."""
    import json

    import pytest
    from safetensors import safe_open
    from safetensors.torch import save_file

    from infer.assets.adapter import ExitAdapter
    from infer.drafters import build_drafter
    from infer.model.runner import Runner
    from layerskip_core.adapter_spec import read_file, read_metadata
    from layerskip_core.errors import UserError
    from tiny_models import make_model, noisy_adapter

    model = make_model("llama", seed=0, layers=4)
    noisy_adapter(model, tmp_path / "a.safetensors", 2)
    runner = Runner.from_model(model)
    with safe_open(str(tmp_path / "a.safetensors"), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    for size in (0, -3, 10**9, runner.spec.vocab_size + 1, "8192", True, 8.5):
        path = tmp_path / "damaged.safetensors"
        provenance = json.loads(meta["provenance"]) | {"draft_vocab": {"option": "auto", "size": size}}
        save_file(tensors, str(path), metadata=meta | {"provenance": json.dumps(provenance)})
        with pytest.raises(UserError) as e:
            build_drafter("early_exit", runner, {"adapter": str(path)})
        assert str(e.value).startswith(f"{path}: ") and "draft vocabulary" in str(e.value), str(e.value)
    shape, provenance = read_metadata(*read_file(tmp_path / "a.safetensors")[:1], runner.identity(), "a")
    with pytest.raises(UserError, match=r"^x\.safetensors: adapter tensor 'q_proj\.weight' should have shape"):
        ExitAdapter(runner, shape, {k: v for k, v in tensors.items() if k != "q_proj.weight"}, provenance,
                    "x.safetensors")
    deep = Runner.from_model(make_model("llama", seed=0, layers=2))
    with pytest.raises(UserError, match=r"^x\.safetensors: "):
        ExitAdapter(deep, shape, tensors, provenance, "x.safetensors")
