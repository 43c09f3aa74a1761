"""The layering, checked in fresh interpreters: planner/ is the base (no torch, no runtime, no Ray; see
test_planner.py), runtime/ imports the planner but never actors/ or Ray, and only actors/launcher.py applies
`ray.remote`."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_runtime_never_imports_actors_or_ray() -> None:
    """Importing every runtime module (the CLI included) pulls in neither specoffload.actors nor ray; the last line
    shows the check can fail: the actors' backend module does import ray."""
    code = (
        "import sys, pkgutil, importlib, specoffload.runtime as r\n"
        "for m in pkgutil.walk_packages(r.__path__, 'specoffload.runtime.'): importlib.import_module(m.name)\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith(('ray.', 'specoffload.actors'))))\n"
        "import specoffload.actors.backend\n"
        "print('ray' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]"
    assert out[1] == "True"


def _calls_ray_remote(path: Path) -> bool:
    return any(isinstance(node, ast.Attribute) and node.attr == "remote" and isinstance(node.value, ast.Name)
               and node.value.id == "ray" for node in ast.walk(ast.parse(path.read_text())))


def test_only_the_launcher_applies_ray_remote() -> None:
    users = sorted(p.relative_to(ROOT).as_posix() for folder in ("actors", "runtime", "planner")
                   for p in (ROOT / folder).rglob("*.py") if _calls_ray_remote(p))
    assert users == ["actors/launcher.py"]


def test_no_module_imports_a_private_name_of_another() -> None:
    """Composition, not reaching in: no `from x import _private` across modules of the package."""
    offenders = []
    for folder in ("actors", "runtime", "planner"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                ours = isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith(
                    "specoffload"))
                if ours:
                    offenders += [f"{path.relative_to(ROOT)}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert offenders == []
