"""Ray Data: the engine as a `Dataset.map_batches` processor, so a corpus Ray Data reads (`read_json`,
`read_parquet`, from any filesystem it reads) streams through SpecOffload and is written back with its writers.

    import ray
    from specoffload.actors.ray_data import LLMProcessor

    ds = ray.data.read_json("s3://bucket/prompts.jsonl")          # rows with a "prompt" column
    ds = ds.map_batches(LLMProcessor, concurrency=2, batch_size=64,   # two actors, one engine each
                        fn_constructor_kwargs={"model": "/models/target", "device_memory": "4GiB",
                                               "sampling_params": {"max_tokens": 128}})
    ds.write_json("s3://bucket/out/")

Each actor holds one `LLM` (runtime/llm.py), built once; a batch of rows runs through it in one call, so its rows
share passes. A row's prompt is text or token ids; what comes back is the row with `generated_text`,
`generated_token_ids`, `finish_reason`, `num_drafted_tokens`, `num_accepted_tokens` and `error` added. A prompt the
engine refuses (empty, too long, ids outside the vocabulary) gets its message in `error` and empty outputs: the
batch runs on, no row is lost. Use this where a corpus already lives in Ray Data; the CLI job (`specoffload generate
--backend ray`) is the one with resume, OpenAI batch files and replicas that lease chunks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specoffload.runtime.engine import PromptError
from specoffload.runtime.llm import LLM
from specoffload.runtime.sampling import SamplingParams


class LLMProcessor:
    """A `map_batches` callable class: one engine per actor (module docstring).

    model: the target checkpoint; sampling_params: SamplingParams' fields as a dict (vLLM's names); prompt_column:
    the column holding each row's prompt; options: the rest of `LLM`'s keywords (draft, device_memory,
    speculative_config, ...).
    """

    def __init__(self, model: str, *, sampling_params: Mapping[str, Any] | None = None,
                 prompt_column: str = "prompt", **options: Any) -> None:
        self.llm = LLM(model, **options)
        self.params = SamplingParams(**dict(sampling_params or {}))
        self.prompt_column = prompt_column

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, list[Any]]:
        """batch: columns -> values (Ray Data's default "numpy" batch format; "pandas" and "pyarrow" work through
        their columns too); returns the batch's columns with the outputs added, one value per row."""
        if self.prompt_column not in batch:
            raise KeyError(f"LLMProcessor: no column {self.prompt_column!r} in the batch (columns: {sorted(batch)}); "
                           "pass prompt_column=")
        prompts = [_prompt(p) for p in batch[self.prompt_column]]
        encoded: dict[int, list[int]] = {}
        errors: list[str | None] = [None] * len(prompts)
        for i, prompt in enumerate(prompts):
            try:
                encoded[i] = self.llm.engine.encode(prompt, i)
            except PromptError as err:
                errors[i] = str(err)
        outputs: dict[int, Any] = {}
        if encoded:
            rows = list(encoded)
            done = self.llm.generate([{"prompt_token_ids": encoded[i]} for i in rows], self.params, use_tqdm=False)
            outputs = {i: out.outputs[0] for i, out in zip(rows, done)}
        columns = {name: list(values) for name, values in batch.items()}
        columns["generated_text"] = [outputs[i].text if i in outputs else "" for i in range(len(prompts))]
        columns["generated_token_ids"] = [list(outputs[i].token_ids) if i in outputs else []
                                          for i in range(len(prompts))]
        columns["finish_reason"] = [outputs[i].finish_reason if i in outputs else "error" for i in range(len(prompts))]
        columns["num_drafted_tokens"] = [outputs[i].num_drafted if i in outputs else 0
                                         for i in range(len(prompts))]
        columns["num_accepted_tokens"] = [outputs[i].num_accepted if i in outputs else 0
                                          for i in range(len(prompts))]
        columns["error"] = errors
        return columns


def _prompt(value: Any) -> str | list[int]:
    """A row's prompt: text, or token ids (a list, or the numpy array Ray Data hands over)."""
    if isinstance(value, str):
        return value
    if hasattr(value, "tolist"):
        value = value.tolist()
    return value if isinstance(value, str) else list(value)
