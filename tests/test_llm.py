"""`LLM`: vLLM-shaped results over the Engine, n samples, stop strings, chat, streaming, lifetime, "~" paths."""

from __future__ import annotations

import shutil

import pytest

from specoffload.runtime import LLM, Engine, EngineConfig, PromptError, SamplingParams
from specoffload.runtime.config import ConfigError


@pytest.fixture(scope="module")
def chat_models(tiny_models, tmp_path_factory):
    """The tiny llama target and qwen2 draft with a one-character-per-token tokenizer and a chat template."""
    from scripts.make_tiny_models import write_char_tokenizer

    root = tmp_path_factory.mktemp("chat_models")
    out = {}
    for name in ("llama", "qwen2_draft"):
        out[name] = shutil.copytree(tiny_models[name], root / name)
        write_char_tokenizer(out[name])
    return out


def test_generate_is_vllm_shaped_and_equals_the_engine(chat_models, single_thread) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(model=chat_models["llama"], draft=chat_models["qwen2_draft"], num_speculative_tokens=2,
             max_num_seqs=2) as llm:
        outs = llm.generate(["def add(a, b):", {"prompt_token_ids": [1, 5, 9]}, "x"], params)
        engine = Engine(EngineConfig(chat_models["llama"], max_batch_size=3))
        plain = engine.generate(["def add(a, b):", [1, 5, 9], "x"], params)
        assert [o.outputs[0].token_ids for o in outs] == [r.token_ids for r in plain]  # lossless, same tokens
        assert [o.outputs[0].text for o in outs] == [r.text for r in plain]
        assert len({o.request_id for o in outs}) == 3
        assert outs[0].prompt == "def add(a, b):" and outs[1].prompt is None
        assert outs[0].prompt_token_ids == plain[0].prompt_token_ids
        first = outs[0].outputs[0]
        assert (first.index, first.finish_reason, first.stop_reason, first.logprobs) == (0, "length", None, None)
        m = outs[0].metrics
        assert m.num_generated_tokens == 8 and m.num_drafted_tokens == first.num_drafted > 0
        assert 0 < m.time_to_first_token <= m.time
        again = llm.generate("x", params)[0]
        assert again.request_id not in {o.request_id for o in outs}


def test_n_samples_and_per_request_seed(chat_models, single_thread) -> None:
    hot = SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=7, ignore_eos=True, logprobs=1)
    llm = LLM(model=chat_models["llama"], draft=chat_models["qwen2_draft"], num_speculative_tokens=2)
    alone = llm.generate("hello", hot)[0]
    assert [c.index for c in alone.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in alone.outputs}) == 3  # independent samples
    # a seeded request comes out the same wherever it sits, beside whatever else
    mixed = llm.generate(["other", "hello"], [SamplingParams(max_tokens=4, temperature=1.0), hot])[1]
    assert [c.token_ids for c in mixed.outputs] == [c.token_ids for c in alone.outputs]
    for c in alone.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        assert all(next(iter(d)) == t for d, t in zip(c.logprobs, c.token_ids))  # the chosen token first
        assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)))
    streamed = list(llm.generate_iter(iter(["a", "hello", "ccc"]), hot))
    assert sorted(o.prompt for o in streamed) == ["a", "ccc", "hello"]
    assert all(len(o.outputs) == 3 for o in streamed)
    assert [c.token_ids for c in next(o for o in streamed if o.prompt == "hello").outputs] == \
        [c.token_ids for c in alone.outputs]
    llm.shutdown()


@pytest.mark.parametrize("draft", [None, "llama"])
def test_stop_strings(chat_models, single_thread, draft) -> None:
    """A stop string ends the run at the token that completes it; the text is cut before it (kept with
    include_stop_str_in_output); stop_reason names it. With the target drafting for itself the result is the
    same as without a draft."""
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(model=chat_models["llama"], draft=chat_models[draft] if draft else None, num_speculative_tokens=3)
    free = llm.generate("hello", base)[0].outputs[0]
    stop = free.text[6:8]  # spans two tokens (one character each)
    cut = free.text.find(stop)
    out = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                               stop=stop))[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (free.text[:cut], "stop", stop)
    assert out.token_ids == free.token_ids[: cut + len(stop)]
    kept = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop, "\u0000"],
                                                include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == free.text[: cut + len(stop)]
    llm.shutdown()


def test_a_job_row_is_cut_at_its_stop_string_by_the_engine(chat_models, single_thread, tmp_path) -> None:
    """A batch job's row with a stop string: the engine ends it at the token that completes the string and cuts
    the text before it (the one place stop strings are cut: runtime/request.py and Engine's results)."""
    import json

    from specoffload.runtime.cli import main

    llm = LLM(model=chat_models["llama"])
    free = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    llm.shutdown()
    stop = free.text[6:8]
    cut = free.text.find(stop)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n")
    out = tmp_path / "o.jsonl"
    assert main(["generate", "--model", str(chat_models["llama"]), "--prompts", str(prompts), "-o", str(out),
                 "--max-tokens", "24", "--ignore-eos", "--stop", stop, "--no-progress", "--temperature", "0"]) == 0
    row = json.loads(out.read_text())
    assert (row["text"], row["finish_reason"]) == (free.text[:cut], "stop")
    assert row["token_ids"] == free.token_ids[: cut + len(stop)]


def test_chat_and_prompt_errors(chat_models, single_thread) -> None:
    llm = LLM(model=chat_models["llama"])
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    one = llm.chat(convo, SamplingParams(temperature=0.0, max_tokens=4))
    assert one[0].prompt == "<|system|>Be brief.\n<|user|>hi\n<|assistant|>"
    assert one[0].prompt_token_ids == llm.get_tokenizer().encode(one[0].prompt, add_special_tokens=False)
    two = llm.chat([convo, convo[1:]], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(two) == 2 and two[0].outputs[0].token_ids == one[0].outputs[0].token_ids
    with pytest.raises(PromptError, match="use LLM.chat"):
        llm.generate([convo])
    with pytest.raises(PromptError, match="conversation"):
        llm.chat("hi")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unexpected keyword"):
        LLM(model=chat_models["llama"], no_such_option=1)


def test_paths_expand_home_and_dtype_auto(chat_models, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HOME", str(chat_models["llama"].parent))
    config = EngineConfig(target="~/llama", draft="~/qwen2_draft", dtype="auto")
    assert str(config.target) == str(chat_models["llama"]) and str(config.draft) == str(chat_models["qwen2_draft"])
    assert config.dtype == "float32"  # the tiny checkpoints are float32
    import json

    fp16 = shutil.copytree(chat_models["llama"], tmp_path / "fp16")
    cfg = json.loads((fp16 / "config.json").read_text())
    cfg["dtype"] = "float16"
    (fp16 / "config.json").write_text(json.dumps(cfg))
    assert EngineConfig(target=fp16, dtype="auto").dtype == "float32"  # the CPU computes float16 weights in float32
    assert EngineConfig(target=fp16, dtype="float16").dtype == "float16"
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig(target=fp16, dtype="float8")


def test_vllm_engine_spellings(chat_models, single_thread) -> None:
    """vLLM's speculative_config sets the drafter (a draft model equals draft=...; ngram takes its lookup options);
    single-device settings pass, those that would change something are refused in one line with what to use; a
    misspelt keyword names the closest one."""
    target, draft = chat_models["llama"], chat_models["qwen2_draft"]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    via_config = LLM(target, speculative_config={"model": str(draft), "num_speculative_tokens": 3},
                     tensor_parallel_size=1, enforce_eager=True, trust_remote_code=False)
    assert via_config.config.drafter_name == "model" and via_config.config.num_draft_tokens == 3
    direct = LLM(target, draft=draft, num_speculative_tokens=3)
    assert ([o.outputs[0].token_ids for o in via_config.generate(["hello"], params)]
            == [o.outputs[0].token_ids for o in direct.generate(["hello"], params)])
    ngram = LLM(target, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert ngram.config.drafter_name == "ngram" and ngram.config.drafter_options == {"prompt_lookup_max": 4}
    lowbit = LLM(target, speculative_config={"method": "lowbit", "lowbit_format": "int8"}, device_memory="1GiB")
    assert lowbit.config.drafter_name == "lowbit" and lowbit.config.drafter_options == {"lowbit_format": "int8"}
    for kwargs, message in ((dict(speculative_config={"method": "eagle", "model": "x"}), "method 'eagle' is not "
                                                                                          "supported here"),
                            (dict(tensor_parallel_size=2), "replicas"),
                            (dict(gpu_memory_utilization=0.9), "device_memory="),
                            (dict(speculative_config={"method": "ngram", "foo": 1}), "key 'foo'"),
                            (dict(max_num_seq=4), "did you mean 'max_num_seqs'"),
                            (dict(quantization="awq"), "specoffload quantize")):
        with pytest.raises(ConfigError, match=message) as err:
            LLM(target, **kwargs)
        assert "\n" not in str(err.value)


def test_default_sampling_params_follow_the_models_generation_config(chat_models, tmp_path) -> None:
    """As vLLM: a call without sampling_params runs the target's generation_config.json values over vLLM's
    defaults (temperature 1.0, 16 tokens); do_sample false is greedy."""
    import json

    model = shutil.copytree(chat_models["llama"], tmp_path / "m")
    llm = LLM(model)
    plain = llm.get_default_sampling_params()
    assert plain.temperature == 1.0 and plain.max_tokens == 16
    assert len(llm.generate(["hello"])[0].outputs[0].token_ids) <= 16
    (model / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
         "repetition_penalty": 1.05, "max_new_tokens": 40}))
    tuned = llm.get_default_sampling_params()
    assert (tuned.temperature, tuned.top_p, tuned.top_k, tuned.repetition_penalty, tuned.max_tokens) == \
        (0.7, 0.8, 20, 1.05, 40)
    (model / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.7}))
    assert llm.get_default_sampling_params().greedy
    (model / "generation_config.json").write_text(json.dumps({"temperature": -3}))  # out of range: vLLM's defaults
    assert llm.get_default_sampling_params().temperature == 1.0
