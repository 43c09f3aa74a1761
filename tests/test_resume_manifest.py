"""`--resume` refuses every change that changes a row, in one line naming it, and leaves the output untouched
(issue 25, item 3): dtypes of target and draft, the drafter, the draft model, max lengths, sampling defaults, and
the checkpoints' config.json, generation_config.json, tokenizer files and chat template, of target and draft."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from specoffload.runtime.cli import main
from tests.test_input_bounds import add_byte_tokenizer


def _edit_json(path: Path, **changes: object) -> Callable[[], None]:
    def edit() -> None:
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))

    return edit


def _write(path: Path, text: str) -> Callable[[], None]:
    return lambda: path.write_text(text)


@pytest.fixture
def job(tiny_models, tmp_path):
    target = add_byte_tokenizer(tiny_models["llama"], tmp_path / "target")
    draft = Path(shutil.copytree(tiny_models["qwen2_draft"], tmp_path / "draft"))
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": [4 + i, 5]}) + "\n" for i in range(3)))
    cli = ["generate", "--target", str(target), "--draft", str(draft), "-k", "2", "--prompts", str(prompts),
           "-o", str(out), "--max-new-tokens", "3", "--chunk-size", "2", "--no-progress"]
    return target, draft, out, cli


def test_resume_refuses_each_change_that_changes_a_row(job, tiny_models, capsys) -> None:
    target, draft, out, cli = job
    assert main(cli) == 0
    written = out.read_text()
    manifest = out.with_name(out.name + ".manifest.json").read_text()
    assert main([*cli, "--resume"]) == 0  # unchanged: nothing to do
    capsys.readouterr()
    flags = [(["--dtype", "bfloat16", "--draft-dtype", "float32"], "engine.dtype"),
             (["--draft-dtype", "bfloat16"], "engine.draft_dtype"),
             (["--draft", str(tiny_models["mistral"])], "models.draft"),
             (["-k", "3"], "engine.num_draft_tokens"), (["--max-seq-len", "64"], "engine.max_seq_len"),
             (["--max-new-tokens", "4"], "sampling.max_new_tokens"), (["--top-k", "5"], "sampling.top_k"),
             (["--ignore-eos"], "sampling.ignore_eos")]
    no_draft = cli[:3] + cli[7:]  # no --draft, no -k: the "none" drafter
    assert no_draft[3] == "--prompts"
    runs = [([*cli, *change], field) for change, field in flags] + [(no_draft, "models.draft")]
    for change, field in runs:
        assert main([*change, "--resume"]) == 2, change
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--resume refused" in err[0] and field in err[0], (change, err[0][-250:])
    files = [(target / "config.json", "files.target.config.json", {"rope_theta": 20000.0}),
             (target / "generation_config.json", "files.target.generation_config.json", {"top_k": 7}),
             (target / "tokenizer_config.json", "files.target.tokenizer_config.json", {"chat_template": "{{ 1 }}"}),
             (draft / "config.json", "files.draft.config.json", {"rms_norm_eps": 1e-5}),
             (draft / "generation_config.json", "files.draft.generation_config.json", {"top_k": 7})]
    edits = [(p, f, _edit_json(p, **c)) for p, f, c in files]
    tokenizer = json.loads((target / "tokenizer.json").read_text())
    tokenizer["added_tokens"][0]["content"] = "<nothing>"
    edits += [(target / "tokenizer.json", "files.target.tokenizer.json",
               _write(target / "tokenizer.json", json.dumps(tokenizer))),
              (target / "chat_template.jinja", "files.target.chat_template.jinja",
               _write(target / "chat_template.jinja", "{{ messages }}"))]
    for path, field, edit in edits:
        before = path.read_text() if path.exists() else None
        edit()
        assert main([*cli, "--resume"]) == 2, field
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--resume refused" in err[0] and field in err[0], (field, err)
        if before is None:
            path.unlink()
        else:
            path.write_text(before)
    assert out.read_text() == written  # nothing was touched
    assert out.with_name(out.name + ".manifest.json").read_text() == manifest
    assert main([*cli, "--resume"]) == 0  # everything restored: it resumes (nothing left to do)
