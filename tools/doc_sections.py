"""Marked sections of a Markdown page: the one writer that replaces the text between two markers (the GPU check's
block, the training table, the GPU comparison's section of RESULTS.md) and the one reader that finds it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from layerskip_core import jsonfile
from layerskip_core.errors import UserError


class SectionError(UserError, ValueError):
    """A page whose markers are missing, doubled or out of order: one line, nothing changed."""


@dataclass(frozen=True)
class Markers:
    """The two HTML comments around a generated section; a page holds each once, ``begin`` first."""

    begin: str
    """The opening marker, e.g. ``<!-- gpu_check:begin -->``."""
    end: str
    """The closing marker."""

    def block(self, body: str) -> str:
        """``body`` between the markers, one line each."""
        return f"{self.begin}\n{body}\n{self.end}"

    def span(self, text: str, where: str | Path) -> tuple[int, int] | None:
        """(start of ``begin``, end of ``end``) of the one marked section of ``text``; None when neither marker is
        there; refused (naming ``where``) when a marker occurs twice, alone, or after the other."""
        if self.begin not in text and self.end not in text:
            return None
        if text.count(self.begin) != 1 or text.count(self.end) != 1 or text.index(self.end) < text.index(self.begin):
            raise SectionError(f"{where} must hold {self.begin} once and then {self.end} once; nothing was changed")
        return text.index(self.begin), text.index(self.end) + len(self.end)

    def section(self, text: str, where: str | Path) -> str | None:
        """The marked section of ``text``, markers included (None: not there)."""
        found = self.span(text, where)
        return None if found is None else text[found[0]:found[1]]


GPU_CHECK = Markers("<!-- gpu_check:begin -->", "<!-- gpu_check:end -->")
"""tools/gpu/gpu_check.py's result block in GPU.md."""
GPU_TRAINING = Markers("<!-- gpu_check:train:begin -->", "<!-- gpu_check:train:end -->")
"""The training table of the GPU check (tools/bench/train_bench.py) in TRAINING.md."""
GPU_COMPARE = Markers("<!-- gpu-compare:begin -->", "<!-- gpu-compare:end -->")
"""tools/gpu/gpu_compare.py's section of RESULTS.md."""


def replace_section(text: str, markers: Markers, section: str, where: str | Path, append: bool = True) -> str:
    """``text`` with its marked section replaced by ``section`` (markers included); a page without the markers gets
    it appended after a blank line (``append``) or is refused."""
    found = markers.span(text, where)
    if found is None:
        if not append:
            raise SectionError(f"{where} has no {markers.begin} ... {markers.end} markers; nothing was changed")
        return text.rstrip("\n") + ("\n\n" if text.strip() else "") + section.rstrip("\n") + "\n"
    return text[:found[0]] + section.rstrip("\n") + text[found[1]:]


def write_section(path: Path, markers: Markers, section: str, append: bool = True, new_page: str = "") -> None:
    """Replace the marked section of the page ``path`` (``new_page`` as its text when it does not exist yet) with
    ``section``, written atomically (``jsonfile.write``)."""
    text = read_page(path) if path.is_file() else new_page
    jsonfile.write(path, replace_section(text, markers, section, path, append))


def read_page(path: Path) -> str:
    """A page's text; one line (nothing changed) when it is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text; nothing was changed") from None
