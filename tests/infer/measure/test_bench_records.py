"""A bench appends every finished record to records.jsonl as it goes: killed after its first record, that record is
readable and the report is rebuilt from the records alone."""

import json
import os
import signal
import subprocess
import sys
import time

from infer.measure.report import RECORDS_FILE, read_records, rebuild


def test_a_bench_killed_after_its_first_record_leaves_it_readable(tiny_model_dir, prompts_file, tmp_path):
    out = tmp_path / "bench"
    argv = [sys.executable, "-m", "layerskip_cli", "bench", "--model", str(tiny_model_dir), "--drafters",
            "autoregressive,early_exit:E=2:k=2", "--peers", "none", "--data", str(prompts_file), "--n", "2",
            "--max-new-tokens", "8", "--repeats", "1000", "--out", str(out), "--quiet"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=os.environ | {"WANDB_MODE": "disabled"})
    records = out / RECORDS_FILE
    deadline = time.monotonic() + 300
    try:
        while not (records.is_file() and '{"record"' in records.read_text()):  # the header (quality) and a record
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "no record within 300 s"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stderr.close()
    assert not (out / "results.json").exists()  # killed long before the end: nothing but the records
    header, found = read_records(out)
    assert header["command"].startswith("layerskip bench") and header["config"]["repeats"] == 1000
    assert found and found[0].method == "autoregressive" and found[0].stats.new_tokens == 8
    assert found[0].exact is True  # the baseline judged against itself before it was written
    rows = rebuild(out)
    assert {r.method for r in rows} >= {"autoregressive"} and rows[0].new_tokens >= 8
    rebuilt = json.loads((out / "results.json").read_text())
    assert rebuilt["partial"] is True and len(rebuilt["records"]) == len(found)


def test_a_line_cut_mid_write_is_dropped(tmp_path):
    (tmp_path / RECORDS_FILE).write_text('{"command": "c", "config": {}}\n{"record": {"model": "m", "ta')
    header, found = read_records(tmp_path)
    assert header["command"] == "c" and found == []


def test_a_bf16_bench_judges_with_an_fp32_recomputation_built_on_first_need(tiny_model_dir):
    """The bench's bf16 tie bound is gpu_check's: the rounding of the one-row path against an fp32 recomputation of
    the same rounded weights (built only when a mismatch needs it), not the many-row spread it vouches for."""
    import torch

    from infer.measure.exactness import DivergenceJudge, rounded_reference
    from infer.model.runner import Runner

    runner = Runner.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    built = []

    def make():
        built.append(1)
        return rounded_reference(tiny_model_dir, torch.bfloat16, "cpu")

    judge = DivergenceJudge(runner, make_reference=make)
    assert built == []
    assert judge.rounding > 0 and judge.bound_source == "fp32 recomputation" and built == [1]
    assert judge.rounding >= 0 and built == [1]  # measured once
    ref = rounded_reference(tiny_model_dir, torch.bfloat16, "cpu")
    assert ref.dtype == torch.float32 and torch.equal(ref.embed_w, ref.embed_w.bfloat16().float())
