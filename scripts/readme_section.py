"""Write a generated section of a README between its markers; every script that reports into a README uses this.

A section named ``name`` is the text between the lines ``<!-- name:begin -->`` and ``<!-- name:end -->``
(the markers in docs/perf/README.md). Rewriting it replaces only what lies between the two markers, so
the prose around a section (headings, hand-written notes) survives every rerun, and writing the same body
twice gives the same file.

The end marker is looked for *after* the begin marker (``text.split(begin, 1)``, then the rest split at
``end``), never as the first ``end`` anywhere in the file, which would duplicate everything between markers
in the wrong order. A file with neither marker gets the section appended under a heading; a file with only
one of them, with them out of order, or with a marker twice, is an error that names the file and the
markers, since guessing where the section ends could delete hand-written text.
"""

from __future__ import annotations

from pathlib import Path

NEW_FILE = "# Performance results\n"  # what a README that does not exist yet starts with


def markers(name: str) -> tuple[str, str]:
    """The begin and end marker lines of section ``name``."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def replace_section(text: str, name: str, body: str, heading: str | None = None) -> str:
    """``text`` with section ``name`` set to ``body``; appended under ``## heading`` (default ``name``) if absent.

    Raises ``ValueError`` if the markers are not either both absent or each present once, begin before end.
    """
    begin, end = markers(name)
    block = f"{begin}\n{body}\n{end}"
    counts = text.count(begin), text.count(end)
    if counts == (0, 0):
        return text.rstrip("\n") + f"\n\n## {heading or name}\n\n{block}\n"
    if counts != (1, 1) or text.index(begin) > text.index(end):
        raise ValueError(
            f"section {name!r}: expected {begin} then {end} once each, found them {counts[0]} and {counts[1]} "
            "time(s)" + (" with the end first" if counts == (1, 1) else "") + "; fix the markers by hand"
        )
    before, rest = text.split(begin, 1)
    return before + block + rest.split(end, 1)[1]


def write_section(readme: Path, name: str, body: str, heading: str | None = None) -> None:
    """Set section ``name`` of the file ``readme`` to ``body`` (see :func:`replace_section`).

    A missing file is created, starting with :data:`NEW_FILE`.
    """
    text = readme.read_text() if readme.exists() else NEW_FILE
    try:
        new = replace_section(text, name, body, heading)
    except ValueError as err:
        raise ValueError(f"{readme}: {err}") from None
    readme.write_text(new)
