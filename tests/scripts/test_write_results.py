"""scripts/write_results.py regenerates docs/RESULTS.md without losing hand-written or GPU sections."""

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "write_results.py"


def test_regenerating_keeps_notes_and_the_gpu_section(tmp_path):
    page = tmp_path / "RESULTS.md"
    page.write_text("# old\n\n<!-- notes:summary -->\nmy summary\n<!-- /notes:summary -->\n\n"
                    "<!-- notes:where_it_pays -->\nthe cost model\n<!-- /notes:where_it_pays -->\n\n"
                    "<!-- gpu-compare:begin -->\n## GPU\nmeasured table\n<!-- gpu-compare:end -->\n")
    (tmp_path / "runs").mkdir()
    subprocess.run([sys.executable, str(SCRIPT), "--runs", str(tmp_path / "runs"), "--out", str(page)],
                   check=True, capture_output=True)
    text = page.read_text()
    assert "my summary" in text and "the cost model" in text
    assert "<!-- gpu-compare:begin -->\n## GPU\nmeasured table\n<!-- gpu-compare:end -->" in text
    assert text.index("the cost model") < text.index("measured table")


def test_a_run_folder_without_inputs_keeps_every_measured_section_of_the_committed_page(tmp_path):
    page = tmp_path / "RESULTS.md"
    shutil.copyfile(REPO / "docs" / "RESULTS.md", page)
    (tmp_path / "runs").mkdir()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--runs", str(tmp_path / "runs"), "--out", str(page)],
                          capture_output=True, text=True, check=True)
    assert page.read_text() == (REPO / "docs" / "RESULTS.md").read_text()
    assert "kept the committed section 'Drafters vs peers, base and trained model'" in proc.stderr
    assert "bench/results.json is missing" in proc.stderr


def test_a_missing_run_folder_is_refused_and_the_page_left_as_it_is(tmp_path):
    page = tmp_path / "RESULTS.md"
    page.write_text("# measured\n")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--runs", str(tmp_path / "runs"), "--out", str(page)],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and page.read_text() == "# measured\n"
    assert proc.stderr.count("\n") == 1 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr
