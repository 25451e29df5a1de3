"""The bench tests' prompt file: two short prompts, code and prose."""

import pytest


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "The quick brown fox"}\n')
    return path
