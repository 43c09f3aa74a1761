"""One offline job, start to end:

  1. open the output (locked; an existing one needs --resume or --overwrite) and detect the input's format;
  2. scan the input once, streamed: its SHA-256 and rows, and, when the KV length comes from the job, the longest
     prompt + new tokens;
  3. write the manifest, or on --resume check it and the rows already written, and cut back to the last whole chunk;
  4. stream the remaining rows through parse -> prepare -> chunks into the backend, and append the chunks it
     returns in input order (each row exactly once, error rows in their place);
  5. print the summary. Exit status 0 when every row has a result, 2 when some are error rows (or a mistake stopped
     the job before it began).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import asdict, dataclass, field, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Protocol

from specoffload.planner.plan import Plan

from ..config import EngineConfig
from ..models.config import ModelConfig
from ..planning import resolve_max_seq_len
from ..prompts import PromptFileError
from ..sampling import SamplingParams
from ..tokenizer import load_tokenizer
from .chunks import Chunk, ChunkDone, InOrder, chunked
from .formats import Format, input_format
from .manifest import Manifest, checkpoint_identity, row_files
from .output import OutputFile, Resumed, StdoutOutput
from .prepare import Limits, Preparer
from .progress import Progress
from .request_metrics import RequestMetricsLog
from .rows import RowError, RowJob
from .source import InputSource
from .unique import check_unique_ids

#: failed rows reported one line each on stderr; the rest are counted (every one is an error row in the output)
MAX_ERROR_LINES = 20
PLAN_SAMPLE = 256  # a planned job is planned on its first this many prompts (`_job_plan`)


class JobBackend(Protocol):
    def run(self, chunks: Iterator[Chunk], window: int) -> Iterator[ChunkDone]: ...
    def report(self) -> None: ...
    def summary(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class JobSpec:
    source: InputSource
    output: Path | None = None
    input_format: str = "auto"
    resume: bool = False
    overwrite: bool = False
    chunk_size: int = 256
    params: SamplingParams = field(default_factory=SamplingParams)
    progress: bool = True
    progress_interval: float = 10.0
    window: int = 8  # chunks handed out ahead of the oldest unwritten one, per worker
    summary: Path | None = None  # where to write the final summary as JSON
    choose_drafter: bool = False  # --drafter auto: measure the drafters on the job's prompts first (`_auto_drafter`)
    # a planned config is planned for the job here (`_job_plan`) and the backend runs that plan; False: the backend
    # plans itself (remote replicas measure and plan on their own nodes, not on the driver)
    plan_here: bool = True
    sampling_note: str | None = None  # the line that states the job's sampling and where its defaults came from


def run_job(spec: JobSpec, config: EngineConfig,
            open_backend: Callable[[EngineConfig, Plan | None], JobBackend]) -> int:
    """Run the job (see the module docstring); returns the exit status. open_backend(config, plan): the backend,
    given the plan made for this job (None: the engine plans for itself)."""
    if spec.chunk_size < 1:
        raise ValueError(f"--chunk-size must be >= 1, got {spec.chunk_size}")
    if spec.output is None and spec.resume:
        raise ValueError("--resume needs --output (rows on stdout cannot be resumed)")
    if spec.progress:  # the first phase: reading the input (a pass over it) and the model's config and tokenizer
        print(f"progress: reading {spec.source.name} and {Path(config.target).name}", file=sys.stderr, flush=True)
    fmt = input_format(spec.source, spec.input_format)
    out = OutputFile(spec.output, resume=spec.resume, overwrite=spec.overwrite) if spec.output else StdoutOutput()
    with closing(out):
        config, preparer, sha, total = _scan(spec, config, fmt)
        if spec.progress and spec.sampling_note:  # (the input checked: a bad row's error stays the one line)
            print(spec.sampling_note, file=sys.stderr, flush=True)
        if spec.choose_drafter:
            config = _auto_drafter(spec, config, fmt, preparer)
        loading = time.monotonic()  # (planning is part of loading the job)
        plan = _job_plan(spec, config, fmt, preparer) if config.planned and spec.plan_here else None
        out.start(_manifest(spec, config, fmt, sha, total, preparer.limits))
        resumed = out.resume(fmt, (fmt.parse(raw) for raw in spec.source.rows()), total, spec.chunk_size)
        _say_resumed(spec, resumed, total)
        if resumed.rows == total:
            print("nothing to do: every prompt has a row", file=sys.stderr)
            return 0
        writer = _Writer(spec, fmt, out, preparer, model_name=Path(config.target).name)
        progress = Progress(total, resumed.rows, spec.progress, spec.progress_interval,
                            max_tokens=spec.params.max_new_tokens)
        progress.created = loading
        rows = (preparer(fmt.parse(raw)) for raw in spec.source.rows(start=resumed.rows))
        wall, details = _generate(spec, config, lambda c: open_backend(c, plan), chunked(rows, spec.chunk_size),
                                  resumed, writer, progress)
        failed = resumed.failed + progress.tally.failed
        if failed:
            where = spec.output or "the output"
            print(f"specoffload: {failed} of {total} rows failed: each has an error row in {where}", file=sys.stderr)
        if spec.summary is not None:
            t = progress.tally
            record = {"rows": total, "resumed_rows": resumed.rows, "written_rows": t.rows, "failed_rows": failed,
                      "new_tokens": t.tokens, "chunks": t.chunks, "wall_s": wall, "tokens_per_s": t.tokens / wall,
                      "load_s": progress.load_s, "total_s": time.monotonic() - progress.created,
                      "acceptance": t.acceptance, "write_s": writer.seconds, "requests": writer.metrics.summary(),
                      # the job's phases, in order: loading (models, actors), generating (writing included), closing
                      "phases": {"load_s": progress.load_s, "generate_s": wall, "write_s": writer.seconds,
                                 "close_s": details.get("close_s")},
                      "backend": details}
            spec.summary.write_text(json.dumps(record, indent=2) + "\n")
        return 0  # the job ran: failed rows are error rows in the output, counted above (as `vllm run-batch`)


def _scan(spec: JobSpec, config: EngineConfig, fmt: Format) -> tuple[EngineConfig, Preparer, str, int]:
    """One streamed pass over the input: its SHA-256 and rows; the KV length when it comes from the job; the limits
    every row is prepared against."""
    model = ModelConfig.from_dir(config.target)
    tokenizer = load_tokenizer(config.target)
    sha, total = spec.source.identity()
    if total == 0:
        raise PromptFileError(f"{spec.source.name}: no prompts in file")
    if fmt.name == "openai":  # before the output is touched: a repeated custom_id stops the job (unique.py)
        check_unique_ids(spec.source.rows, fmt.parse, spec.source.where)
    limits = Limits(model.vocab_size, model.max_position_embeddings)
    if config.offloaded and config.max_seq_len is None:  # size the KV caches to the job, as `specoffload plan`
        config = replace(config, max_seq_len=_job_max_seq_len(spec, fmt, tokenizer, limits))
    if config.max_seq_len is not None:
        limits = replace(limits, max_seq_len=min(config.max_seq_len, limits.context))
    return config, Preparer(tokenizer, limits, spec.params, spec.chunk_size), sha, total


def _job_plan(spec: JobSpec, config: EngineConfig, fmt: Format, preparer: Preparer) -> Plan:
    """The plan for this job, made as `specoffload plan` makes it (runtime/warmup.py `plan_job`: a warm-up of the
    drafter on the job's prompts, then the search over the job's workload), from its first PLAN_SAMPLE rows: the
    batch is then never larger than the job and the plan is the one `plan` prints for the same prompts."""
    from ..engine import Engine
    from ..models.model import Transformer
    from ..offload.profiler import load_or_measure
    from ..planning import ModelPair
    from ..warmup import plan_job

    say = (lambda m: print(m, file=sys.stderr)) if spec.progress else (lambda m: None)  # noqa: E731
    prompts = []
    for raw in spec.source.rows():
        if isinstance(job := preparer(fmt.parse(raw)), RowJob):
            prompts.append(list(job.token_ids))
            if len(prompts) == PLAN_SAMPLE:
                break
    profile = load_or_measure(config, log=say, open_engine=Engine)
    models = ModelPair.for_config(config, Transformer(config.target, dtype=config.torch_dtype), shares_kv=True)
    assert config.max_seq_len is not None  # (offloaded: sized to the job by _scan)
    planned = plan_job(config, models, prompts, spec.params, config.max_seq_len, profile=profile, log=say).plan
    say(f"plan: {planned.describe()}, for this job's {len(prompts)} first prompts")
    return planned


def _auto_drafter(spec: JobSpec, config: EngineConfig, fmt: Format, preparer: Preparer) -> EngineConfig:
    """--drafter auto: every candidate drafter measured on the job's prompts and planned (runtime/drafter_choice.py;
    the table on stderr); the config then runs the chosen drafter at the chosen plan's batch and k (fixed: the
    measured acceptance chose them, the engine's own plan would use the prior)."""
    from ..drafter_choice import choose_drafter
    from ..engine import Engine
    from ..models.model import Transformer
    from ..offload.profiler import load_or_measure

    if not config.offloaded or config.max_seq_len is None:
        raise ValueError("--drafter auto plans against a memory budget: give --device-memory")
    prompts = [job.token_ids for raw in spec.source.rows() if isinstance(job := preparer(fmt.parse(raw)), RowJob)]
    say = (lambda m: print(m, file=sys.stderr)) if spec.progress else (lambda m: None)  # noqa: E731
    profile = load_or_measure(config, log=say, open_engine=Engine)
    choice = choose_drafter(config, Transformer(config.target, dtype=config.torch_dtype), prompts, spec.params,
                            config.max_seq_len, profile)
    best = choice.best
    print(f"--drafter auto: {best.drafter}, batch {best.plan.batch}, k = {best.plan.k} (predicted "
          f"{best.predicted:.4g} tokens/s; measured on the job's prompts in {choice.seconds:.0f} s)\n"
          f"{choice.table()}", file=sys.stderr)
    return choice.config(config)


def _generate(spec: JobSpec, config: EngineConfig, open_backend: Callable[[EngineConfig], JobBackend],
              chunks: Iterator[Chunk], resumed: Resumed, writer: _Writer, progress: Progress
              ) -> tuple[float, dict[str, Any]]:
    """Hand the chunks to the backend and write what comes back in input order; returns (seconds, its summary)."""
    backend = open_backend(config)
    progress.generating(getattr(backend, "committed_tokens", None))  # (the Ray backends count rows written)
    start = time.perf_counter()
    try:
        order = InOrder(first=resumed.rows // spec.chunk_size)
        for done in backend.run(chunks, spec.window):
            for ready in order.add(done):
                progress.update(*writer.write(ready))
        wall = time.perf_counter() - start
        progress.close()
        _summary(progress, wall, config.drafter_class.proposes, progress.load_s or 0.0)
        backend.report()
        details = backend.summary()
    finally:
        progress.close()
        closing_at = time.perf_counter()
        backend.close()
    return wall, details | {"close_s": time.perf_counter() - closing_at}  # (e.g. Ray replicas shutting down)


class _Writer:
    """Turns a done chunk into output rows (stop strings applied, errors reported) and appends them."""

    def __init__(self, spec: JobSpec, fmt: Format, out: OutputFile | StdoutOutput, preparer: Preparer,
                 model_name: str) -> None:
        self.spec, self.fmt, self.out, self.preparer, self.model = spec, fmt, out, preparer, model_name
        self.errors = 0
        self.seconds = 0.0  # rendering and appending rows
        self.metrics = RequestMetricsLog()  # per written prompt row (this run's rows only)

    def write(self, done: ChunkDone) -> tuple[int, int, int, int, int]:
        """Append the chunk's rows; returns (rows, failed, tokens, drafted, accepted) for the progress."""
        t0 = time.perf_counter()
        results = iter(done.results)
        lines: list[dict[str, Any]] = []
        failed = tokens = drafted = accepted = 0
        for row in done.chunk.rows:
            if isinstance(row, RowError):
                lines.append(self.fmt.error_row(row))
                failed += 1
                self._report(row)
                continue
            samples = [next(results) for _ in range(row.params.n)]  # Chunk.jobs' order; cut at stop strings already
            self.metrics.add(samples)
            lines.append(self.fmt.result_row(row, samples[0] if len(samples) == 1 else samples, self.model,
                                             tokenizer=self.preparer.tokenizer))
            tokens += sum(len(r.token_ids) for r in samples)
            drafted += sum(r.num_drafted for r in samples)
            accepted += sum(r.num_accepted for r in samples)
        self.out.append(lines)
        self.seconds += time.perf_counter() - t0
        return len(lines), failed, tokens, drafted, accepted

    def _report(self, error: RowError) -> None:
        self.errors += 1
        if self.errors <= MAX_ERROR_LINES:
            what = f" (custom_id {error.custom_id!r})" if error.custom_id is not None else ""
            print(f"specoffload: error: {self.spec.source.where(error.lineno)}{what}: {error.message}", file=sys.stderr)
        elif self.errors == MAX_ERROR_LINES + 1:
            print("specoffload: more rows failed; they are counted in the summary", file=sys.stderr)


def _job_max_seq_len(spec: JobSpec, fmt: Format, tokenizer: Any, limits: Limits) -> int:
    """The longest row's prompt + new tokens (rows that cannot run do not count), at most the context."""
    preparer = Preparer(tokenizer, limits, spec.params, spec.chunk_size)
    longest = 0
    for raw in spec.source.rows():
        job = preparer(fmt.parse(raw))
        if isinstance(job, RowJob):
            longest = max(longest, len(job.token_ids) + job.params.max_new_tokens)
    return min(longest, limits.context) if longest else resolve_max_seq_len(None, limits.context)


def _engine_record(config: EngineConfig, limits: Limits) -> dict[str, Any]:
    """The engine options that can change a row: dtypes, the drafter and its options, k, batch, the max lengths."""
    drafter = config.drafter_class
    options = asdict(drafter.settings(config))
    return {"dtype": config.dtype, "draft_dtype": str(config.draft_torch_dtype).removeprefix("torch.")
            if drafter.needs_checkpoint else None, "drafter": config.drafter_name, "drafter_options": options,
            "num_draft_tokens": config.num_draft_tokens, "max_batch_size": config.max_batch_size,
            "max_seq_len": limits.max_seq_len, "context": limits.context}


def _manifest(spec: JobSpec, config: EngineConfig, fmt: Format, sha: str, total: int, limits: Limits) -> Manifest:
    draft = config.draft if config.drafter_class.needs_checkpoint else None
    try:
        ours = version("specoffload")
    except PackageNotFoundError:
        ours = None
    return Manifest(
        input={"sha256": sha, "rows": total, "format": fmt.name, "max_line_bytes": spec.source.max_line_bytes},
        models={"target": checkpoint_identity(config.target), "draft": checkpoint_identity(draft)},
        files={"target": row_files(config.target), "draft": row_files(draft)},
        engine=_engine_record(config, limits),
        sampling=asdict(spec.params),
        chunk_size=spec.chunk_size,
        info={"input": spec.source.name, "target": str(config.target),
              "draft": None if config.draft is None else str(config.draft), "specoffload": ours,
              "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
    )


def _say_resumed(spec: JobSpec, resumed: Resumed, total: int) -> None:
    if resumed.dropped:
        print(f"resuming {spec.output}: {resumed.dropped} row(s) of unfinished chunks will be generated again",
              file=sys.stderr)
    if resumed.rows:
        print(f"resuming {spec.output}: {resumed.rows} of {total} prompts already done", file=sys.stderr)


def _summary(progress: Progress, wall: float, drafting: bool, load_s: float = 0.0) -> None:
    t = progress.tally
    failed = f" ({t.failed} failed)" if t.failed else ""
    line = (f"{t.rows - t.failed} prompts{failed}, {t.tokens} new tokens in {wall:.1f} s of generation "
            f"(+ {load_s:.1f} s loading): {t.tokens / max(wall, 1e-9):.1f} tokens/s")
    if drafting:
        line += f", acceptance {t.acceptance:.2f} ({t.accepted}/{t.drafted} draft tokens)"
    print(line, file=sys.stderr)
