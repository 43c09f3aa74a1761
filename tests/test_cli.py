"""`specoffload generate`: prompts file in, JSONL out, clear errors."""

from __future__ import annotations

import json

import pytest

from specoffload.runtime.cli import main


def test_generate_writes_jsonl(tiny_models, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"token_ids": [5, 6, 7]}) + "\n" + json.dumps({"token_ids": [9]}) + "\n")
    out = tmp_path / "out" / "completions.jsonl"
    rc = main(["generate", "--target", str(tiny_models["mixtral"]), "--draft", str(tiny_models["draft"]),
               "--prompts", str(prompts), "-o", str(out), "--max-new-tokens", "6", "-k", "2", "--ignore-eos",
               "--no-progress"])
    assert rc == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1]
    assert all(len(r["token_ids"]) == 6 and r["finish_reason"] == "length" for r in records)
    assert all(r["num_drafted"] > 0 for r in records)
    assert "tokens/s" in capsys.readouterr().err


def test_bad_prompt_file_is_one_clear_line(tiny_models, tmp_path, capsys):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"token_ids": [1, 2]}\n{not json\n')
    rc = main(["generate", "--target", str(tiny_models["llama"]), "--prompts", str(prompts), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 0  # the job ran: the bad row is an error row in its place, counted on stderr
    assert "1 of 2 rows failed" in err
    assert "specoffload: error:" in err and "bad.jsonl:2" in err and "Traceback" not in err


def test_missing_checkpoint_and_bad_k(tmp_path, tiny_models, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    assert main(["generate", "--target", str(tmp_path / "missing"), "--prompts", str(prompts)]) == 2
    assert "missing" in capsys.readouterr().err
    rc = main(["generate", "--target", str(tiny_models["llama"]), "--draft", str(tiny_models["draft"]),
               "--prompts", str(prompts), "-k", "-1"])
    assert rc == 2
    assert "num_draft_tokens" in capsys.readouterr().err


def test_generate_offloaded_with_trace_and_placement(tiny_models, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"token_ids": [5, 6, 7]}) + "\n" + json.dumps({"token_ids": [9, 4]}) + "\n")
    out, trace = tmp_path / "out.jsonl", tmp_path / "trace.json"
    common = ["generate", "--target", str(tiny_models["llama"]), "--prompts", str(prompts), "--max-new-tokens", "5",
              "--ignore-eos", "--no-progress", "--temperature", "0"]
    assert main([*common, "-o", str(tmp_path / "ref.jsonl")]) == 0
    rc = main([*common, "-o", str(out), "--draft", str(tiny_models["draft"]), "--device-memory", "1000KiB",
               "--max-seq-len", "32", "--batch-size", "2", "-k", "2", "--show-placement", "--trace", str(trace)])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "ring buffers" in err and "busy" in err
    ref = [json.loads(line)["token_ids"] for line in (tmp_path / "ref.jsonl").read_text().splitlines()]
    assert [json.loads(line)["token_ids"] for line in out.read_text().splitlines()] == ref
    assert json.loads(trace.read_text())["traceEvents"]


def test_too_small_device_memory_is_one_clear_line(tiny_models, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"token_ids": [5, 6]}) + "\n")
    rc = main(["generate", "--target", str(tiny_models["llama"]), "--prompts", str(prompts),
               "--device-memory", "10KiB", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "at least" in err and "Traceback" not in err


def test_plan_prints_policy_table_and_alternatives(tiny_models, tmp_path, capsys, monkeypatch):
    from specoffload.runtime.offload import profiler

    monkeypatch.setattr(profiler, "PROFILE_DIR", tmp_path / "profiles")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": [5 + i, 6, 7]}) + "\n" for i in range(4)))
    rc = main(["plan", "--target", str(tiny_models["llama"]), "--draft", str(tiny_models["draft"]),
               "--device-memory", "2MiB", "--prompts", str(prompts), "--max-new-tokens", "8", "--quick-profile"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "chosen policy: batch" in out and "predicted" in out and "| batch | k |" in out
    assert "warm-up on 4 of the job's prompts" in out  # alpha measured on the job's own prompts
    assert list((tmp_path / "profiles").glob("*.json"))


def test_plan_without_max_tokens_takes_the_default(tiny_models, tmp_path, capsys, monkeypatch):
    """No --max-tokens and no generation_config.json limit: the plan sizes the job to SamplingParams' default (16),
    as generate does, instead of failing on the missing field."""
    from specoffload.runtime.offload import profiler

    monkeypatch.setattr(profiler, "PROFILE_DIR", tmp_path / "profiles")
    rc = main(["plan", "--target", str(tiny_models["llama"]), "--device-memory", "2MiB", "--quick-profile"])
    out, err = capsys.readouterr()
    assert rc == 0 and "chosen policy: batch" in out
    assert "at most 16 new tokens per prompt" in err and "Traceback" not in err


def test_profile_measures_ahead_of_a_job_then_reuses(tiny_models, tmp_path, capsys, monkeypatch):
    """`specoffload profile`: phases with their ETA on stderr while it measures, the rates and conditions on stdout;
    a second call (another drafter) measures nothing but that drafter's step; --force measures again."""
    from specoffload.runtime.offload import profiler

    monkeypatch.setattr(profiler, "PROFILE_DIR", tmp_path / "profiles")
    cli = ["profile", "--model", str(tiny_models["llama"]), "--device-memory", "2MiB", "--quick"]
    assert main(cli) == 0
    out, err = capsys.readouterr()
    assert "profile: 1/5 stream rate" in err and "profile: 5/5 calibration passes" in err and "s left)" in err
    assert "hardware profile of llama" in out and "conditions" in out and "FFN GEMM" in out
    assert main([*cli, "--draft", str(tiny_models["draft"])]) == 0
    out, err = capsys.readouterr()
    assert "measuring the hardware profile" not in err and "timing the draft step of 'model'" in err
    assert "draft step of 'model'" in out
    assert main([*cli, "--force"]) == 0
    assert "again: marked stale: asked to measure again (--force)" in capsys.readouterr().err


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_an_interrupted_output_is_resumed_to_the_same_rows(tiny_models, tmp_path, capsys):
    prompts = tmp_path / "corpus.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": [3 + i, 8, 2 * i + 1]}) + "\n" for i in range(5)))
    out = tmp_path / "out.jsonl"
    # Sampled, so the check also covers the per-chunk seed: where a run stops does not change any row.
    cli = ["generate", "--target", str(tiny_models["llama"]), "--draft", str(tiny_models["draft"]), "--prompts",
           str(prompts), "-o", str(out), "--max-new-tokens", "5", "--ignore-eos", "--no-progress", "-k", "2",
           "--temperature", "1.0", "--seed", "7", "--chunk-size", "2"]
    assert main(cli) == 0
    full = _rows(out)
    assert [r["index"] for r in full] == list(range(5))
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:3]) + lines[3][:7])  # killed while writing the second chunk
    capsys.readouterr()
    assert main([*cli, "--resume"]) == 0
    err = capsys.readouterr().err
    assert "1 row(s) of unfinished chunks" in err and "2 of 5 prompts already done" in err
    assert _rows(out) == full  # rows 0-1 kept; chunk {2, 3} and chunk {4} generated again, with their own seeds
    assert main([*cli, "--resume"]) == 0
    assert "nothing to do" in capsys.readouterr().err
    assert _rows(out) == full


def test_an_existing_output_is_never_clobbered_silently(tiny_models, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"token_ids": [5, 6]}) + "\n")
    out = tmp_path / "out.jsonl"
    out.write_text('{"index": 0, "token_ids": [1]}\n')
    cli = ["generate", "--target", str(tiny_models["llama"]), "--prompts", str(prompts), "-o", str(out),
           "--max-new-tokens", "3", "--no-progress"]
    assert main(cli) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--resume" in err and "Traceback" not in err
    assert out.read_text() == '{"index": 0, "token_ids": [1]}\n'
    assert main([*cli, "--overwrite"]) == 0
    assert len(_rows(out)[0]["token_ids"]) >= 1 and _rows(out)[0]["token_ids"] != [1]
    out.write_text('{"index": 4, "token_ids": [1]}\n')  # written for a longer input
    assert main([*cli, "--resume"]) == 2
    assert "another input" in capsys.readouterr().err
    out.write_text("not a row\n")
    assert main([*cli, "--resume"]) == 2
    assert "cannot resume" in capsys.readouterr().err


def test_ray_backend_needs_an_offloaded_config(tiny_models, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"token_ids": [5, 6]}) + "\n")
    rc = main(["generate", "--backend", "ray", "--target", str(tiny_models["llama"]), "--prompts", str(prompts),
               "--no-progress"])
    assert rc == 2
    assert "--device-memory" in capsys.readouterr().err


def _batch_line(custom_id: str, prompt: object, url: str = "/v1/completions", **body: object) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"prompt": prompt, **body}})


def test_openai_batch_with_bad_rows_honours_each_rows_parameters(tiny_models, tmp_path, capsys):
    from specoffload.runtime import Engine, EngineConfig, SamplingParams

    lines = [
        _batch_line("greedy", [5, 6, 7], max_tokens=4),
        "{not json",
        _batch_line("hot", [9, 4], max_tokens=6, temperature=1.0, seed=3),
        _batch_line("embed", "x", url="/v1/embeddings"),
        _batch_line("empty", [5], max_tokens=0),
        _batch_line("long", list(range(1, 40))),  # longer than --max-seq-len
        _batch_line("chat", None, url="/v1/chat/completions"),  # no messages
        _batch_line("default", [3, 8]),
    ]
    batch, out = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    batch.write_text("\n".join(lines) + "\n")
    cli = ["generate", "--target", str(tiny_models["llama"]), "--prompts", str(batch), "-o", str(out),
           "--max-new-tokens", "3", "--ignore-eos", "--max-seq-len", "32", "--chunk-size", "3", "--no-progress",
           "--temperature", "0"]  # (a row without its own temperature takes the command line's)
    rc = main(cli)
    err = capsys.readouterr().err
    assert rc == 0  # finished, with failed rows (as `vllm run-batch`: they are in the output)
    assert "5 of 8 rows failed" in err and f"{batch}:2: invalid JSON" in err and "Traceback" not in err
    rows = _rows(out)
    assert [r["custom_id"] for r in rows] == ["greedy", None, "hot", "embed", "empty", "long", "chat", "default"]
    failed = {r["custom_id"]: r["error"]["code"] for r in rows if r["error"] is not None}
    assert failed == {None: "invalid_json", "embed": "unknown_url", "empty": "invalid_parameter",
                      "long": "prompt_too_long", "chat": "invalid_parameter"}
    ok = {r["custom_id"]: r["response"]["body"]["choices"][0]["token_ids"] for r in rows if r["error"] is None}
    engine = Engine(EngineConfig(tiny_models["llama"], max_seq_len=32))
    ref = engine.generate([[5, 6, 7], [9, 4], [3, 8]], [SamplingParams(temperature=0.0, max_new_tokens=4,
                                                                       ignore_eos=True),
                                                       SamplingParams(max_new_tokens=6, temperature=1.0, seed=3,
                                                                      ignore_eos=True),
                                                       SamplingParams(temperature=0.0, max_new_tokens=3,
                                                                      ignore_eos=True)],
                          keys=[0, 2, 7])  # the rows' indices in the file: their random streams' keys
    assert ok == {"greedy": ref[0].token_ids, "hot": ref[1].token_ids, "default": ref[2].token_ids}
    assert [len(ids) for ids in ok.values()] == [4, 6, 3]  # each row's own max_tokens, else --max-new-tokens


def test_resume_refuses_another_job_in_one_line(tiny_models, tmp_path, capsys):
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": [4 + i, 5]}) + "\n" for i in range(3)))
    cli = ["generate", "--target", str(tiny_models["llama"]), "--prompts", str(prompts), "-o", str(out),
           "--max-new-tokens", "3", "--chunk-size", "2", "--no-progress"]
    assert main(cli) == 0
    written = out.read_text()
    capsys.readouterr()
    for change, field in ((["--max-new-tokens", "4"], "sampling.max_new_tokens"),
                          (["--temperature", "0.5"], "sampling.temperature"), (["--seed", "1"], "sampling.seed"),
                          (["--chunk-size", "1"], "chunk_size"), (["--target", str(tiny_models["mistral"])],
                                                                  "models.target")):
        assert main([*cli, *change, "--resume"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--resume refused" in err[0] and field in err[0], (change, err)
    prompts.write_text("".join(json.dumps({"token_ids": [4 + i, 6]}) + "\n" for i in range(3)))  # other token ids
    assert main([*cli, "--resume"]) == 2
    assert "input.sha256" in capsys.readouterr().err
    assert out.read_text() == written  # nothing was touched


def test_a_second_run_on_a_locked_output_fails_at_once(tiny_models, tmp_path, capsys):
    from specoffload.runtime.offline.output import OutputFile

    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text(json.dumps({"token_ids": [4, 5]}) + "\n")
    with OutputFile(out, overwrite=True):  # another run holds it
        rc = main(["generate", "--target", str(tiny_models["llama"]), "--prompts", str(prompts), "-o", str(out),
                   "--overwrite", "--no-progress"])
    assert rc == 2 and "another specoffload run" in capsys.readouterr().err


def test_progress_lines_when_not_a_terminal(tiny_models, tmp_path, capsys):
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps({"token_ids": [3 + i]}) + "\n" for i in range(4)))
    rc = main(["generate", "--target", str(tiny_models["llama"]), "--prompts", str(ids), "-o",
               str(tmp_path / "o.jsonl"), "--max-new-tokens", "2", "--chunk-size", "1", "--progress-interval", "0"])
    err = capsys.readouterr().err
    assert rc == 0 and "progress: 4/4 rows (100.0%)" in err and "ETA" in err and "tok/s" in err


def test_refill_and_prefill_chunk_flags_leave_every_row_as_it_is(tiny_models, tmp_path, capsys):
    """--no-refill and --prefill-chunk change how rows share passes, never a row: sampled rows included (each row
    draws from the job's seed and its own index), and with chunks of 3 rows the job is one stream."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": [5 + i, 6, 7, 8, 9][: 2 + i % 4]}) + "\n" for i in range(7)))
    rows = {}
    for name, extra in {"default": [], "waves": ["--no-refill"], "chunked": ["--prefill-chunk", "2"]}.items():
        out = tmp_path / f"{name}.jsonl"
        rc = main(["generate", "--target", str(tiny_models["llama"]), "--draft", str(tiny_models["qwen2_draft"]),
                   "--prompts", str(prompts), "-o", str(out), "--max-new-tokens", "6", "-k", "2", "--batch-size", "2",
                   "--device-memory", "1GiB", "--max-seq-len", "32", "--temperature", "0.9", "--seed", "4",
                   "--chunk-size", "3", "--no-progress", *extra])
        assert rc == 0, capsys.readouterr().err
        rows[name] = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
    assert len(rows["default"]) == 7 and rows["waves"] == rows["default"] == rows["chunked"]


def test_vllm_flag_names_version_and_help(tiny_models, tmp_path, capsys):
    """vLLM's spellings are the primary ones (today's are aliases), no abbreviations, --version, defaults shown."""
    import pytest

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"token_ids": [5, 6, 7]}) + "\n")
    old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    assert main(["generate", "--target", str(tiny_models["llama"]), "--draft", str(tiny_models["qwen2_draft"]),
                 "--prompts", str(prompts), "-o", str(old), "--max-new-tokens", "5", "--max-seq-len", "32",
                 "-k", "2", "--dtype", "float32", "--no-progress", "--temperature", "0"]) == 0
    assert main(["generate", "--model", str(tiny_models["llama"]), "--speculative-model",
                 str(tiny_models["qwen2_draft"]), "--prompts", str(prompts), "-o", str(new), "--max-tokens", "5",
                 "--max-model-len", "32", "--num-speculative-tokens", "2", "--dtype", "auto", "--no-progress",
                 "--temperature", "0"]) == 0
    assert [json.loads(x)["token_ids"] for x in old.read_text().splitlines()] == \
        [json.loads(x)["token_ids"] for x in new.read_text().splitlines()]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("specoffload ")
    with pytest.raises(SystemExit) as exit_:  # an abbreviation is not read as --device-memory
        main(["generate", "--model", "x", "--prompts", str(prompts), "--device-mem", "1GiB"])
    assert exit_.value.code == 2 and "unrecognized arguments: --device-mem" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for shown in ("--model DIR, --target DIR", "--max-tokens N, --max-new-tokens N", "(vLLM's default: 16)",
                  "--dtype {auto,float32,bfloat16,float16}", "(default: auto)", "temperature", "(vLLM's default: 1.0)",
                  "unset: the model's generation_config.json, else vLLM's defaults"):
        assert shown in help_text, shown
    for group in ("model:", "sampling", "job:", "memory and offload", "Ray:", "diagnostics:"):
        assert group in help_text, group


def test_openai_batch_round_trip_schema(tiny_models, tmp_path, capsys):
    """The output against the Batch API's documented line shape (as `vllm run-batch` writes it): unique random ids,
    status_code, request_id, body with id / object / created / model / choices (index, text, logprobs,
    finish_reason, stop_reason) / usage; a failed row's error object; the row's penalties and min_tokens."""
    import re

    lines = [_batch_line("a", [5, 6, 7], max_tokens=4, presence_penalty=0.5, repetition_penalty=1.3, min_tokens=2),
             _batch_line("b", [9, 4], max_tokens=3),
             _batch_line("bad", [9], presence_penalty=7),
             _batch_line("n17", [9], n=17)]
    batch, out = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    batch.write_text("\n".join(lines) + "\n")
    cli = ["generate", "--model", str(tiny_models["llama"]), "--prompts", str(batch), "-o", str(out),
           "--ignore-eos", "--no-progress", "--temperature", "0"]
    assert main(cli) == 0
    assert "2 of 4 rows failed" in capsys.readouterr().err
    first = _rows(out)
    assert main([*cli, "--overwrite"]) == 0
    second = _rows(out)
    ids = [r["id"] for r in first + second]
    assert len(set(ids)) == 8 and all(re.fullmatch(r"batch_req_[0-9a-f]{24}", i) for i in ids)
    for row in first[:2]:
        assert set(row) == {"id", "custom_id", "response", "error"} and row["error"] is None
        response = row["response"]
        assert response["status_code"] == 200 and re.fullmatch(r"req_[0-9a-f]{32}", response["request_id"])
        body = response["body"]
        assert re.fullmatch(r"cmpl-[0-9a-f]{32}", body["id"]) and body["object"] == "text_completion"
        assert isinstance(body["created"], int) and body["model"] == "llama"
        (choice,) = body["choices"]
        assert {"index", "text", "logprobs", "finish_reason", "stop_reason"} <= set(choice)
        assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    for row in first[2:]:
        assert row["response"] is None and row["error"]["code"] == "invalid_parameter" and row["error"]["line"] >= 3
    from specoffload.runtime import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(tiny_models["llama"]))
    ref = engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                      presence_penalty=0.5,
                                                      repetition_penalty=1.3, min_tokens=2))
    assert first[0]["response"]["body"]["choices"][0]["token_ids"] == ref[0].token_ids


def test_progress_lines_on_a_timer_whatever_the_chunking(tiny_models, tmp_path, capsys):
    """One chunk for the whole job still gives a line every --progress-interval seconds; loading is reported
    apart from the generation rate."""
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps({"token_ids": [3 + i, 4]}) + "\n" for i in range(12)))
    summary = tmp_path / "summary.json"
    rc = main(["generate", "--model", str(tiny_models["llama"]), "--prompts", str(ids), "-o", str(tmp_path / "o"),
               "--max-tokens", "40", "--ignore-eos", "--max-num-seqs", "2", "--progress-interval", "0.05",
               "--summary", str(summary)])
    err = capsys.readouterr().err
    assert rc == 0
    lines = [line for line in err.splitlines() if line.startswith("progress: ") and "rows" in line]
    assert len(lines) >= 3, err  # one chunk (256 rows), several lines
    assert "models loaded in" in err and "s loading)" in err
    before_any_row = [line for line in lines if line.startswith("progress: 0/12 rows")]
    assert any(" 0.0 tok/s" not in line for line in before_any_row[1:]), lines  # the rate moves before a row is out
    record = json.loads(summary.read_text())
    assert record["load_s"] >= 0 and record["total_s"] >= record["wall_s"] + record["load_s"] - 1e-6
    # per-request metrics, one entry per row: 40 new tokens each (EOS ignored), a first token before the end
    requests = record["requests"]
    assert requests["new_tokens"] == {"count": 12, "mean": 40.0, "p50": 40.0, "p90": 40.0, "p99": 40.0, "max": 40.0}
    ttft, total = requests["time_to_first_token_s"], requests["time_s"]
    assert ttft["count"] == total["count"] == 12 and 0 < ttft["p50"] <= ttft["max"] <= total["max"]
    assert ttft["p50"] <= ttft["p90"] <= ttft["p99"] <= ttft["max"] and "acceptance" not in requests  # no drafter
    phases = record["phases"]
    assert phases["load_s"] == record["load_s"] and phases["generate_s"] == record["wall_s"]
    assert 0 <= phases["write_s"] <= phases["generate_s"] and phases["close_s"] >= 0


def test_device_flag_errors_are_one_line(tiny_models, tmp_path, capsys):
    """--device takes cpu, cuda[:N] or auto; a name torch does not know, or cuda on a machine without a GPU, is
    one line (never a traceback, never read as an abbreviation of --device-memory)."""
    import torch

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"token_ids": [5, 6]}) + "\n")
    base = ["generate", "--model", str(tiny_models["llama"]), "--prompts", str(prompts), "--no-progress",
            "--max-tokens", "2", "-o", str(tmp_path / "o.jsonl")]
    assert main([*base, "--device", "gpu"]) == 2
    err = capsys.readouterr().err
    assert "device must be 'cpu', 'cuda[:N]' or 'auto', got 'gpu'" in err and "Traceback" not in err
    assert main([*base, "--device", "auto", "--overwrite"]) == 0  # the CPU here (or the GPU where there is one)
    capsys.readouterr()
    if not torch.cuda.is_available():
        assert main([*base, "--device", "cuda", "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert "sees no CUDA GPU" in err and "Traceback" not in err


def test_plan_and_generate_give_the_same_plan_for_the_same_job(tiny_models, tmp_path, capsys, monkeypatch):
    """`generate` plans a planned job as `plan` does (the warm-up on the job's prompts, then the search over its
    workload), so the batch and k it runs are the ones `plan` prints; neither is larger than the job. The warm-up's
    pass times do not correct the (cached, shared) profile here: on a busy machine two runs' times differ, and a
    correction in one but not the other moved k between 1 and 2 (replan.py `check_profile`, tested on its own). Nor
    does a profile measured with a wide spread: `plan` measures and saves it, and one saved as disturbed is measured
    again by `generate` (profiler.py `cached`), so the two commands can plan on two profiles; with no draft and
    k = 1 within 2% here (45.8 and 45.1 tokens/s), that is the likely cause of k 1 against 2 in a fresh clone's CI
    (2026-12-07; the other timing each command takes apart, the replay's proposal microseconds, left k at 1 from
    1 to 400 us)."""
    import re

    from specoffload.runtime.offload import profiler, replan

    monkeypatch.setattr(replan, "PROFILE_MARGIN", float("inf"))
    monkeypatch.setattr(profiler, "SPREAD_LIMIT", float("inf"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": [1, 5 + i, 9, 5 + i]}) + "\n" for i in range(6)))
    common = ["--model", str(tiny_models["llama"]), "--prompts", str(prompts), "--drafter", "ngram",
              "--device-memory", "1GiB", "--max-tokens", "8"]
    assert main(["plan", *common]) == 0
    planned = re.search(r"--batch-size (\d+) -k (\d+)", capsys.readouterr().out)
    assert main(["generate", *common, "--ignore-eos", "-o", str(tmp_path / "o.jsonl")]) == 0
    ran = re.search(r"plan: batch=(\d+), k=(\d+).*re-planned", capsys.readouterr().err)
    assert planned and ran and planned.groups() == ran.groups()
    assert int(ran.group(1)) <= 6 and int(ran.group(2)) >= 1  # no larger than the job; the drafter asked for runs


def test_a_misspelt_flag_names_the_closest_one(tiny_models, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", str(tiny_models["llama"]), "--prompts", str(tmp_path / "p.jsonl"),
              "--num-speculative-token", "2"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --num-speculative-token 2 (did you mean --num-speculative-tokens?)" in \
        capsys.readouterr().err


def test_unset_sampling_flags_take_the_models_defaults_and_say_so(tiny_models, tmp_path, capsys):
    """As vLLM: an unset sampling flag takes the model's generation_config.json, else SamplingParams' own (vLLM's)
    defaults, temperature 1.0 and 16 tokens; the job states them on one line; a flag given wins."""
    import shutil

    from specoffload.runtime.sampling import SamplingParams

    assert (SamplingParams().temperature, SamplingParams().max_tokens) == (1.0, 16)  # vLLM's
    model = tmp_path / "model"
    shutil.copytree(tiny_models["llama"], model)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": [5 + i, 6, 7]}) + "\n" for i in range(3)))
    out = tmp_path / "o.jsonl"
    cli = ["generate", "--model", str(model), "--prompts", str(prompts), "-o", str(out), "--overwrite",
           "--ignore-eos", "--progress-interval", "0"]
    assert main(cli) == 0
    err = capsys.readouterr().err
    assert "sampling: temperature 1, top-p 1, top-k off, repetition penalty 1, at most 16 new tokens per prompt " \
           "(from vLLM's defaults" in err
    sampled = _rows(out)
    assert all(len(r["token_ids"]) == 16 for r in sampled)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(config | {"do_sample": False, "max_new_tokens": 7,
                                                                       "repetition_penalty": 1.1}))
    assert main(cli) == 0
    err = capsys.readouterr().err
    assert "sampling: greedy, repetition penalty 1.1, at most 7 new tokens per prompt (from generation_config.json " \
           "(repetition_penalty 1.1, max_tokens 7, do_sample false: greedy) over vLLM's defaults)" in err
    greedy = _rows(out)
    assert main([*cli, "--max-tokens", "5", "--repetition-penalty", "1.1", "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert "at most 5 new tokens per prompt (--max-new-tokens, --temperature, --repetition-penalty given; the rest " \
           "from generation_config.json" in err
    assert [r["token_ids"] for r in _rows(out)] == [r["token_ids"][:5] for r in greedy]  # greedy: a prefix
    assert all(len(r["token_ids"]) == 7 for r in greedy)
