"""core.options: the one dataclass <-> YAML / text / argparse utility."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Literal

import pytest

from layerskip_core.errors import UserError
from layerskip_core.options import add_dataclass_flags, build, field_docs, from_text, type_name


@dataclass
class Inner:
    rate: float = 0.1
    """A rate."""


@dataclass
class Example:
    steps: int = 3
    """How many steps."""
    name: str = "x"
    """A name."""
    flag: bool = False
    """On or off."""
    mode: Literal["a", "b"] = "a"
    """Which mode."""
    exits: list[int] = field(default_factory=list)
    """Exit layers."""
    cap: int | None = None
    """Optional cap."""
    inner: Inner = field(default_factory=Inner)
    """A section."""


def test_field_docs_reads_attribute_docstrings():
    docs = field_docs(Example)
    assert docs["steps"] == "How many steps."
    assert docs["inner"] == "A section."


def test_build_converts_and_refuses_unknown_keys_with_the_nearest_name():
    cfg = build(Example, {"steps": 5, "exits": [8, 16], "inner": {"rate": "3e-4"}, "cap": None})
    assert cfg.steps == 5 and cfg.exits == [8, 16] and cfg.inner.rate == pytest.approx(3e-4)
    with pytest.raises(UserError, match="did you mean 'steps'"):
        build(Example, {"step": 5})
    with pytest.raises(UserError, match="expected an integer"):
        build(Example, {"steps": "five"})
    with pytest.raises(UserError, match="is not one of"):
        build(Example, {"mode": "c"})


def test_from_text_reads_typed_strings():
    assert from_text("8", int, "k") == 8
    assert from_text("true", bool, "f") is True
    assert from_text("[4, 8]", list[int], "e") == [4, 8]
    assert from_text("null", int | None, "c") is None
    assert from_text("007", str, "s") == "007"  # strings stay as typed
    with pytest.raises(UserError, match="k: expected an integer, got 'x'"):
        from_text("x", int, "k")


def test_type_name():
    assert type_name(int | None) == "int or null"
    assert type_name(list[int]) == "list of int"


def test_dataclass_flags_parse_types_and_share_flags_once():
    parser = argparse.ArgumentParser()
    seen: set[str] = set()
    added = add_dataclass_flags(parser.add_argument_group("example"), Example, skip=("inner",), seen=seen)
    assert "inner" not in added and "steps" in added
    assert add_dataclass_flags(parser.add_argument_group("again"), Example, seen=seen) == ["inner"]
    args = parser.parse_args(["--steps", "4", "--flag", "--exits", "[1, 2]"])
    assert args.steps == 4 and args.flag is True and args.exits == [1, 2] and args.cap is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--steps", "four"])
