"""Exact mode (EngineConfig.exact, runtime/models/linear.py `exact_rows`): a row computes as it would alone, so its
logits are the same bit for bit whatever the batch, the tokens of the pass and the drafter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specoffload.runtime.config import EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.errors import ConfigError
from specoffload.runtime.models import layers
from specoffload.runtime.models.linear import EXACT_ROWS, exact_mode, exact_rows, in_row_blocks, linear, rows_bmm
from specoffload.runtime.models.model import Transformer
from specoffload.runtime.sampling import SamplingParams
from tests.conftest import OFFLOAD_PROMPTS, tight_config


@given(rows=st.integers(0, 3 * EXACT_ROWS + 5), dim=st.sampled_from([0, 1]))
@settings(max_examples=30, deadline=None)
def test_row_blocks_call_with_exactly_the_block_rows(rows: int, dim: int) -> None:
    x = torch.randn((rows, 3) if dim == 0 else (2, rows, 3))
    seen = []

    def fn(block: torch.Tensor) -> torch.Tensor:
        seen.append(block.shape[dim])
        return block * 2 + 1

    out = in_row_blocks(x, fn, dim=dim)
    assert seen == ([EXACT_ROWS] * -(-rows // EXACT_ROWS) if rows else [0])
    assert torch.equal(out, x * 2 + 1)


@given(rows=st.integers(1, 80), at=st.data(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
@settings(max_examples=25, deadline=None)
def test_exact_linear_gives_a_row_the_same_bits_in_any_company(rows: int, at: st.DataObject,
                                                               dtype: torch.dtype) -> None:
    """The row alone and the row at any place among `rows` others: the same bits (outside exact mode a bfloat16
    row changes with the row count on this project's CPUs: module docstring of linear.py)."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    i = at.draw(st.integers(0, rows - 1))
    with exact_rows():
        assert exact_mode()
        alone = linear(x[i:i + 1], w, bias)
        among = linear(x, w, bias)
        a, b = torch.randn(5, i + 1, 64, generator=gen).to(dtype), torch.randn(5, 64, 7, generator=gen).to(dtype)
        a[0] = x[i:i + 1]
        assert torch.equal(rows_bmm(a, b)[0, i], rows_bmm(a[:, i:i + 1], b)[0, 0])
    assert not exact_mode()
    assert torch.equal(alone[0], among[i])


def test_exact_attention_gives_each_query_its_own_span_and_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """One query per batch entry, over key columns rounded out to EXACT_KEYS (here 4), masked to what it sees (the
    window's positions too): the call's shape and each entry's mask depend on the query's position only."""
    calls = []
    real = layers._attend

    def spy(q, keys, values, mask, scale, sinks):  # noqa: ANN001, ANN202
        seen = [torch.nonzero(m[0, 0]).flatten().tolist() for m in mask]
        calls.append((q.shape[2], keys.shape[2], seen))
        return real(q, keys, values, mask, scale, sinks)

    monkeypatch.setattr(layers, "_attend", spy)
    monkeypatch.setattr(layers, "EXACT_KEYS", 4)
    from specoffload.runtime.kv_cache import KVCache

    cache = KVCache(1, 2, 1, 8, 16)
    cache.advance(torch.tensor([3, 5]))
    q = torch.randn(2, 2, 3, 8)
    positions = cache.device_lengths()[:, None] + torch.arange(3)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    with exact_rows():
        out = layers._attend_cached(q, cache, 0, positions, 4, mask,
                                    lambda q, k, v, m: layers._attend(q, k, v, m, 0.5, None))
    # window 4: row 0 queries at 3, 4 see 0..3, 1..4 (spans 0..3, 0..7); row 1's at 5, 6, 7 see 2..5, 3..6, 4..7
    # (spans 0..7, 0..7, 4..7), relative to each span's start
    assert calls == [(1, 4, [[0, 1, 2, 3]]), (1, 8, [[1, 2, 3, 4]]), (1, 8, [[2, 3, 4, 5], [3, 4, 5, 6]]),
                     (1, 4, [[0, 1, 2, 3]])]
    assert torch.equal(out[0, :, 2], torch.zeros_like(out[0, :, 2]))  # the padded query
    plain = layers._attend_cached(q, cache, 0, positions, 4, mask, lambda q, k, v, m: real(q, k, v, m, 0.5, None))
    torch.testing.assert_close(out[mask[:, None].expand(-1, 2, -1)], plain[mask[:, None].expand(-1, 2, -1)])


def _logits_three_ways(model: Transformer, steps: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row logits of `steps` tokens after ragged prompts: one-token passes of the whole batch, one pass of all the
    tokens, and one-token passes of row 1 alone: [B, steps, V], [B, steps, V], [1, steps, V]."""
    gen = torch.Generator().manual_seed(0)
    batch, length = 5, 9
    prompts = torch.randint(3, 500, (batch, length), generator=gen)
    lengths = torch.tensor([3 + i for i in range(batch)])
    tokens = torch.randint(3, 500, (batch, steps), generator=gen)

    def prefilled(rows: list[int]):  # noqa: ANN202
        cache = model.new_cache(len(rows), 32)
        model(prompts[rows], cache, num_new=lengths[rows], compute_logits=False)
        return cache

    cache = prefilled(list(range(batch)))
    decode = torch.cat([model(tokens[:, s:s + 1], cache) for s in range(steps)], dim=1)
    verify = model(tokens, prefilled(list(range(batch))))
    cache = prefilled([1])
    alone = torch.cat([model(tokens[1:2, s:s + 1], cache) for s in range(steps)], dim=1)
    return decode, verify, alone


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2_moe_windowed", "qwen3_moe", "gpt_oss", "deepseek_v2",
                                  "deepseek_v3"])
def test_exact_model_logits_do_not_depend_on_the_pass(tiny_models, name: str) -> None:  # noqa: ANN001
    model = Transformer(tiny_models[name], dtype=torch.bfloat16, exact=True)
    decode, verify, alone = _logits_three_ways(model)
    assert torch.equal(decode, verify)
    assert torch.equal(decode[1:2], alone)


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)


def _greedy(config: EngineConfig) -> list[list[int]]:
    engine = Engine(config)
    try:
        return [r.token_ids for r in engine.generate(OFFLOAD_PROMPTS, GREEDY)]
    finally:
        engine.close()


def test_exact_speculative_output_is_the_no_draft_output_in_bfloat16(tiny_models, monkeypatch) -> None:  # noqa: ANN001
    """Resident and offloaded, drafted or not, any batch: the same tokens (a row computes as it would alone), and
    every engine's target attends in exact mode (the tiny models' shapes round alike either way; the real model's
    do not: docs/perf lossless)."""
    exact_passes = []
    real = layers._attend_each
    monkeypatch.setattr(layers, "_attend_each", lambda *a: exact_passes.append(1) or real(*a))
    target = tiny_models["qwen2_moe"]
    base = dict(target=target, dtype="bfloat16", exact=True)
    runs = [_greedy(EngineConfig(**base, max_batch_size=3)), _greedy(EngineConfig(**base, max_batch_size=1)),
            _greedy(EngineConfig(**base, max_batch_size=4, drafter="ngram", num_draft_tokens=3)),
            _greedy(EngineConfig(**base, max_batch_size=2, draft=tiny_models["qwen2_draft"], num_draft_tokens=2))]
    seen = len(exact_passes)
    runs.append(_greedy(tight_config(target, dtype="bfloat16", exact=True, drafter="self")))
    assert seen > 0 and len(exact_passes) > seen  # resident and offloaded
    assert all(run == runs[0] for run in runs)
    exact_passes.clear()
    _greedy(EngineConfig(target=target, dtype="bfloat16", max_batch_size=3))
    assert not exact_passes


def test_exact_must_be_a_bool_or_auto(tiny_models) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match="exact must be True, False or 'auto'"):
        EngineConfig(target=tiny_models["llama"], exact="yes")


@pytest.mark.parametrize(("io", "compute", "offloaded", "expected"),
                         [(1.0, 1.0, True, True), (0.9, 1.0, True, False), (1.0, 1.0, False, False)])
def test_auto_exact_is_on_where_the_pass_hides_its_compute(tiny_models, monkeypatch, io: float, compute: float,  # noqa: ANN001
                                                            offloaded: bool, expected: bool) -> None:
    """exact="auto": on where the planned pass's reads take EXACT_COMPUTE x its compute or more (offloaded, with a
    profile), off resident; the engine's config holds the choice and its workers compute accordingly."""
    import specoffload.runtime.engine as engine_module
    from tests.test_planner import make_profile

    class Step:  # io in units of EXACT_COMPUTE x compute
        t_io, t_compute = io * engine_module.EXACT_COMPUTE * compute, compute

    monkeypatch.setattr(engine_module, "estimate_step", lambda *a, **k: Step())
    target = tiny_models["llama"]
    config = (tight_config(target, exact="auto") if offloaded
              else EngineConfig(target=target, exact="auto", max_batch_size=2))
    assert config.exact == "auto"
    engine = Engine(config, profile=make_profile() if offloaded else None)
    try:
        assert engine.config.exact is expected and engine.target.exact is expected
        exact_passes = []
        real = layers._attend_each
        monkeypatch.setattr(layers, "_attend_each", lambda *a: exact_passes.append(1) or real(*a))
        engine.generate([[1, 5, 9]], GREEDY)
        assert bool(exact_passes) is expected
    finally:
        engine.close()


@pytest.mark.parametrize("exact", [False, True])
def test_slow_exact_passes_leave_the_profile_alone(tiny_models, monkeypatch, exact: bool) -> None:  # noqa: ANN001
    """Exact mode's passes are slower than the profile's kernels by design: they do not make it stale; a plain
    run's slow passes do, and either's fast ones do."""
    import specoffload.runtime.engine as engine_module

    marked = []
    monkeypatch.setattr(engine_module, "mark_stale", lambda config, why: marked.append(why))
    for off in (2.0, 0.5):
        engine = Engine(tight_config(tiny_models["llama"], dtype="bfloat16", exact=exact))
        try:
            engine.replanner.profile_off = off
            engine._check_profile()
        finally:
            engine.close()
    assert len(marked) == (1 if exact else 2)


def test_the_cli_flag_reaches_the_engine(tiny_models, tmp_path, capsys, monkeypatch) -> None:  # noqa: ANN001
    """`--exact on` attends in exact mode, `off` (the default) does not; the rows agree (tiny shapes)."""
    import json

    from specoffload.runtime.cli import main

    calls = []
    real = layers._attend_each
    monkeypatch.setattr(layers, "_attend_each", lambda *a: calls.append(1) or real(*a))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in OFFLOAD_PROMPTS[:3]))
    rows, seen = {}, {}
    for flag in ("on", "off", None):
        out = tmp_path / f"{flag}.jsonl"
        calls.clear()
        rc = main(["generate", "--target", str(tiny_models["llama"]), "--prompts", str(prompts), "-o", str(out),
                   "--max-new-tokens", "4", "--dtype", "bfloat16", "--temperature", "0", "--no-progress",
                   *(["--exact", flag] if flag else [])])
        assert rc == 0, capsys.readouterr().err
        rows[flag], seen[flag] = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()], bool(calls)
    assert seen == {"on": True, "off": False, None: False}
    assert rows["on"] == rows["off"] == rows[None]
