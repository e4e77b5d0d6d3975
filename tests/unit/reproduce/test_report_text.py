"""The studies' fixed report text (``fedfm.reproduce.tables.Text``): sections of a markdown
template filled by the study, blocks left out without stray blank lines, and every section a
study's code asks for present in the template shipped as package data."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from fedfm.reproduce import tables
from fedfm.reproduce.tables import Text
from helpers import REPO

TEMPLATE = """<!-- A note to the reader: not a section. $nothing here is filled. -->

<!-- section: body -->
# $title

- first item
$extra
- last item

$table

$optional

Cost: $$5 a run.

$tail

<!-- section: table -->
| a | b |
|---|---|
$rows
"""


@pytest.fixture
def text(tmp_path: Path) -> Text:
    (tmp_path / "toy.md").write_text(TEMPLATE)
    return Text("toy", tmp_path)


def test_a_section_is_filled_and_a_block_left_out_takes_its_blank_line_along(text):
    assert set(text.sections) == {"body", "table"}
    table = text("table", rows=[["1", "2"], "| 3 | 4 |"])  # a list is a row, a string a line
    assert table == "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |"
    full = text("body", title="T", extra="- middle", table=table, optional="Note.", tail=["x"])
    assert full == (
        f"# T\n\n- first item\n- middle\n- last item\n\n{table}\n\nNote.\n\nCost: $5 a run.\n\nx"
    )
    # None leaves a block out: a paragraph with one blank line beside it, a list item alone;
    # an empty list drops its line only (what an empty block was before: one blank line).
    short = text("body", {"title": "T"}, extra=None, table="t", optional=None, tail=None)
    assert short == "# T\n\n- first item\n- last item\n\nt\n\nCost: $5 a run."
    empty = text("body", title="T", extra=None, table="t", optional=[], tail="end")
    assert empty == "# T\n\n- first item\n- last item\n\nt\n\n\nCost: $5 a run.\n\nend"
    # Values given as mappings first, keywords over them.
    assert text("body", {"title": "A", "extra": None}, title="B", table="", optional="",
                tail="").startswith("# B\n")  # fmt: skip


def test_a_missing_value_or_section_names_the_file_and_the_placeholder(text, tmp_path):
    with pytest.raises(KeyError, match=r"toy.md, section 'table': no value for \$rows"):
        text("table")
    with pytest.raises(KeyError, match="no section 'nope'"):
        text("nope")
    with pytest.raises(KeyError, match=r"no value for \$extra"):
        text("body", title="T", table="", optional="", tail=None)
    (tmp_path / "bad.md").write_text("<!-- section: s -->\ncosts $ 5\n")
    with pytest.raises(ValueError, match=r"bad\.md, section 's': Invalid placeholder"):
        Text("bad", tmp_path)("s")
    (tmp_path / "twice.md").write_text("<!-- section: s -->\na\n<!-- section: s -->\nb\n")
    with pytest.raises(ValueError, match="a section name stands twice"):
        Text("twice", tmp_path)("s")


# What a study's code asks of its template: TEXT("name", ...), and f"scope-{k}" over names.
CALLED = re.compile(r'\bTEXT\(\s*"([\w-]+)"')
PREFIXED = re.compile(r'\bTEXT\(f"([\w-]+)\{')


def test_every_section_a_study_asks_for_is_in_its_template_and_ships_with_the_package():
    folder = Path(tables.__file__).parent
    modules = {p.stem: p.read_text() for p in folder.glob("*.py")}
    used = {name: src for name, src in modules.items() if "TEXT = Text(" in src}
    assert set(used) == {
        *("framework", "fedekd", "fedrd", "fedhds", "fedsdr", "dpsyn", "hetero"),
        *("fedekd_skew", "fedrd_paper"),
    }
    for name, src in used.items():
        (template,) = re.findall(r'TEXT = Text\("([\w-]+)"\)', src)
        sections = set(Text(template).sections)
        called = set(CALLED.findall(src))
        assert called and called <= sections, (name, called - sections)
        for prefix in PREFIXED.findall(src):
            assert any(s.startswith(prefix) for s in sections), (name, prefix)
    # The templates are package data: a wheel or an sdist holds them beside the code.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    data = project["tool"]["setuptools"]["package-data"]["fedfm"]
    assert "reproduce/reports/*.md" in data
    assert {p.stem for p in (folder / "reports").glob("*.md")} == set(used)
