"""Fixtures of the scripts' tests."""

import pytest

from lease_rehearsal import rehearse


@pytest.fixture(scope="session")
def lease_rehearsal(tmp_path_factory) -> dict:
    """docs/GPU.md's lease sequence, run once per session on the CPU (``lease_rehearsal.rehearse``)."""
    return rehearse(tmp_path_factory.mktemp("lease"))
