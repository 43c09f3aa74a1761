"""The README's Python snippets run as pasted, on tiny models standing in for the cached real ones.

Every ```python block that names a model under ~/.cache/specoffload/models is run in a fresh namespace with HOME
pointed at a directory holding tiny checkpoints (with a tokenizer and a chat template) under those names, so the
"~" in the snippet is expanded exactly as on a user's machine.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CACHE = "~/.cache/specoffload/models/"


def snippets() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [b for b in blocks if CACHE in b]


def test_the_readme_has_runnable_snippets() -> None:
    assert len(snippets()) >= 2


@pytest.mark.parametrize("number", range(len(snippets())))
def test_readme_snippet_runs_as_pasted(number, tiny_models, tmp_path, monkeypatch, single_thread, capsys) -> None:
    from scripts.make_tiny_models import write_char_tokenizer

    code = snippets()[number]
    models = tmp_path / ".cache" / "specoffload" / "models"
    stand_in = {"qwen2.5-coder-1.5b-instruct": "llama", "qwen2.5-coder-0.5b-instruct": "qwen2_draft"}
    for name in set(re.findall(re.escape(CACHE) + r"([\w.-]+)", code)):
        shutil.copytree(tiny_models[stand_in[name]], models / name)
        write_char_tokenizer(models / name)
    monkeypatch.setenv("HOME", str(tmp_path))
    exec(compile(code, f"README.md python block {number}", "exec"), {"__name__": "__readme__"})
    assert capsys.readouterr().out  # every snippet prints its results
