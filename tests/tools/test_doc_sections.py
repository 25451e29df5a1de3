"""tools.doc_sections: the one writer of a page's marked section (the GPU check's block, its training table,
the GPU comparison's section of RESULTS.md)."""

import pytest

from layerskip_core.errors import UserError
from tools.doc_sections import GPU_CHECK, Markers, SectionError, replace_section, write_section


def test_the_section_is_replaced_and_the_rest_of_the_page_kept(tmp_path):
    page = tmp_path / "GPU.md"
    page.write_text(f"intro\n{GPU_CHECK.block('old')}\nafter\n")
    write_section(page, GPU_CHECK, GPU_CHECK.block("new"))
    assert page.read_text() == f"intro\n{GPU_CHECK.begin}\nnew\n{GPU_CHECK.end}\nafter\n"


def test_a_page_without_markers_gets_the_section_appended_or_is_refused(tmp_path):
    page = tmp_path / "new.md"
    write_section(page, GPU_CHECK, GPU_CHECK.block("x"), new_page="# GPU results\n")
    assert page.read_text() == f"# GPU results\n\n{GPU_CHECK.block('x')}\n"
    with pytest.raises(SectionError, match="no .* markers") as e:
        replace_section("no markers\n", GPU_CHECK, GPU_CHECK.block("y"), "page.md", append=False)
    assert isinstance(e.value, UserError) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("text", ["<!-- b -->\n<!-- e -->\n<!-- b -->\n<!-- e -->\n", "<!-- e -->\n<!-- b -->\n",
                                  "<!-- b -->\nonly the start\n"])
def test_doubled_reversed_or_lone_markers_are_refused(tmp_path, text):
    markers = Markers("<!-- b -->", "<!-- e -->")
    page = tmp_path / "p.md"
    page.write_text(text)
    with pytest.raises(SectionError, match="once and then"):
        write_section(page, markers, markers.block("new"))
    assert page.read_text() == text  # nothing changed
    assert markers.section("plain\n", page) is None
