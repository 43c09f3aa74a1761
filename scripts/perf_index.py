"""The table docs/perf/README.md opens with: every headline number of docs/perf/*.json (the numbers of their
top-level "summary", a row per file), with the command that produced it and the machine it ran on, as the JSON
records them ("not recorded" where an older file does not). Scratch runs (docs/perf/scratch/) are not listed. A
file whose JSON holds `"superseded_by": {"file": ..., "why": ...}` (a later run measured the same thing) leaves the
table for a second one below it, "Superseded", that names its successor and why: kept for the record, not headline.

    python -m scripts.perf_index            # rewrite the table between the index markers
    python -m scripts.perf_index --check    # exit 1 if the table is not the one the JSONs give (tests run this)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from scripts.common import PERF
from scripts.readme_section import replace_section

SCRIPTS = Path(__file__).resolve().parent


def _meta(data: dict, key: str) -> object:
    """A run's record of `key`, at the top level or under "meta"."""
    if key in data:
        return data[key]
    meta = data.get("meta")
    return meta.get(key) if isinstance(meta, dict) else None


def _machine(data: dict) -> str:
    machine = _meta(data, "machine")
    if isinstance(machine, dict):
        model, cores = machine.get("model"), machine.get("cores")
        flags = machine.get("flags") or []
        extra = "AMX" if any(f.startswith("amx") for f in flags) else "AVX512-BF16" if "avx512_bf16" in flags else ""
        return ", ".join(str(x) for x in (model, f"{cores} cores" if cores else None, extra) if x) or "not recorded"
    return str(machine) if machine else "not recorded"


def _command(name: str, data: dict) -> str:
    """`python -m scripts.X ARGS` from the recorded argv; the script is found by name where argv lacks it."""
    argv = _meta(data, "argv")
    args: list[str] = [str(a) for a in argv] if isinstance(argv, list) else []
    script = None
    if args and args[0].endswith(".py"):
        script, args = Path(args[0]).stem, args[1:]
    else:
        stem = name.removesuffix(".json")
        for path in sorted(SCRIPTS.glob("*.py")):
            if f'"{stem}' in path.read_text() or f"{stem}.json" in path.read_text():
                script = path.stem
                break
    if script is None:
        return "not recorded"
    code = " ".join(["python -m", f"scripts.{script}", *args])
    return f"`{code}`" if argv is not None else f"`{code}` (arguments not recorded)"


def _metric(value: object) -> bool:
    """A summary entry worth listing: a number, or a short count such as "32/32" (not the run's settings)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, (int, float)) or (isinstance(value, str) and re.fullmatch(r"\d+/\d+", value) is not None)


def superseded(data: object) -> tuple[str, str] | None:
    """(successor file, why) where a JSON says a later run superseded it, else None."""
    mark = data.get("superseded_by") if isinstance(data, dict) else None
    if not isinstance(mark, dict) or not mark.get("file"):
        return None
    return str(mark["file"]), str(mark.get("why", ""))


def table(perf: Path = PERF) -> str:
    """The markdown tables of perf/*.json, a row per file in name order: its summary's metrics, command, machine;
    the current files first, then the superseded ones with their successor."""
    current = ["| file | metrics (`summary` key = value) | command | machine | date |", "|---|---|---|---|---|"]
    old = ["| file | superseded by | why | metrics (`summary` key = value) | machine | date |",
           "|---|---|---|---|---|---|"]
    for file in sorted(perf.glob("*.json")):
        data = json.loads(file.read_text())
        summary = data.get("summary") if isinstance(data, dict) else None
        if not isinstance(summary, dict):
            continue
        metrics = [f"`{k}` = {v:.4g}" if isinstance(v, float) else f"`{k}` = {v}"
                   for k, v in summary.items() if _metric(v)]
        if not metrics:
            continue
        date = str(_meta(data, "date") or _meta(data, "run_at") or "not recorded")[:16]
        mark = superseded(data)
        if mark is None:
            current.append(f"| [{file.name}]({file.name}) | {'<br>'.join(metrics)} | {_command(file.name, data)} | "
                           f"{_machine(data)} | {date} |")
        else:
            by, why = mark
            old.append(f"| [{file.name}]({file.name}) | [{by}]({by}) | {why} | {'<br>'.join(metrics)} | "
                       f"{_machine(data)} | {date} |")
    if len(old) == 2:
        return "\n".join(current)
    return "\n".join([*current, "", "Superseded (a later run measured the same thing; kept for the record):", "",
                      *old])


def render(readme: str) -> str:
    """readme with its index section (between the index markers) set to the table the JSONs give."""
    return replace_section(readme, "index", table())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the README's table is out of date")
    args = parser.parse_args()
    readme = PERF / "README.md"
    old = readme.read_text()
    new = render(old)
    if args.check:
        if new != old:
            print("docs/perf/README.md's index is out of date: run python -m scripts.perf_index", file=sys.stderr)
            return 1
        return 0
    readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
