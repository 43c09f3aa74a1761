"""Offline jobs (runtime/offline/) on literal data: line splitting, the two formats, per-row preparation, the
manifest, the output file (lock, resume checks, cut, disk full), chunks, in-order release and the lease book."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from specoffload.runtime.offline import output as output_module
from specoffload.runtime.offline.chunks import Chunk, ChunkDone, InOrder, LeaseBook, chunked, errors_only
from specoffload.runtime.offline.formats import input_format
from specoffload.runtime.offline.manifest import Manifest, ManifestError, manifest_path, read_manifest
from specoffload.runtime.offline.openai import OpenAIBatchFormat
from specoffload.runtime.offline.output import OutputFile, OutputFileError, dump_row
from specoffload.runtime.offline.prepare import Limits, Preparer
from specoffload.runtime.offline.rows import RowError, RowJob, RowRequest, RowResult
from specoffload.runtime.offline.simple import SimpleFormat
from specoffload.runtime.offline.source import InputSource, RawRow
from specoffload.runtime.sampling import SamplingParams

# ------------------------------------------------------------------------------------------------ source


def test_rows_split_on_newline_only(tmp_path: Path) -> None:
    f = tmp_path / "p.txt"
    f.write_bytes("a\x0cb\n\nc\u2028d\u2029e\x85f\r\n   \nlast".encode())
    rows = list(InputSource.file(f).rows())
    assert [(r.index, r.lineno) for r in rows] == [(0, 1), (1, 3), (2, 5)]
    assert [SimpleFormat(text=True).parse(r).prompt for r in rows] == ["a\x0cb", "c\u2028d\u2029e\x85f", "last"]
    assert [r.index for r in InputSource.file(f).rows(start=1)] == [1, 2]
    sha, count = InputSource.file(f).identity()
    assert count == 3 and len(sha) == 64


def test_missing_input_is_a_prompt_file_error(tmp_path: Path) -> None:
    from specoffload.runtime.prompts import PromptFileError

    with pytest.raises(PromptFileError, match="no such file"):
        InputSource.file(tmp_path / "nope.jsonl")


# ------------------------------------------------------------------------------------------------ formats


def _raw(value: object, index: int = 0) -> RawRow:
    data = value if isinstance(value, bytes) else json.dumps(value).encode()
    return RawRow(index, index + 1, data)


def _req(url: str = "/v1/completions", **body: object) -> dict:
    return {"custom_id": "c1", "method": "POST", "url": url, "body": body}


def test_openai_rows_parse_with_their_own_parameters() -> None:
    fmt = OpenAIBatchFormat()
    row = fmt.parse(_raw(_req(prompt=[5, 6], max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop="\n",
                             model="m", n=1, stream=False, user="u")))
    assert isinstance(row, RowRequest) and row.endpoint == "completions" and row.prompt == (5, 6)
    assert row.overrides == {"max_new_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": ("\n",)}
    chat = fmt.parse(_raw(_req("/v1/chat/completions", max_completion_tokens=4,
                               messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])))
    assert chat.endpoint == "chat" and chat.messages == ({"role": "user", "content": "hi"},)
    assert chat.overrides == {"max_new_tokens": 4}


@pytest.mark.parametrize(("line", "code", "custom_id"), [
    (b"{not json", "invalid_json", None),
    (json.dumps([1]).encode(), "invalid_request", None),
    (json.dumps({"url": "/v1/completions", "body": {}}).encode(), "invalid_request", None),
    (json.dumps(_req("/v1/embeddings", input="x")).encode(), "unknown_url", "c1"),
    (json.dumps({**_req(prompt="x"), "method": "GET"}).encode(), "invalid_request", "c1"),
    (json.dumps(_req(prompt=[])).encode(), "invalid_parameter", "c1"),
    (json.dumps(_req(prompt=["a", "b"])).encode(), "invalid_parameter", "c1"),
    (json.dumps(_req(prompt="x", max_tokens=0)).encode(), "invalid_parameter", "c1"),
    (json.dumps(_req(prompt="x", max_tokens=True)).encode(), "invalid_parameter", "c1"),
    (json.dumps(_req(prompt="x", temperature="hot")).encode(), "invalid_parameter", "c1"),
    (json.dumps(_req(prompt="x", n=17)).encode(), "invalid_parameter", "c1"),
    (json.dumps(_req(prompt="x", n=0)).encode(), "invalid_parameter", "c1"),
    (json.dumps(_req(prompt="x", logprobs=21)).encode(), "invalid_parameter", "c1"),
    (json.dumps(_req("/v1/chat/completions", messages=[{"role": "user", "content": "x"}], top_logprobs=2)).encode(),
     "invalid_parameter", "c1"),
    (json.dumps(_req("/v1/chat/completions", messages=[{"role": "user", "content": "x"}], logprobs=True,
                     top_logprobs=21)).encode(), "invalid_parameter", "c1"),
    (json.dumps(_req(prompt="x", logprobs=True)).encode(), "invalid_parameter", "c1"),
    (json.dumps(_req(prompt="x", frobnicate=1)).encode(), "invalid_parameter", "c1"),
    (json.dumps(_req(prompt="x", stop=[""])).encode(), "invalid_parameter", "c1"),
    (json.dumps(_req("/v1/chat/completions", messages=[{"role": "robot", "content": "x"}])).encode(),
     "invalid_parameter", "c1"),
])
def test_bad_openai_rows_become_errors_with_their_custom_id(line: bytes, code: str, custom_id: str | None) -> None:
    row = OpenAIBatchFormat().parse(RawRow(4, 9, line))
    assert isinstance(row, RowError) and (row.code, row.custom_id, row.index) == (code, custom_id, 4)
    out = OpenAIBatchFormat().error_row(row)
    assert out["custom_id"] == custom_id and out["response"] is None and out["error"]["code"] == code
    assert out["error"]["message"].startswith("line 9: ")


def test_format_detection(tmp_path: Path) -> None:
    batch, simple, text = tmp_path / "b.jsonl", tmp_path / "s.jsonl", tmp_path / "t.txt"
    batch.write_text("\n" + json.dumps(_req(prompt="x")) + "\n")
    simple.write_text(json.dumps({"prompt": "x"}) + "\n")
    text.write_text(json.dumps(_req(prompt="x")) + "\n")
    assert input_format(InputSource.file(batch)).name == "openai"
    assert input_format(InputSource.file(simple)).name == "simple"
    assert input_format(InputSource.file(text)).name == "simple"  # a .txt file is text rows
    assert input_format(InputSource.file(simple), "openai").name == "openai"
    with pytest.raises(ValueError, match="input-format"):
        input_format(InputSource.file(simple), "csv")


def test_result_rows_of_both_formats() -> None:
    job = RowJob(RowRequest(3, 4, "completions", prompt=(1, 2), custom_id="x"), (1, 2), SamplingParams(temperature=0.0))
    result = RowResult((7, 8, 9), None, "length", 4, 3)
    line = OpenAIBatchFormat().result_row(job, result, "tiny")
    body = line["response"]["body"]
    assert line["custom_id"] == "x" and line["error"] is None and line["response"]["status_code"] == 200
    assert body["choices"][0]["token_ids"] == [7, 8, 9]  # no tokenizer: the tokens are the output
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert body["model"] == "tiny" and body["object"] == "text_completion"
    chat = RowJob(RowRequest(0, 1, "chat", messages=({"role": "user", "content": "q"},), custom_id="y"), (1,),
                  SamplingParams(temperature=0.0))
    chat_body = OpenAIBatchFormat().result_row(chat, RowResult((5,), "hi", "stop"), "m")["response"]["body"]
    assert chat_body["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert "token_ids" not in chat_body["choices"][0]
    simple = SimpleFormat().result_row(RowJob(RowRequest(2, 3, prompt="p"), (1,), SamplingParams(temperature=0.0)),
                                       result, "m")
    assert simple == {"index": 2, "prompt": "p", "text": None, "token_ids": [7, 8, 9], "finish_reason": "length",
                      "num_drafted": 4, "num_accepted": 3}


# ------------------------------------------------------------------------------------------------ prepare


class FakeTokenizer:
    """Characters are tokens: 'a' -> 0 ... ; '|' is one token, so '|' as a stop string is a stop id."""

    chat_template = "{{ messages }}"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) - ord("a") if c != "|" else 30 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join("|" if t == 30 else chr(t + ord("a")) for t in ids)

    def apply_chat_template(self, messages: list[dict], tokenize: bool, add_generation_prompt: bool) -> str:
        return "".join(m["content"] for m in messages) + "z"


def test_prepare_checks_limits_and_gives_each_row_its_parameters() -> None:
    defaults = SamplingParams(max_new_tokens=5, temperature=0.7, seed=100)
    prep = Preparer(FakeTokenizer(), Limits(vocab_size=40, context=8, max_seq_len=6), defaults, chunk_size=2)
    job = prep(RowRequest(5, 6, prompt="abc"))
    # the job's seed as it is: the row's stream is (seed, its index), not a per-chunk seed (runtime/rng.py)
    assert job.token_ids == (0, 1, 2) and job.params == SamplingParams(max_new_tokens=5, temperature=0.7, seed=100)
    own = prep(RowRequest(0, 1, "completions", prompt=(1,), overrides={"seed": 9, "temperature": 0.0,
                                                                       "max_new_tokens": 2, "stop": ("|", "bc")}))
    assert own.params.seed == 9 and own.params.greedy and own.params.max_new_tokens == 2
    assert own.params.stop == ("|", "bc") and own.params.stop_token_ids == ()  # the engine stops on them
    chat = prep(RowRequest(1, 2, "chat", messages=({"role": "user", "content": "ab"},)))
    assert chat.token_ids == (0, 1, 25)
    errors = [prep(RowRequest(0, 1, prompt=p)) for p in ("", "abcdef", (40,))]
    assert [e.code for e in errors] == ["empty_prompt", "prompt_too_long", "invalid_request"]
    assert "6 tokens per row" in errors[1].message
    bad = prep(RowRequest(0, 1, "completions", prompt="a", overrides={"top_p": 0.0}))
    assert isinstance(bad, RowError) and bad.code == "invalid_parameter" and "top_p" in bad.message
    no_tok = Preparer(None, Limits(40, 8), defaults, 2)
    assert no_tok(RowRequest(0, 1, prompt="abc")).code == "invalid_request"
    assert no_tok(RowRequest(0, 1, "chat", messages=({"role": "user", "content": "x"},))).code == "no_chat_template"


# ------------------------------------------------------------------------------------------------ manifest


def _manifest(**changes: object) -> Manifest:
    base = dict(input={"sha256": "ab", "rows": 3, "format": "simple"}, models={"target": "t1", "draft": None},
                engine={"dtype": "float32", "max_seq_len": 64}, sampling={"temperature": 0.0, "stop_token_ids": []},
                chunk_size=2, info={"input": "/x"})
    return Manifest(**{**base, **changes})


def test_manifest_names_the_first_field_that_differs(tmp_path: Path) -> None:
    a = _manifest()
    assert a.first_difference(_manifest(info={"input": "/moved"})) is None  # info is not compared
    assert a.first_difference(Manifest.from_json(a.to_json())) is None
    diff = _manifest(sampling={"temperature": 0.7, "stop_token_ids": []}).first_difference(a)
    assert diff == "sampling.temperature: 0.0 in the output's manifest, 0.7 now"
    assert _manifest(chunk_size=4).first_difference(a).startswith("chunk_size: 2")
    assert _manifest(models={"target": "t2", "draft": None}).first_difference(a).startswith("models.target")
    path = tmp_path / "m.json"
    path.write_text(json.dumps({**json.loads(a.to_json()), "format_version": 99}))
    with pytest.raises(ManifestError, match="format_version 99"):
        read_manifest(path)
    with pytest.raises(ManifestError, match="missing"):
        read_manifest(tmp_path / "none.json")


# ------------------------------------------------------------------------------------------------ output file


def _input(tmp_path: Path, n: int) -> tuple[SimpleFormat, InputSource]:
    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(n)))
    return SimpleFormat(), InputSource.file(f)


def _resume(out: OutputFile, fmt: SimpleFormat, source: InputSource, n: int, chunk: int = 2):
    return out.resume(fmt, (fmt.parse(r) for r in source.rows()), n, chunk)


def test_output_is_locked_refuses_to_clobber_and_resumes_whole_chunks(tmp_path: Path) -> None:
    fmt, source = _input(tmp_path, 5)
    path = tmp_path / "out.jsonl"
    with OutputFile(path) as out:
        out.start(_manifest())
        with pytest.raises(OutputFileError, match="another specoffload run"):
            OutputFile(path, resume=True)  # a second run fails at once
        out.append([{"index": i, "prompt": f"p{i}", "text": "t\u2028x"} for i in range(3)])
    assert manifest_path(path).exists()
    assert path.read_text().count("\n") == 3 and "\\u2028" in path.read_text()  # one row per line, for any reader
    with pytest.raises(OutputFileError, match="already exists"):
        OutputFile(path)
    with path.open("a") as f:
        f.write('{"index": 3, "pro')  # killed mid-write
    with OutputFile(path, resume=True) as out:
        out.start(_manifest())
        kept = _resume(out, fmt, source, 5)
    assert (kept.rows, kept.dropped) == (2, 1)  # chunk {2, 3} is unfinished: row 2 is generated again
    assert [json.loads(line)["index"] for line in path.read_text().splitlines()] == [0, 1]
    with OutputFile(path, resume=True) as out, pytest.raises(OutputFileError, match="temperature"):
        out.start(_manifest(sampling={"temperature": 1.0, "stop_token_ids": []}))


@pytest.mark.parametrize(("rows", "message"), [
    ([0, 0], "duplicate index"),
    ([0, 2], "out of order"),
    ([0, 9], "another input"),
    ([0, "1"], "not an integer"),
    ([0, 1.0], "not an integer"),
    ([0, True], "not an integer"),
])
def test_resume_rejects_duplicate_or_malformed_indices(tmp_path: Path, rows: list, message: str) -> None:
    fmt, source = _input(tmp_path, 3)
    path = tmp_path / "out.jsonl"
    with OutputFile(path) as out:
        out.start(_manifest())
        out.append([{"index": i} for i in rows])
    with OutputFile(path, resume=True) as out, pytest.raises(OutputFileError, match=message):
        out.start(_manifest())
        _resume(out, fmt, source, 3)


def test_resume_of_an_openai_output_checks_custom_ids(tmp_path: Path) -> None:
    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps({**_req(prompt="x"), "custom_id": f"r{i}"}) + "\n" for i in range(3)))
    fmt, source = OpenAIBatchFormat(), InputSource.file(f)
    path = tmp_path / "out.jsonl"
    with OutputFile(path) as out:
        out.start(_manifest())
        out.append([{"custom_id": "r0", "response": {}, "error": None}, {"custom_id": "r0", "response": {}}])
    with OutputFile(path, resume=True) as out, pytest.raises(OutputFileError, match="custom_id 'r0' where"):
        out.start(_manifest())
        out.resume(fmt, (fmt.parse(r) for r in source.rows()), 3, 1)


def test_a_failed_write_leaves_whole_rows_and_no_temporary_file(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "out.jsonl"
    with OutputFile(path) as out:
        out.start(_manifest())
        out.append([{"index": 0}])
        calls = []

        def full(fd: int, data: memoryview, offset: int) -> int:
            calls.append(offset)
            if len(calls) == 1:
                return os.pwrite(fd, data[:5], offset)  # a partial write, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(output_module.os, "pwrite", full)
        with pytest.raises(OutputFileError, match="No space left on device.*--resume"):
            out.append([{"index": 1}, {"index": 2}])
    assert path.read_text() == '{"index": 0}\n'  # the partial chunk was cut back
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "out.jsonl.manifest.json"]

    def no_room(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.undo()
    monkeypatch.setattr("specoffload.runtime.offline.manifest.os.fsync", no_room)
    with OutputFile(path, overwrite=True) as out, pytest.raises(OSError, match="No space"):
        out.start(_manifest())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "out.jsonl.manifest.json"]


def test_dump_row_escapes_unicode_line_breaks() -> None:
    text = dump_row({"t": "a\u2028b\u2029c\x85d\ne"})
    assert text.count("\n") == 1 and len(text.splitlines()) == 1
    assert json.loads(text) == {"t": "a\u2028b\u2029c\x85d\ne"}


# ------------------------------------------------------------------------------------------------ chunks


def _jobs(n: int) -> list:
    return [RowJob(RowRequest(i, i + 1, prompt=(i,)), (i,), SamplingParams(temperature=0.0)) if i % 3 else
            RowError(i, i + 1, "invalid_json", "bad") for i in range(n)]


def test_chunks_keep_error_rows_in_place_and_release_in_order() -> None:
    chunks = list(chunked(iter(_jobs(7)), 3))
    assert [c.number for c in chunks] == [0, 1, 2]
    assert [[r.index for r in c.rows] for c in chunks] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [len(c.jobs) for c in chunks] == [2, 2, 0]
    assert errors_only(chunks[2]) is not None and errors_only(chunks[0]) is None
    prompts, params, keys = chunks[0].payload()
    assert prompts == [[1], [2]] and params[0]["max_new_tokens"] == 16  # (SamplingParams' default: vLLM's)
    assert keys == [r.index for r in chunks[0].jobs]  # each row's own random-stream key
    order = InOrder(first=0)
    done = [ChunkDone(c, ()) for c in chunks]
    assert order.add(done[2]) == [] and order.add(done[1]) == []
    assert [d.number for d in order.add(done[0])] == [0, 1, 2]
    assert order.add(done[1]) == []  # a second result for a written chunk is dropped


def test_lease_book_requeues_lost_chunks_first_and_completes_each_once() -> None:
    chunks = [Chunk(n, ()) for n in range(10, 16)]
    book = LeaseBook(iter(chunks), window=3)
    a, b, c = book.next(), book.next(), book.next()
    assert [a.number, b.number, c.number] == [10, 11, 12]
    assert book.next() is None  # three ahead of the oldest unfinished (10): the window is full
    for chunk, worker in ((a, "w0"), (b, "w1"), (c, "w0")):
        book.lease(chunk, worker)
    assert book.complete(11) and book.next() is None  # 10 still holds the window
    assert book.lose(10).number == 10 and book.worker_of(10) is None and book.lost == 1
    assert book.next().number == 10  # a lost chunk goes first
    book.lease(a, "w1")
    assert book.complete(10) and not book.complete(10)  # a late duplicate is dropped
    assert [book.next().number, book.next().number] == [13, 14]
    assert book.complete(12) and book.complete(13) and book.complete(14)
    assert book.next().number == 15 and book.complete(15)
    assert book.next() is None and book.done


def test_progress_eta_before_the_first_row_is_a_bound_from_tokens() -> None:
    """No row written yet: the ETA is the tokens left if every row ran to max_tokens, at the live rate (at most);
    once rows are written, the rows left at the rows-per-second so far."""
    import io

    from specoffload.runtime.offline.progress import Progress

    committed = [0]
    progress = Progress(total=4, enabled=True, interval=0, stream=io.StringIO(), max_tokens=100)
    progress.generating(lambda: committed[0])
    progress.start -= 10.0  # ten seconds of generating
    committed[0] = 200  # 20 tok/s; 4 rows x 100 tokens - 200 committed = 200 left: at most 10 s
    line = progress.line()
    assert "0/4 rows" in line and "ETA at most 0m10s (rows at max tokens)" in line
    assert "ETA ?" in Progress(total=4, enabled=False, interval=0, stream=io.StringIO()).line()  # no bound known
    progress.update(rows=2, failed=0, tokens=200, drafted=0, accepted=0)
    assert "2/4 rows" in progress.line() and "ETA 0m10s" in progress.line()
    progress.close()
