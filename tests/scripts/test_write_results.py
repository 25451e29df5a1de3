"""scripts/write_results.py regenerates docs/RESULTS.md without losing hand-written or GPU sections."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "write_results.py"


def test_regenerating_keeps_notes_and_the_gpu_section(tmp_path):
    page = tmp_path / "RESULTS.md"
    page.write_text("# old\n\n<!-- notes:summary -->\nmy summary\n<!-- /notes:summary -->\n\n"
                    "<!-- notes:where_it_pays -->\nthe cost model\n<!-- /notes:where_it_pays -->\n\n"
                    "<!-- gpu-compare:begin -->\n## GPU\nmeasured table\n<!-- gpu-compare:end -->\n")
    subprocess.run([sys.executable, str(SCRIPT), "--runs", str(tmp_path / "no-runs"), "--out", str(page)],
                   check=True, capture_output=True)
    text = page.read_text()
    assert "my summary" in text and "the cost model" in text
    assert "<!-- gpu-compare:begin -->\n## GPU\nmeasured table\n<!-- gpu-compare:end -->" in text
    assert text.index("the cost model") < text.index("measured table")
