"""--help answers fast (no transformers import, whose load was most of its time) and documents every flag."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import contextlib, io, runpy, sys
sys.argv = ["layerskip", "generate", "--help"]
out = io.StringIO()
try:
    with contextlib.redirect_stdout(out):
        runpy.run_module("layerskip_cli", run_name="__main__")
except SystemExit:
    pass
print("transformers" in sys.modules)
print(out.getvalue())
"""


def test_generate_help_skips_transformers_and_documents_device():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=REPO, timeout=300)
    imported, _, text = proc.stdout.partition("\n")
    assert imported == "False", "generate --help imported transformers"
    device = text.split("\n  --device STR", 1)[1].split("--dtype", 1)[0]
    assert "Where to run" in device  # an inherited settings field keeps its doc
