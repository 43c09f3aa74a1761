"""The README-section writer the scripts share (scripts/readme_section.py), on literal text."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scripts.readme_section import NEW_FILE, replace_section, write_section

ROOT = Path(__file__).resolve().parent.parent

DOC = """# Results

Intro prose.

## generate

<!-- generate:begin -->
old table
old line 2
<!-- generate:end -->

Notes on generate, written by hand.

<!-- generate_bf16:begin -->
bf16 table
<!-- generate_bf16:end -->
"""


def test_replaces_only_between_the_markers() -> None:
    out = replace_section(DOC, "generate", "new table")
    assert out == DOC.replace("old table\nold line 2", "new table")


def test_a_section_whose_name_extends_another_is_its_own() -> None:
    out = replace_section(DOC, "generate_bf16", "new bf16")
    assert out == DOC.replace("bf16 table", "new bf16")
    assert "old table\nold line 2" in out


def test_idempotent() -> None:
    once = replace_section(DOC, "generate", "| a | b |\n|---|---|")
    assert replace_section(once, "generate", "| a | b |\n|---|---|") == once


def test_body_may_be_empty_or_multiline() -> None:
    assert "<!-- generate:begin -->\n\n<!-- generate:end -->" in replace_section(DOC, "generate", "")
    assert "<!-- generate:begin -->\nx\n\ny\n<!-- generate:end -->" in replace_section(DOC, "generate", "x\n\ny")


def test_absent_section_is_appended_under_a_heading() -> None:
    out = replace_section("# Results\n\nIntro.\n\n\n", "transport", "rows")
    assert out == "# Results\n\nIntro.\n\n## transport\n\n<!-- transport:begin -->\nrows\n<!-- transport:end -->\n"
    out = replace_section("# Results\n", "offload", "rows", heading="offload (`scripts/bench_offload.py`)")
    assert out == ("# Results\n\n## offload (`scripts/bench_offload.py`)\n\n"
                   "<!-- offload:begin -->\nrows\n<!-- offload:end -->\n")
    assert replace_section(out, "offload", "rows") == out  # and found there the next time


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("a\n<!-- s:begin -->\nbody\n", "1 and 0"),  # the end marker lost: where would the section stop?
        ("a\n<!-- s:end -->\nb\n", "0 and 1"),
        ("<!-- s:end -->\nkeep me\n<!-- s:begin -->\n", "1 and 1 time(s) with the end first"),
        ("<!-- s:begin -->\n1\n<!-- s:end -->\n<!-- s:begin -->\n2\n<!-- s:end -->\n", "2 and 2"),
    ],
)
def test_broken_markers_are_an_error_that_changes_nothing(tmp_path: Path, text: str, found: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"section 's': expected <!-- s:begin --> then <!-- s:end --> "
                                                   f"once each, found them {found}")):
        replace_section(text, "s", "new")
    readme = tmp_path / "README.md"
    readme.write_text(text)
    with pytest.raises(ValueError, match=re.escape(str(readme))):
        write_section(readme, "s", "new")
    assert readme.read_text() == text


def test_write_section_creates_a_missing_file(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    write_section(readme, "transport", "rows", heading="transport (`scripts/bench_transport.py`)")
    assert readme.read_text() == (NEW_FILE + "\n## transport (`scripts/bench_transport.py`)\n\n"
                                  "<!-- transport:begin -->\nrows\n<!-- transport:end -->\n")


def test_rewriting_the_perf_readme_sections_with_their_own_bodies_changes_nothing() -> None:
    """Every section the benchmark scripts write in docs/perf/README.md is found where it is."""
    text = (ROOT / "docs" / "perf" / "README.md").read_text()
    sections = re.findall(r"<!-- (\w+):begin -->\n(.*?)\n<!-- \1:end -->", text, flags=re.S)
    names = {name for name, _ in sections}
    assert {"generate", "offload", "transport", "ray_backend", "planner_validation"} <= names
    for name, body in sections:
        assert replace_section(text, name, body) == text


def test_the_perf_index_is_the_one_the_jsons_give():
    """docs/perf/README.md opens with the table scripts/perf_index.py writes from docs/perf/*.json: rerun it after a
    benchmark writes its JSON."""
    from scripts.perf_index import render

    readme = (ROOT / "docs" / "perf" / "README.md").read_text()
    assert render(readme) == readme, "docs/perf/README.md's index is stale: python -m scripts.perf_index"


def test_a_superseded_perf_file_names_a_current_successor():
    """A docs/perf JSON marked superseded names a file that exists and is not superseded itself, with a reason; the
    index lists it under "Superseded", not among the headline rows."""
    import json

    from scripts.perf_index import superseded, table

    perf = ROOT / "docs" / "perf"
    marked = {f.name: superseded(json.loads(f.read_text())) for f in perf.glob("*.json")}
    marked = {name: mark for name, mark in marked.items() if mark is not None}
    assert marked, "no file is marked superseded: the test would check nothing"
    current, _, old = table().partition("Superseded")
    for name, (by, why) in marked.items():
        assert (perf / by).is_file(), f"{name} is superseded by {by}, which does not exist"
        assert superseded(json.loads((perf / by).read_text())) is None, f"{name}'s successor {by} is superseded"
        assert why, f"{name} says not why it is superseded"
        assert f"[{name}]" not in current and f"| [{name}]({name}) | [{by}]({by}) |" in old
