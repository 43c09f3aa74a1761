"""Hostile input rows: each becomes one error row naming what is wrong, and the job goes on (issue 25, items 1-2).

Bounds: the line's length (read in pieces, never held whole), JSON nesting depth, number lengths and item counts
(scanned before json.loads), the prompt's tokens (counted on a bounded prefix), and every sampling field's range.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specoffload.runtime.bounded_encode import BOUNDARY_SLACK, PIECE_CHARS, TooLong, _pieces, encode_bounded
from specoffload.runtime.json_bounds import BoundsError, JsonBounds, loads_bounded
from specoffload.runtime.offline.openai import OpenAIBatchFormat
from specoffload.runtime.offline.rows import RowError, RowRequest
from specoffload.runtime.offline.simple import SimpleFormat
from specoffload.runtime.offline.source import InputSource, RawRow
from specoffload.runtime.param_ranges import SEED_MAX, check_sampling
from specoffload.runtime.sampling import SamplingParams


def add_byte_tokenizer(src: Path, dst: Path) -> Path:
    """A copy of checkpoint `src` with a byte-level tokenizer (one token per byte, ids 3..258; bos 1, eos 2)."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(src, dst, dirs_exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {c: i + 3 for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def llama_tok(tiny_models, tmp_path_factory) -> Path:
    return add_byte_tokenizer(tiny_models["llama"], tmp_path_factory.mktemp("tok") / "llama_tok")


def _req(custom_id: str, **body: object) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": "hello", "max_tokens": 3, **body}})


# ---- the JSON scan ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("data, code", [
    (b"[" * 200_000 + b"]" * 200_000, "too_deep"),
    (b'{"a": ' + b"9" * 5000 + b"}", "number_too_long"),
    (b'{"a": 1.' + b"0" * 100 + b"1}", "number_too_long"),
    (b"[" + b"0," * 300 + b"0]", "too_many_items"),
    (b"[" * 33 + b"]" * 33, "too_deep"),
])
def test_the_scan_refuses_before_json_loads(data: bytes, code: str) -> None:
    with pytest.raises(BoundsError) as err:
        loads_bounded(data, JsonBounds(max_depth=32, max_digits=64, max_items=100))
    assert err.value.code == code


@pytest.mark.parametrize("data", [
    b"[" * 32 + b"]" * 32,
    b'{"s": "' + b"[" * 1000 + b'", "n": ' + b"9" * 64 + b"}",  # brackets inside a string do not nest
    b'{"s": "\\"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}',  # nor after an escaped quote
    b'["a,b,c,d", 1]',
])
def test_the_scan_passes_what_is_in_bounds(data: bytes) -> None:
    assert loads_bounded(data, JsonBounds(max_depth=32, max_digits=64, max_items=100)) == json.loads(data)


# ---- lines -----------------------------------------------------------------------------------------------------------
def test_an_over_long_line_is_read_in_pieces_and_becomes_an_error_row(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    long_line = _req("big", prompt="x" * 5000).encode()
    content = b"\n".join([_req("a").encode(), long_line, b"", _req("b").encode(), b"y" * 151]) + b"\n"
    path.write_bytes(content)
    source = InputSource.file(path, max_line_bytes=150)
    rows = list(source.rows())
    assert [r.lineno for r in rows] == [1, 2, 4, 5]
    assert rows[1].too_long == (len(long_line), 150) and len(rows[1].data) <= 4096
    assert rows[3].too_long == (151, 150)
    assert source.identity() == (hashlib.sha256(content).hexdigest(), 4)
    fmt = OpenAIBatchFormat()
    err = fmt.parse(rows[1])
    assert isinstance(err, RowError) and err.code == "line_too_long" and err.custom_id == "big"
    assert f"{len(long_line)} bytes" in err.message and "150 bytes" in err.message
    assert isinstance(fmt.parse(rows[2]), RowRequest)
    assert SimpleFormat(text=True).parse(rows[3]).code == "line_too_long"


def test_a_line_of_exactly_the_limit_is_read(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_bytes(b"a" * 100 + b"\r\n" + b"b" * 100)
    rows = list(InputSource.file(path, max_line_bytes=100).rows())
    assert [(r.data, r.too_long) for r in rows] == [(b"a" * 100, None), (b"b" * 100, None)]


# ---- ranges ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, field", [
    ({"seed": 2**64, "temperature": 0.5}, "'seed'"),
    ({"seed": -1}, "'seed'"),
    ({"max_tokens": 2**40}, "'max_tokens'"),
    ({"top_k": 2**40}, "'top_k'"),
    ({"top_p": 0}, "'top_p'"),
    ({"top_p": 1.5}, "'top_p'"),
    ({"temperature": -0.5}, "'temperature'"),
])
def test_out_of_range_fields_are_error_rows_naming_the_field(body: dict, field: str) -> None:
    row = OpenAIBatchFormat().parse(RawRow(0, 1, _req("c", **body).encode()))
    assert isinstance(row, RowError) and row.code == "invalid_parameter" and field in row.message


def test_the_range_ends_are_accepted() -> None:
    for body in ({"seed": SEED_MAX}, {"seed": 2**63}, {"seed": 0}, {"top_k": -1}, {"top_p": 1}, {"temperature": 0}):
        assert isinstance(OpenAIBatchFormat().parse(RawRow(0, 1, _req("c", **body).encode())), RowRequest), body
    check_sampling(SamplingParams(seed=SEED_MAX, temperature=1.0, top_k=2**31 - 1, max_new_tokens=2**31 - 1))
    with pytest.raises(ValueError, match="'seed'"):
        check_sampling(SamplingParams(temperature=0.0, seed=SEED_MAX + 1))


def test_out_of_range_params_are_refused_where_made_and_the_engine_names_the_request(tiny_models) -> None:
    """A SamplingParams checks its ranges when it is made (param_ranges.py): no engine, job or wire ever holds one
    out of range; the engine names the request of what is not a SamplingParams at all."""
    from specoffload.runtime.config import EngineConfig
    from specoffload.runtime.engine import Engine, PromptError

    for kwargs, field in ((dict(seed=2**64, temperature=0.5), "'seed'"), (dict(max_new_tokens=2**40),
                                                                         "'max_new_tokens'"),
                          (dict(top_k=2**40), "'top_k'")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    engine = Engine(EngineConfig(tiny_models["llama"], max_batch_size=2))
    ok = SamplingParams(temperature=0.0, max_new_tokens=2)
    with pytest.raises(PromptError, match="request 1: params must be a SamplingParams"):
        engine.generate([[1, 5], [1, 6]], [ok, {"seed": 3}])
    with pytest.raises(PromptError, match="prompt 0 has 600 tokens"):
        engine.generate([[5] * 600], ok)
    assert len(engine.generate([[1, 5]], SamplingParams(seed=2**64 - 1, temperature=0.7, max_new_tokens=2))) == 1


# ---- the prompt's tokens, counted on a prefix ------------------------------------------------------------------------
class _CountingTokenizer:
    """One token per character; remembers the longest text it was asked to encode."""

    def __init__(self) -> None:
        self.longest = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.longest = max(self.longest, len(text))
        return [3] * len(text)


def test_a_long_prompt_is_refused_from_a_bounded_prefix() -> None:
    tok = _CountingTokenizer()
    refused = encode_bounded(tok, "word " * 2_000_000, limit=512)
    assert isinstance(refused, TooLong) and refused.at_least >= 512 and tok.longest <= PIECE_CHARS
    tok = _CountingTokenizer()
    assert len(encode_bounded(tok, "x" * (PIECE_CHARS + 10), limit=10**6)) == PIECE_CHARS + 10  # fits: exact ids


def test_piece_counts_bound_the_whole_count(llama_tok) -> None:
    """Pieces cut at whitespace never count more than BOUNDARY_SLACK tokens per cut over the whole text (measured on
    Qwen2.5's tokenizer too: at most 1 per cut on code, prose, random Unicode and whitespace runs)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_tok))
    text = "".join(f"def f{i}(x):\n    return x * {i}  # é ✓\n" for i in range(5000))
    pieces = list(_pieces(text))
    whole = len(tok.encode(text, add_special_tokens=False))
    counted = sum(len(tok.encode(p, add_special_tokens=False)) for p in pieces)
    assert len(pieces) > 2 and counted - BOUNDARY_SLACK * (len(pieces) - 1) <= whole


# ---- jobs ------------------------------------------------------------------------------------------------------------
def test_hostile_rows_are_error_rows_and_the_job_goes_on(llama_tok, tmp_path, capsys) -> None:
    from specoffload.runtime.cli import main

    lines = [_req("ok"), _req("s64", temperature=0.5, seed=2**64), _req("s63", temperature=0.5, seed=2**63),
             '{"custom_id": "deep", "body": ' + "[" * 200_000 + "]" * 200_000 + "}",
             '{"custom_id": "int", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": ' + "9" * 5000
             + "}}", _req("long", prompt="word " * 400_000), _req("mt", max_tokens=2**40)]
    prompts, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    rc = main(["generate", "--target", str(llama_tok), "--prompts", str(prompts), "-o", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 0 and "Traceback" not in err  # the job ran: failed rows are error rows (exit 0)
    rows = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert list(rows) == ["ok", "s64", "s63", "deep", "int", "long", "mt"]
    codes = {k: (r["error"] or {}).get("code") for k, r in rows.items()}
    assert codes == {"ok": None, "s64": "invalid_parameter", "s63": None, "deep": "too_deep",
                     "int": "number_too_long", "long": "prompt_too_long", "mt": "invalid_parameter"}
    assert "'seed'" in rows["s64"]["error"]["message"] and "'max_tokens'" in rows["mt"]["error"]["message"]


def test_simple_and_text_inputs_are_bounded_too(llama_tok, tmp_path, capsys) -> None:
    from specoffload.runtime.cli import main

    simple, txt = tmp_path / "p.jsonl", tmp_path / "p.txt"
    simple.write_text('{"prompt": "hi"}\n' + "[" * 100_000 + "\n" + '{"token_ids": [' + "1" * 300 + "]}\n")
    txt.write_text("hi\n" + "word " * 400_000 + "\n")
    for path, codes in ((simple, [None, "too_deep", "number_too_long"]), (txt, [None, "prompt_too_long"])):
        out = tmp_path / (path.name + ".out")
        rc = main(["generate", "--target", str(llama_tok), "--prompts", str(path), "-o", str(out), "--no-progress",
                   "--max-new-tokens", "2"])
        assert rc == 0 and "Traceback" not in capsys.readouterr().err
        assert [(r.get("error") or {}).get("code") for r in map(json.loads, out.read_text().splitlines())] == codes


def test_a_repeated_custom_id_stops_the_job_before_it_starts(tiny_models, tmp_path, capsys) -> None:
    from specoffload.runtime.cli import main

    prompts, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    prompts.write_text("\n".join([_req("a", prompt=[1, 5]), _req("b", prompt=[1, 6]), _req("a", prompt=[1, 7]),
                                  _req("b", prompt=[1, 8])]) + "\n")
    rc = main(["generate", "--target", str(tiny_models["llama"]), "--prompts", str(prompts), "-o", str(out),
               "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert f"{prompts}:3" in err[0] and "'a'" in err[0] and "line 1" in err[0]
    assert not out.exists() or out.read_text() == ""


def test_out_of_range_command_line_defaults_are_one_line(tiny_models, tmp_path, capsys) -> None:
    from specoffload.runtime.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"token_ids": [1, 5]}\n')
    rc = main(["generate", "--target", str(tiny_models["llama"]), "--prompts", str(prompts), "-o",
               str(tmp_path / "o.jsonl"), "--seed", str(2**64), "--temperature", "0.5", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "'seed'" in err[0], err


_RSS_JOB = textwrap.dedent("""
    import resource, sys
    from specoffload.runtime.cli import main
    rc = main(["generate", "--target", sys.argv[1], "--prompts", sys.argv[2], "-o", sys.argv[3], "--no-progress",
               "--max-new-tokens", "2"])
    print(rc, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux
""")


@pytest.mark.parametrize("line_kind", ["prompt", "over_limit"])
def test_a_10_mb_line_costs_no_more_than_100_mb(llama_tok, tmp_path, line_kind) -> None:
    """Peak RSS of a job with one 10 MB line within 100 MB of the same job without it: a prompt (under the 16 MiB
    line limit: parsed, then refused from a tokenized prefix) and a line over the limit (read in pieces)."""
    small = "".join(json.dumps({"prompt": f"p{i} hello"}) + "\n" for i in range(3))
    if line_kind == "prompt":
        big = json.dumps({"prompt": "word " * 2_000_000}) + "\n"  # 10 MB
    else:
        big = json.dumps({"prompt": "w" * 17_000_000}) + "\n"  # 17 MB: over the limit
    peaks = {}
    for name, text in (("without", small), ("with", small + big + small)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text(text)
        run = subprocess.run([sys.executable, "-c", _RSS_JOB, str(llama_tok), str(path), str(tmp_path / f"{name}.out")],
                             capture_output=True, text=True, timeout=300)
        rc, kib = run.stdout.split()[-2:]
        assert rc == "0", run.stderr[-2000:]  # the job ran (its failed row is an error row)
        peaks[name] = int(kib) / 1024
    print(line_kind, peaks)
    assert peaks["with"] - peaks["without"] < 100, peaks


# ---- property tests: the row reader never raises, and fails only with documented codes -------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from specoffload.runtime.offline.output import dump_row  # noqa: E402
from specoffload.runtime.offline.prepare import Limits, Preparer  # noqa: E402
from specoffload.runtime.offline.rows import RowResult  # noqa: E402

#: every code an error row of the reader or the preparer can carry (README, "Offline corpora")
ROW_ERROR_CODES = {"line_too_long", "invalid_utf8", "invalid_json", "too_deep", "number_too_long", "too_many_items",
                   "invalid_request", "unknown_url", "invalid_parameter", "empty_prompt", "prompt_too_long",
                   "no_chat_template"}
_text = st.text(max_size=10) | st.sampled_from(["\ud800", "a\udfff", "\ud83d\ude00", "\u2028"])
_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**80), 2**80) | st.floats() | _text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=25,
)
_bodies = st.fixed_dictionaries({}, optional={
    "prompt": _text | st.lists(st.integers(-5, 2**70), max_size=4) | _values,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "robot"]), "content": _values}),
                         max_size=2) | _values,
    "max_tokens": st.integers(-(2**70), 2**70) | _values, "temperature": st.floats() | _values,
    "top_p": st.floats() | _values, "top_k": st.integers(-(2**70), 2**70) | _values,
    "seed": st.integers(-(2**70), 2**70) | _values, "stop": _values, "n": _values, "model": _values})
_batch_rows = st.fixed_dictionaries({"custom_id": _text | _values,
                                     "url": st.sampled_from(["/v1/completions", "/v1/chat/completions", "/x"]),
                                     "body": _bodies | _values}, optional={"method": st.sampled_from(["POST", "GET"])})
_hostile = st.builds(lambda n, c: c * n, st.integers(0, 60_000),
                     st.sampled_from([b"[", b"{", b'{"a":', b"9", b'"', b"\\", b"\xff", b"[1,"]))
_lines = (st.binary(max_size=200) | _hostile | _values.map(lambda v: json.dumps(v).encode())
          | _batch_rows.map(lambda v: json.dumps(v).encode()))


class _ByteTokenizer:
    chat_template = "x"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if any("\ud800" <= c <= "\udfff" for c in text):
            raise TypeError("TextEncodeInput must be Union[...]")  # what a fast tokenizer raises on a lone surrogate
        return [3 + b for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(t - 3 for t in ids).decode("utf-8", "replace")

    def apply_chat_template(self, messages: list, tokenize: bool = False, add_generation_prompt: bool = True) -> str:
        return "".join(m["content"] for m in messages)


@settings(max_examples=300, deadline=None)
@given(line=_lines, limit=st.sampled_from([64, 1 << 20]))
def test_the_row_reader_never_raises_and_uses_documented_codes(line: bytes, limit: int) -> None:
    raw = RawRow(0, 1, line[:4096], (len(line), limit)) if len(line) > limit else RawRow(0, 1, line)
    preparer = Preparer(_ByteTokenizer(), Limits(vocab_size=300, context=64), SamplingParams(temperature=0.0),
                        chunk_size=4)
    for fmt in (SimpleFormat(), SimpleFormat(text=True), OpenAIBatchFormat()):
        row = fmt.parse(raw)
        assert isinstance(row, (RowRequest, RowError))
        prepared = preparer(row)
        if isinstance(prepared, RowError):
            assert prepared.code in ROW_ERROR_CODES, prepared
            assert "\n" not in prepared.message
            dump_row(fmt.error_row(prepared)).encode("utf-8")  # the error row is writable
        else:
            result = RowResult(prepared.token_ids[:2], "out", "stop")
            dump_row(fmt.result_row(prepared, result, "m")).encode("utf-8")


def test_format_detection_survives_a_hostile_first_row(tmp_path: Path) -> None:
    from specoffload.runtime.offline.formats import input_format

    deep, big = tmp_path / "deep.jsonl", tmp_path / "big.jsonl"
    deep.write_bytes(b"[" * 200_000 + b"\n" + _req("a").encode() + b"\n")
    big.write_bytes(_req("big", prompt="x" * 300).encode() + b"\n")
    assert input_format(InputSource.file(deep)).name == "simple"
    assert input_format(InputSource.file(big, max_line_bytes=100)).name == "openai"  # its head names a custom_id
