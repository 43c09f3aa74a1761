"""The wheel holds the specoffload package (its __init__ from runtime/_package/) with runtime/ planner/ actors/
mapped into it, and nothing else."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        check=True,
    )
    (built,) = out.glob("specoffload-*.whl")
    return built


def test_wheel_contains_only_the_specoffload_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"specoffload"}
    assert "specoffload/__init__.py" in names
    assert not any(n.startswith("specoffload/runtime/_package") for n in names)  # mapped once, as specoffload
    for pkg in ("runtime", "planner", "actors"):
        assert f"specoffload/{pkg}/__init__.py" in names
    assert "specoffload/runtime/models/model.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "specoffload = specoffload.runtime.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_installed_wheel_imports(wheel, tmp_path):
    """A wheel unpacked on its own path imports (no reliance on the editable source tree)."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        # Drop the editable install's import hook so only the unpacked wheel can provide specoffload.
        "import sys; sys.meta_path = [f for f in sys.meta_path if '__editable__' not in getattr(f, '__module__', '')"
        " and '__editable__' not in repr(f)];"
        f"sys.path.insert(0, {str(site)!r});"
        "import specoffload.runtime as r, specoffload.planner, specoffload.actors;"
        "assert r.__file__.startswith(" + repr(str(site)) + "), r.__file__;"
        "from specoffload.runtime import Engine, EngineConfig, SamplingParams;"
        "import specoffload; assert specoffload.__file__.startswith(" + repr(str(site)) + "), specoffload.__file__;"
        "from specoffload import LLM, SamplingParams as S; assert S is SamplingParams; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr



def test_top_level_names_are_lazy_and_planner_stays_free_of_torch():
    """`import specoffload.planner` (through the top-level package) imports no torch; `specoffload.LLM` does."""
    code = (
        "import sys, specoffload, specoffload.planner; assert 'torch' not in sys.modules, 'torch imported';"
        "assert 'LLM' in dir(specoffload);"
        "from specoffload import LLM; from specoffload.runtime.llm import LLM as L; assert LLM is L;"
        "import pytest\n"
        "with pytest.raises(AttributeError): specoffload.no_such_name\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
