"""Issue 49 items 8-11: what the output tells a newcomer (a saved plan says what it is, acceptance comes with its
counts, refusals come fast)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from layerskip_cli.main import main

REPO = Path(__file__).resolve().parents[2]


def test_swift_save_plan_says_what_it_saved_even_untried(capsys, tiny_model_dir, tmp_path):
    plan = tmp_path / "plan.json"
    code = main(["generate", "--model", str(tiny_model_dir), "--prompt", "def f():", "--drafter", "swift",
                 "--max-new-tokens", "4", "--save-plan", str(plan), "--threads", "1"])
    err = capsys.readouterr().err
    assert code == 0, err
    line = next(x for x in err.splitlines() if x.startswith("layerskip: swift: wrote"))
    assert str(plan) in line and "no plan scored: the starting plan" in line and "never drafted" in line
    saved = json.loads(plan.read_text())
    assert saved["search"]["drafted_verifications"] == 0 and saved["objective"]["value"] is None
