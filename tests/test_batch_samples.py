"""OpenAI batch rows with `n` (independent samples, gathered into the row's one output line) and `logprobs`
(completions and chat shapes); the simple format unchanged."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from specoffload.runtime.cli import main
from specoffload.runtime.offline.chunks import Chunk
from specoffload.runtime.offline.openai import OpenAIBatchFormat
from specoffload.runtime.offline.rows import RowError, RowJob, RowRequest, RowResult
from specoffload.runtime.offline.simple import SimpleFormat
from specoffload.runtime.offline.source import RawRow
from specoffload.runtime.sampling import SamplingParams


def _line(custom_id: str, prompt: object, url: str = "/v1/completions", **body: object) -> str:
    key = "messages" if url == "/v1/chat/completions" else "prompt"
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {key: prompt, **body}})


def _parse(line: str, index: int = 0):
    return OpenAIBatchFormat().parse(RawRow(index, index + 1, line.encode()))


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _choices(rows: list[dict]) -> list[list[dict]]:
    """Each row's choices without what is random per run (ids, timestamps)."""
    return [r["response"]["body"]["choices"] if r["response"] else r["error"]["code"] for r in rows]


def test_rows_parse_n_and_logprobs() -> None:
    row = _parse(_line("a", [5], n=3, logprobs=2))
    assert not isinstance(row, RowError) and row.overrides["n"] == 3 and row.overrides["logprobs"] == 2
    chat = _parse(_line("c", [{"role": "user", "content": "hi"}], "/v1/chat/completions", logprobs=True,
                        top_logprobs=4, n=2))
    assert not isinstance(chat, RowError) and chat.overrides["logprobs"] == 4 and chat.overrides["n"] == 2
    plain = _parse(_line("d", [{"role": "user", "content": "hi"}], "/v1/chat/completions", logprobs=True))
    assert plain.overrides["logprobs"] == 0
    off = _parse(_line("e", [{"role": "user", "content": "hi"}], "/v1/chat/completions", logprobs=False))
    assert "logprobs" not in off.overrides
    for bad in (_line("x", [5], n=17), _line("x", [5], n=True), _line("x", [5], logprobs=-1),
                _line("x", [5], logprobs=True), _line("x", [5], logprobs=21),
                _line("x", [{"role": "user", "content": "hi"}], "/v1/chat/completions", logprobs=2)):
        parsed = _parse(bad)
        assert isinstance(parsed, RowError) and parsed.code == "invalid_parameter", bad


def test_chunk_jobs_are_one_per_sample_with_distinct_reproducible_keys() -> None:
    two = RowJob(RowRequest(4, 5), (1, 2), SamplingParams(n=2, temperature=1.0))
    one = RowJob(RowRequest(5, 6), (3,), SamplingParams(temperature=0.0))
    chunk = Chunk(2, (two, RowError(6, 7, "empty_prompt", "x"), one))
    jobs = chunk.jobs
    assert [(j.index, j.sample, j.key) for j in jobs] == [(4, 0, 4), (4, 1, "4:1"), (5, 0, 5)]
    assert chunk.payload()[2] == [4, "4:1", 5] and jobs[2] is one  # a row with n = 1 keys as it always did


class _Tok:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{i}>" for i in ids)


def _sample(tokens: list[int]) -> RowResult:
    # per token: the chosen one, then the top-2 (ranks 1, 2); the chosen token is the top one except at token 1
    entries = tuple(((t, -0.5 - i, 1 if i != 1 else 3), (t if i != 1 else 99, -0.5 - i if i != 1 else -0.1, 1),
                     (7, -2.0, 2)) for i, t in enumerate(tokens))
    return RowResult(tuple(tokens), "".join(f"<{t}>" for t in tokens), "length", logprobs=entries)


def test_completion_and_chat_logprobs_shapes() -> None:
    fmt = OpenAIBatchFormat()
    req = RowRequest(0, 1, "completions", prompt=(5,), custom_id="a")
    job = RowJob(req, (5,), SamplingParams(temperature=0.0, n=2, logprobs=2))
    row = fmt.result_row(job, [_sample([10, 11]), _sample([12, 13])], "m", tokenizer=_Tok())
    body = row["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["usage"]["completion_tokens"] == 4
    lp = body["choices"][1]["logprobs"]
    assert lp["tokens"] == ["<12>", "<13>"] and lp["token_logprobs"] == [-0.5, -1.5]
    assert lp["top_logprobs"] == [{"<12>": -0.5, "<7>": -2.0}, {"<13>": -1.5, "<99>": -0.1, "<7>": -2.0}]
    assert lp["text_offset"] == [0, 4]

    chat = RowJob(RowRequest(1, 2, "chat", messages=({"role": "user", "content": "x"},), custom_id="c"), (5,),
                  SamplingParams(temperature=0.0, logprobs=2))
    body = fmt.result_row(chat, _sample([10, 11]), "m", tokenizer=_Tok())["response"]["body"]
    (choice,) = body["choices"]
    assert body["object"] == "chat.completion" and choice["index"] == 0
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == ["<10>", "<11>"] and content[1]["logprob"] == -1.5
    assert content[0]["bytes"] == list(b"<10>")
    assert content[1]["top_logprobs"] == [{"token": "<99>", "logprob": -0.1, "bytes": list(b"<99>")},
                                          {"token": "<7>", "logprob": -2.0, "bytes": list(b"<7>")}]
    neg_inf = RowResult((3,), None, "length", logprobs=(((3, -math.inf, 9),),))
    lp = fmt.result_row(RowJob(req, (5,), SamplingParams(temperature=0.0, logprobs=0)), neg_inf,
                        "m")["response"]["body"]
    assert lp["choices"][0]["logprobs"]["token_logprobs"] == [-9999.0]  # JSON has no infinity
    assert lp["choices"][0]["logprobs"]["tokens"] == ["token_id:3"] and lp["choices"][0]["token_ids"] == [3]


def test_simple_rows_are_unchanged() -> None:
    job = RowJob(RowRequest(2, 3, prompt="p"), (1,), SamplingParams(temperature=0.0))
    row = SimpleFormat().result_row(job, RowResult((4, 5), "ab", "length", 2, 1), "m")
    assert row == {"index": 2, "prompt": "p", "text": "ab", "token_ids": [4, 5], "finish_reason": "length",
                   "num_drafted": 2, "num_accepted": 1}


def test_n_samples_round_trip_reproducible_and_resumed(tiny_models, tmp_path, capsys) -> None:
    """n = 2 sampled rows give two different choices, the same on a second run and after a resume; a logprobs row
    has one entry per token, the target's, as Engine.generate reports them."""
    from specoffload.runtime import Engine, EngineConfig

    lines = [_line("a", [5, 6, 7], n=2, max_tokens=6),
             _line("b", [9, 4], max_tokens=5),
             _line("c", [8, 3], n=3, logprobs=2, max_tokens=4),
             _line("bad", [9], n=99),
             _line("g", [5, 6, 7], n=2, max_tokens=6, temperature=0),
             _line("lp", [5, 6, 7], logprobs=3, max_tokens=4, temperature=0)]
    batch, out = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    batch.write_text("\n".join(lines) + "\n")
    cli = ["generate", "--model", str(tiny_models["llama"]), "--draft", str(tiny_models["draft"]), "-k", "2",
           "--prompts", str(batch), "-o", str(out), "--ignore-eos", "--no-progress", "--temperature", "1.0",
           "--seed", "7", "--chunk-size", "2"]
    assert main(cli) == 0
    first = _rows(out)
    assert [r["custom_id"] for r in first] == ["a", "b", "c", "bad", "g", "lp"]
    got = _choices(first)
    assert [len(c) if isinstance(c, list) else c for c in got] == [2, 1, 3, "invalid_parameter", 2, 1]
    for choices in got[:3] + got[4:]:
        assert [c["index"] for c in choices] == list(range(len(choices)))
    a0, a1 = (c["token_ids"] for c in got[0])
    assert len(a0) == len(a1) == 6 and a0 != a1  # independent samples
    assert got[4][0]["token_ids"] == got[4][1]["token_ids"]  # greedy: identical samples (as vLLM)
    assert first[0]["response"]["body"]["usage"]["completion_tokens"] == 12
    for choice in got[2]:
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
        assert lp["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        assert all(t in top and 1 <= len(top) <= 3 for t, top in zip(lp["tokens"], lp["top_logprobs"]))
    assert got[0][0]["logprobs"] is None

    engine = Engine(EngineConfig(tiny_models["llama"]))
    (ref,) = engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3))
    lp = got[5][0]["logprobs"]
    assert got[5][0]["token_ids"] == ref.token_ids
    # the target's log-probabilities (fp32; batched verify beside other rows: to 1e-4)
    assert lp["token_logprobs"] == pytest.approx([e[0][1] for e in ref.logprobs], rel=1e-4, abs=1e-5)
    for top, e in zip(lp["top_logprobs"], ref.logprobs):
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx([x for _, x, _ in e[1:]], rel=1e-4, abs=1e-5)
    engine.close()

    assert main([*cli, "--overwrite"]) == 0
    assert _choices(_rows(out)) == got  # reproducible: the same samples on a second run
    text = out.read_text().splitlines(keepends=True)
    out.write_text("".join(text[:3]) + text[3][:9])  # killed while writing the second chunk
    capsys.readouterr()
    assert main([*cli, "--resume"]) == 0
    assert "2 of 6 prompts already done" in capsys.readouterr().err
    resumed = _choices(_rows(out))
    # and after a resume: the same samples; log-probabilities to fp32 rounding (other rows share the batch now)
    assert _without_logprobs(resumed) == _without_logprobs(got)
    for new, old in zip(resumed[2][0]["logprobs"]["token_logprobs"], got[2][0]["logprobs"]["token_logprobs"]):
        assert new == pytest.approx(old, rel=1e-4, abs=1e-5)


def _without_logprobs(rows: list) -> list:
    return [[{k: v for k, v in c.items() if k != "logprobs"} | {"tokens": (c["logprobs"] or {}).get("tokens")}
             for c in r] if isinstance(r, list) else r for r in rows]
