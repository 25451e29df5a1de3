"""Remembered state under concurrency: two processes saving the same plan file and gate memory at once both finish
and leave a whole file; a reader meanwhile never sees a part of one (issue 37). And ``save_plan`` that cannot be
written is refused before decoding, leaving nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infer.drafters.gate import FallbackGate, GateMemory
from infer.model.plan import LayerPlan, PlanFile
from layerskip_core.errors import UserError

MODEL = {"model_type": "llama", "num_layers": 8, "hidden_size": 8, "vocab_size": 4000, "weight_fingerprint": "x"}
WRITER = """
import sys
from pathlib import Path
from infer.drafters.gate import FallbackGate, GateMemory
from infer.model.plan import LayerPlan, PlanFile
plan_path, memory_path, who, model = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), eval(sys.argv[4])
for i in range(400):
    PlanFile(LayerPlan(8, frozenset({1 + who}), frozenset({i % 6 + 1})), model, task=f"writer {who} save {i}",
             draft_head={"vocab": 2000, "ids": list(range(who, 4000, 2))}).save(plan_path)
    if i % 4 == 0:
        GateMemory(memory_path).save({"gate": FallbackGate(4).to_dict(), "plan": {"attn": [who], "mlp": [i % 6]},
                                      "score": 0.5, "padding": [who] * 3000})
print("done", flush=True)
"""


def test_two_writers_and_a_reader_of_the_same_plan_and_gate_memory(tmp_path, capsys):
    plan_path, memory_path = tmp_path / "plan.json", tmp_path / "gate" / "memory.json"
    memory_path.parent.mkdir()
    PlanFile(LayerPlan(8, frozenset({1})), MODEL).save(plan_path)
    GateMemory(memory_path).save({"gate": FallbackGate(4).to_dict()})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(plan_path), str(memory_path), str(who), repr(MODEL)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for who in (0, 1)]
    reads, deadline = 0, time.monotonic() + 300
    try:
        while any(w.poll() is None for w in writers) and time.monotonic() < deadline:
            assert PlanFile.load(plan_path).plan.num_layers == 8  # whole: a part would not parse
            assert GateMemory(memory_path).load() is not None  # (a damaged file: a warning and None)
            reads += 1
        outcomes = [w.communicate(timeout=60) for w in writers]
    finally:
        for w in writers:
            w.kill()
    assert [w.returncode for w in writers] == [0, 0], outcomes
    assert all(out.strip() == "done" and "Traceback" not in err for out, err in outcomes), outcomes
    assert reads > 0 and "warning" not in capsys.readouterr().err
    assert PlanFile.load(plan_path).task.endswith("save 399") and GateMemory(memory_path).load() is not None
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["memory.json", "plan.json"]  # no temps


@pytest.mark.parametrize("where", ["folder", "under a file"])
def test_save_plan_that_cannot_be_written_is_refused_before_decoding(tmp_path, where):
    from infer.drafters import build_config

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    target = tmp_path if where == "folder" else blocker / "plan.json"
    with pytest.raises(UserError, match="save-plan") as e:
        build_config("swift", {"save_plan": str(target)})
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_failed_save_leaves_no_temporary_file(tmp_path):
    (tmp_path / "plan.json").mkdir()
    with pytest.raises(OSError):
        PlanFile(LayerPlan(8, frozenset({1})), MODEL).save(tmp_path / "plan.json")
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
    assert Path(tmp_path / "plan.json").is_dir()


@pytest.mark.parametrize("plan", [{"attn": [999], "mlp": []}, {"attn": [1], "mlp": [8]}, {"attn": [-1], "mlp": []}])
def test_remembered_plan_layers_past_the_model_are_not_trusted(tmp_path, capsys, plan):
    path = tmp_path / "memory.json"
    GateMemory(path).save({"gate": FallbackGate(4).to_dict(), "plan": plan, "score": 0.5})
    memory = GateMemory(path, num_layers=8)
    assert memory.load() is None and not memory.loaded  # starts afresh
    err = capsys.readouterr().err
    assert f"{path} is not a valid gate memory: plan." in err and "starting afresh" in err
    GateMemory(path).save({"gate": FallbackGate(4).to_dict(), "plan": {"attn": [7], "mlp": [0]}, "score": 0.5})
    assert memory.load() is not None and memory.loaded
