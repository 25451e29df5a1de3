"""The Makefile's setup paths (dry runs: what this machine allows without a GPU or a network)."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAKE_VARIABLES = set(re.findall(r"^([A-Z_]+) *\?=", (REPO / "Makefile").read_text(), re.M))
"""The Makefile's overridable variables (``GEMMA``, ``EXTRAS``, ``MODEL``, ...)."""
MAKE_ENV = {k: v for k, v in os.environ.items() if k not in {"MAKEFLAGS", "MFLAGS", "MAKELEVEL", *MAKE_VARIABLES}}
"""The environment of a top-level make: a suite started by ``make test EXTRAS=... GEMMA=1`` (CI) passes its variables
to every make below it, through MAKEFLAGS and the environment, which would change what these dry runs plan."""
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def dry_run(*variables: str) -> list[str]:
    proc = subprocess.run(["make", "--no-print-directory", "-n", "-B", "setup", "VENV=/tmp/dry-venv", *variables],
                          cwd=REPO, env=MAKE_ENV, capture_output=True, text=True,
                          timeout=60)  # no "Entering directory" under make
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_cpu_setup_installs_everything_from_the_constraints():
    lines = dry_run()
    assert any(re.search(r'pip install -q -c constraints.txt -e "\.\[dev\]"', line) for line in lines)
    assert not any("download.pytorch.org" in line for line in lines)


def test_cuda_setup_takes_the_pinned_torch_version_from_the_cuda_index_and_the_rest_from_the_constraints():
    pinned = re.search(r"^torch==(\S+)$", (REPO / "constraints.txt").read_text(), re.M).group(1)
    lines = dry_run("TORCH=cu128")
    torch_line = next(line for line in lines if "--index-url" in line)
    assert f'"torch=={pinned}"' in torch_line and torch_line.endswith("https://download.pytorch.org/whl/cu128")
    rest = lines[lines.index(torch_line) + 1:]
    assert any("grep -v '^torch==' constraints.txt" in line for line in rest)
    assert any('-c /tmp/dry-venv/constraints-without-torch.txt -e ".[dev]"' in line for line in rest)


def test_keep_setup_uses_the_torch_already_installed():
    lines = dry_run("TORCH=keep")
    assert lines[0].endswith("-m venv --system-site-packages /tmp/dry-venv")
    assert not any("torch==" in line and "pip install" in line for line in lines)
    assert any("constraints-without-torch.txt -e" in line for line in lines)


def test_demo_shows_a_drafter_that_does_not_lose_beside_the_untrained_early_exit():
    proc = subprocess.run(["make", "--no-print-directory", "-n", "-B", "demo", "VENV=/tmp/dry-venv"], cwd=REPO,
                          env=MAKE_ENV, capture_output=True, text=True, timeout=60)
    bench = proc.stdout.split("layerskip bench", 1)[1].replace("\\\n", " ")
    drafters = bench.split("--drafters ", 1)[1].split()[0].split(",")
    assert "swift" in drafters and any(d.startswith("early_exit") for d in drafters)
    n, repeats = int(bench.split("--n ", 1)[1].split()[0]), int(bench.split("--repeats ", 1)[1].split()[0])
    assert n * repeats >= 3  # enough timed generations per row not to be marked 'too few samples'


def test_demo_on_gemma_fetches_it_and_shows_its_own_rows():
    """`make demo MODEL=gemma3-270m`: Gemma 3 270M fetched, its own rows (no adapter ships for it), its own output
    folder; the default demo's rows: a training-free row (the own int4 copy) and a trained one (the adapter)."""
    def planned(*variables: str) -> str:
        return subprocess.run(["make", "--no-print-directory", "-n", "-B", "demo", "VENV=/tmp/dry-venv", *variables],
                              cwd=REPO, env=MAKE_ENV, capture_output=True, text=True, timeout=60, check=True).stdout

    gemma, default = planned("MODEL=gemma3-270m"), planned()
    assert "layerskip fetch-model gemma3-270m" in gemma and "--model gemma3-270m" in gemma
    assert "--drafters autoregressive,quant_self,dynamic_exit,swift " in gemma
    assert "--out runs/demo-gemma3-270m" in gemma
    assert "adapter=default" not in gemma.split("layerskip bench", 1)[1]
    assert "--model default --drafters autoregressive,quant_self,early_exit:adapter=default,swift " in \
        default and "--out runs/demo --force" in default


def test_make_test_fetches_gemma_only_when_asked():
    """CI's GEMMA=1 fetches Gemma 3 270M and requires its tests; a plain `make test` fetches the default model only
    (no model under the Gemma Terms of Use fetched on a user's behalf)."""
    def planned(*variables: str) -> str:
        return subprocess.run(["make", "--no-print-directory", "-n", "-B", "test", "VENV=/tmp/dry-venv", *variables],
                              cwd=REPO, env=MAKE_ENV, capture_output=True, text=True, timeout=60, check=True).stdout

    plain, gemma = planned(), planned("GEMMA=1")
    assert "layerskip fetch-model\n" in plain and "gemma3-270m" not in plain and "REQUIRE_GEMMA" not in plain
    assert "layerskip fetch-model gemma3-270m" in gemma and "LAYERSKIP_REQUIRE_GEMMA=1" in gemma
    assert "GEMMA=1" in (REPO / ".ci" / "run").read_text()


def test_a_setup_with_another_torch_flavour_is_not_up_to_date(tmp_path):
    """The install stamp names the torch flavour and the extras: a CPU setup does not make `make setup TORCH=cu128`
    or `make setup EXTRAS=dev,eval` a no-op."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed-cpu-dev").touch()  # what a finished CPU setup leaves (newer than pyproject.toml)

    def planned(*variables: str) -> str:
        return subprocess.run(["make", "--no-print-directory", "-n", "setup", f"VENV={venv}", *variables], cwd=REPO,
                              env=MAKE_ENV, capture_output=True, text=True, timeout=60, check=True).stdout

    assert "pip install" not in planned()  # the CPU setup is up to date
    cuda = planned("TORCH=cu128")
    assert "download.pytorch.org/whl/cu128" in cuda and f"rm -f {venv}/.installed {venv}/.installed-*" in cuda
    assert "--system-site-packages" in planned("TORCH=keep")
    assert '-e ".[dev,eval]"' in planned("EXTRAS=dev,eval")
