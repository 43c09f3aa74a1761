"""Ray Data (issue 38, item 6): the engine as a `map_batches` processor on a local Ray gives the CLI job's greedy
outputs row for row, on two actors, and a row the engine refuses comes back with its error, not lost."""

from __future__ import annotations

import json

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")


def test_map_batches_gives_the_cli_jobs_outputs(tiny_models, tmp_path) -> None:
    from specoffload.actors.ray_data import LLMProcessor
    from specoffload.runtime.cli import main

    prompts = [[1, 5 + i % 50, 9, 33 + i % 7][: 2 + i % 3] for i in range(64)]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in prompts))
    out = tmp_path / "o.jsonl"
    assert main(["generate", "--model", str(tiny_models["llama"]), "--prompts", str(path), "-o", str(out),
                 "--max-tokens", "6", "--ignore-eos", "--batch-size", "8", "--temperature", "0"]) == 0
    cli = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]

    rows = [{"prompt": p, "id": i} for i, p in enumerate(prompts)] + [{"prompt": [1, 100000], "id": 64}]
    started = not ray.is_initialized()  # (another test module's session may hold one: use it, leave it up)
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        ds = ray.data.from_items(rows).map_batches(
            LLMProcessor, concurrency=2, batch_size=16,
            fn_constructor_kwargs={"model": str(tiny_models["llama"]), "max_num_seqs": 8, "dtype": "float32",
                                   "sampling_params": {"max_tokens": 6, "ignore_eos": True, "temperature": 0.0}})
        got = sorted(ds.take_all(), key=lambda r: r["id"])
    finally:
        if started:
            ray.shutdown()
    assert [list(r["generated_token_ids"]) for r in got[:64]] == cli
    assert all(r["error"] is None and r["finish_reason"] == "length" for r in got[:64])
    bad = got[64]
    assert "outside the vocabulary" in bad["error"] and list(bad["generated_token_ids"]) == []
