"""`specoffload` command line: `specoffload generate ...`."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from specoffload.planner.errors import SpecOffloadError

from . import quantize
from .config import EngineConfig
from .models.config import SUPPORTED_ARCHITECTURES
from .models.gguf import gguf_file_in, resolve_model
from .offload.drafters import DRAFTERS

if TYPE_CHECKING:
    from .drafter_choice import DrafterChoice
from .prompts import PromptFileError
from .sampling import SamplingParams

DRAFTER_HELP = (f"who drafts, by registry name ({', '.join(sorted(DRAFTERS))}; runtime/offload/drafters.py); "
                "default: from --draft (none without it, model with a checkpoint, self for 'self')")
PLAN_DRAFTER_HELP = (DRAFTER_HELP + "; auto: measure none, model (with --draft), ngram, suffix and self (an MoE "
                     "target) on the --prompts and pick the best predicted")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it is None / False (nothing to show) or the help already states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if any(action.default is v for v in (None, False, argparse.SUPPRESS)) or "default" in help_text:
            return help_text
        return super()._get_help_string(action)


DTYPES = ["auto", "float32", "bfloat16", "float16"]
DTYPE_HELP = ("compute dtype; auto: the checkpoint's where the CPU computes it well (a float16 checkpoint computes "
              "in float32, a bfloat16 one in bfloat16)")


def _add_model_flags(g: argparse._ArgumentGroup, *, budget_required: bool = False, drafter_help: str = DRAFTER_HELP,
                     ) -> None:
    """The model flags `generate` and `plan` share: vLLM's spelling first, today's as an alias."""
    g.add_argument("--model", "--target", dest="target", required=True, metavar="DIR",
                   help="target checkpoint directory (HF safetensors) of a supported architecture: "
                        + ", ".join(SUPPORTED_ARCHITECTURES))
    g.add_argument("--speculative-model", "--draft", dest="draft", default=None, metavar="DIR",
                   help="draft checkpoint directory (same vocabulary); 'self': an MoE target drafts with its resident "
                        "experts (needs --device-memory); omit for none")
    g.add_argument("--drafter", default=None, help=drafter_help)
    g.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    g.add_argument("--device", default="cpu", metavar="cpu|cuda[:N]|auto",
                   help="where the target's FFN / experts, its resident parts and the draft compute; offloaded on "
                        "cuda, attention and the KV cache stay on the CPU (auto: cuda when torch sees a GPU)")


SAMPLING_GROUP = ("sampling (unset: the model's generation_config.json, else vLLM's defaults, as vLLM; an OpenAI "
                  "batch row's own fields override these)")
#: the sampling flags whose unset default comes from the model (sampling.py `model_defaults`) -> SamplingParams field
MODEL_SAMPLING = {"max_new_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p",
                  "top_k": "top_k", "repetition_penalty": "repetition_penalty"}


def _add_model_sampling_flags(s: argparse._ArgumentGroup) -> None:
    """The sampling flags `generate` and `plan` share; unset, each takes the model's default (`job_sampling`)."""
    s.add_argument("--max-tokens", "--max-new-tokens", dest="max_new_tokens", type=int, default=None, metavar="N",
                   help="new tokens per prompt at most (vLLM's default: 16)")
    s.add_argument("--temperature", type=float, default=None, help="0: greedy (vLLM's default: 1.0)")
    s.add_argument("--top-p", type=float, default=None, help="nucleus: the most likely tokens of this mass")
    s.add_argument("--top-k", type=int, default=None, help="the k most likely tokens; 0 or -1: off")
    s.add_argument("--repetition-penalty", type=float, default=None, help="CTRL's, on prompt and output tokens")


def job_sampling(args: argparse.Namespace) -> tuple[dict[str, object], str]:
    """The job's sampling fields of MODEL_SAMPLING: each flag given, else the model's generation_config.json, else
    SamplingParams' own (vLLM's) defaults (sampling.py `model_defaults`); and the line that states them."""
    from .sampling import SamplingParams, model_defaults

    defaults, source = model_defaults(args.target)
    defaults = {("max_new_tokens" if k == "max_tokens" else k): v for k, v in defaults.items()}
    given = {field: getattr(args, dest) for dest, field in MODEL_SAMPLING.items() if getattr(args, dest) is not None}
    fields = defaults | given
    p = SamplingParams(**fields)
    flags = ", ".join(f"--{k.replace('_', '-')}" for k in given)
    how = "greedy" if p.greedy else f"temperature {p.temperature:g}, top-p {p.top_p:g}, top-k {p.top_k or 'off'}"
    whence = f"{flags} given; the rest from {source}" if flags else f"from {source}"
    return fields, (f"sampling: {how}, repetition penalty {p.repetition_penalty:g}, at most {p.max_new_tokens} new "
                    f"tokens per prompt ({whence})")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete prompts from a file (or HumanEval) into JSONL",
                       allow_abbrev=False, formatter_class=_HelpFormatter)
    m = p.add_argument_group("model")
    _add_model_flags(m, drafter_help=PLAN_DRAFTER_HELP + " (needs --device-memory)")
    m.add_argument("--exact", default="off", choices=["on", "off", "auto"],
                   help="on: compute each row as it would be computed alone (fixed-shape GEMMs, attention per "
                        "query), so the output does not depend on the batch or the drafter, in bfloat16 too, at a "
                        "compute cost (0.56x resident); auto: on where the planned pass waits on its reads long "
                        "enough to hide that cost (README, \"What lossless means\")")
    m.add_argument("--draft-dtype", default=None, choices=DTYPES,
                   help="the draft model's compute dtype (default: --dtype); bfloat16 halves its memory")
    m.add_argument("--num-speculative-tokens", "-k", "--num-draft-tokens", dest="num_draft_tokens",
                   type=_int_or_auto, default=None, metavar="K",
                   help="draft tokens per step, or 'auto' (planner; the default with --device-memory, else 4)")
    m.add_argument("--max-num-seqs", "--batch-size", dest="batch_size", type=_int_or_auto, default=None,
                   metavar="N", help="max rows decoded together, or 'auto' (the default with --device-memory, else 16)")
    m.add_argument("--max-model-len", "--max-seq-len", dest="max_seq_len", type=int, default=None, metavar="N",
                   help="prompt + output tokens per row the KV caches are sized for (default: the job's longest "
                        "prompt + --max-tokens, as `specoffload plan` sizes them)")

    s = p.add_argument_group(SAMPLING_GROUP)
    _add_model_sampling_flags(s)
    s.add_argument("--min-tokens", type=int, default=0, metavar="N", help="EOS and stop ids masked until N tokens")
    s.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, per generated token seen")
    s.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, per generated occurrence")
    s.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="a stop string (repeat the flag for several); the text is cut before it")
    s.add_argument("--seed", type=int, default=None, help="the job's random stream (default: a random one)")
    s.add_argument("--ignore-eos", action="store_true", help="run every row to --max-tokens")

    j = p.add_argument_group("job: input, output, resume")
    src = j.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", type=Path,
                     help=".jsonl ({'prompt': ...} or {'token_ids': [...]}, or OpenAI batch requests) or .txt file")
    src.add_argument("--humaneval", type=int, metavar="N", help="the first N HumanEval prompts (0: all 164)")
    src.add_argument("--dataset", metavar="NAME[:start[:end]]",
                     help="a pinned corpus (runtime/corpora.py): aclsum (paper summaries, 100) or sharegpt (chat "
                          "first turns), prompts start..end-1, e.g. aclsum:0:16")
    j.add_argument("--input-format", default="auto", choices=["auto", "simple", "openai"],
                   help="simple: {'prompt'|'token_ids'} rows; openai: OpenAI Batch API requests (custom_id, url, "
                        "body); auto (the default): openai when the first row has custom_id/url/body. Output follows "
                        "it")
    j.add_argument("--output", "-o", type=Path, default=None,
                   help="output JSONL, one row per input row in input order (default: stdout)")
    j.add_argument("--resume", action="store_true",
                   help="keep the rows already in --output and generate only the missing prompts")
    j.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    j.add_argument("--chunk-size", type=int, default=256,
                   help="prompts per chunk; each finished chunk is appended to --output and fsynced")
    j.add_argument("--summary", type=Path, default=None,
                   help="also write the final summary as JSON here (rows, failed rows, tokens/s, per replica)")
    j.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")

    _add_drafter_options(p)

    o = p.add_argument_group("memory and offload (set --device-memory to stream the target's weights)")
    o.add_argument("--device-memory", default=None, help="memory budget where compute runs, e.g. 3GiB")
    o.add_argument("--host-memory", default=None, help="host RAM for the target KV cache / ram tier")
    o.add_argument("--weights-tier", default="disk", choices=["disk", "ram"], help="where streamed weights live")
    o.add_argument("--num-buffers", type=int, default=2, help="ring slots of streamed layer weights")
    o.add_argument("--expert-loading", default="auto", choices=["auto", "selected", "all"],
                   help="MoE: load only the experts the router picked, every expert, or choose")
    o.add_argument("--packed-weights", default="auto", choices=["auto", "on", "slots", "off"],
                   help="a compressed checkpoint's (int8, int4, GGUF q4) weights: keep them packed, resident and "
                        "streamed, where the layers multiply by them faster (auto: bfloat16 on a CPU with native "
                        "bfloat16), always, in the ring slots only, or never")
    o.add_argument("--interleave", default=None, choices=["on", "off", "auto"],
                   help="with a draft: on: two batches alternate; off: one batch drafts between its passes; "
                        "auto: the planner chooses (default: off for a model-free drafter, else on)")
    o.add_argument("--expert-group", type=int, default=None,
                   help="MoE: experts per ring slot of a streamed layer (default: the whole layer per slot)")
    o.add_argument("--no-refill", action="store_true",
                   help="a batch waits for its slowest row, then takes a new wave (default: a finished row's slot "
                        "takes a waiting prompt at once)")
    o.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens any streamed pass feeds at most, a bound on its activations (default: the "
                        "planner's, beside decoding rows only)")
    o.add_argument("--kv-block-size", type=int, default=0,
                   help="positions per block of the target's paged KV cache (0: contiguous caches per batch)")

    r = p.add_argument_group("Ray")
    r.add_argument("--backend", default="local",
                   help="local: one process; ray: the Ray actor runtime (needs --device-memory); any other name "
                        "registered under the 'specoffload.backends' entry points")
    r.add_argument("--replicas", type=_int_or_auto, default=None,
                   help="--backend ray: engines to run, one per node (placement groups), sharing the corpus in "
                        "leased chunks; 'auto': one on every node that can host one (default 1)")
    r.add_argument("--ray-address", default=None,
                   help="Ray to join with --backend ray (default: RAY_ADDRESS, e.g. inside `ray job submit`, "
                        "else a local Ray)")

    d = p.add_argument_group("diagnostics")
    d.add_argument("--no-progress", action="store_true", help="no progress bar or lines")
    d.add_argument("--progress-interval", type=float, default=10.0,
                   help="seconds between progress lines when stderr is not a terminal (e.g. `ray job logs`)")
    d.add_argument("--trace", type=Path, default=None,
                   help="write a Chrome/Perfetto trace JSON of the pipeline's ops")
    d.add_argument("--show-placement", action="store_true", help="print the memory placement table to stderr")


def _int_or_auto(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="measure the hardware profile and print the planner's choice of batch and k",
                       allow_abbrev=False, formatter_class=_HelpFormatter)
    m = p.add_argument_group("model")
    _add_model_flags(m, drafter_help=PLAN_DRAFTER_HELP)
    m.add_argument("--max-model-len", "--max-seq-len", dest="max_seq_len", type=int, default=None, metavar="N",
                   help="prompt + output tokens per row (default: the job's longest prompt + --max-tokens)")
    m.add_argument("--max-num-seqs", "--batch-size", dest="batch_size", type=_int_or_auto, default="auto",
                   metavar="N", help="fix the batch instead of planning it")
    m.add_argument("--num-speculative-tokens", "-k", "--num-draft-tokens", dest="num_draft_tokens",
                   type=_int_or_auto, default="auto", metavar="K", help="fix k instead of planning it")
    o = p.add_argument_group("memory")
    o.add_argument("--device-memory", required=True, help="memory budget, e.g. 4.5GiB")
    o.add_argument("--host-memory", default=None)
    o.add_argument("--weights-tier", default="disk", choices=["disk", "ram"])
    j = p.add_argument_group("job")
    j.add_argument("--prompts", type=Path, default=None,
                   help="the job's prompts: workload shape, and a short warm-up that measures the acceptance rate")
    j.add_argument("--alpha", type=float, default=None, help="acceptance rate to assume (default: measure / 0.7)")
    _add_model_sampling_flags(p.add_argument_group(SAMPLING_GROUP.split(";")[0] + "; the warm-up drafts with it)"))
    _add_drafter_options(p)
    d = p.add_argument_group("output")
    d.add_argument("--top", type=int, default=8, help="alternatives to print")
    d.add_argument("--quick-profile", action="store_true", help="fewer measurement points")


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure this machine's hardware profile for a model ahead of a job (cached, "
                       "shared by every drafter; a drafter's own step is timed on top)", allow_abbrev=False,
                       formatter_class=_HelpFormatter)
    m = p.add_argument_group("model")
    _add_model_flags(m)
    o = p.add_argument_group("memory")
    o.add_argument("--device-memory", required=True, help="the jobs' memory budget, e.g. 2GiB (the calibration "
                   "passes stream under it)")
    o.add_argument("--host-memory", default=None)
    o.add_argument("--weights-tier", default="disk", choices=["disk", "ram"])
    _add_drafter_options(p)
    d = p.add_argument_group("measuring")
    d.add_argument("--force", action="store_true", help="measure again even if a usable profile is cached")
    d.add_argument("--quick", action="store_true", help="fewer measurement points and repetitions (a test's)")


def _profile(args: argparse.Namespace) -> int:
    """`specoffload profile`: the cached profile (measured first when there is none usable, or with --force), its
    rates and the conditions it was measured in, on stdout."""
    import time

    from .engine import Engine
    from .offload import profiler

    config = EngineConfig(target=args.target, draft=args.draft, drafter=args.drafter, dtype=args.dtype,
                          device=args.device, device_memory=args.device_memory, host_memory=args.host_memory,
                          weights_tier=args.weights_tier, drafter_options=drafter_options(args))
    path = profiler.profile_path(config)
    if args.force:
        profiler.mark_stale(config, "asked to measure again (--force)")
    start = time.monotonic()
    profile = profiler.load_or_measure(config, open_engine=Engine, quick=args.quick,
                                       log=lambda m: print(m, file=sys.stderr, flush=True))
    conditions = profile.provenance.get("conditions") or {}
    gemm = ", ".join(f"{rows}: {rate / 1e9:.1f}" for rows, rate in profile.ffn_flops_per_s)
    steps = ", ".join(f"{rows}: {s * 1e3:.2f}" for rows, s in profile.draft_step_s)
    others, spread = conditions.get("others_cores"), conditions.get("spread")
    print(f"hardware profile of {Path(args.target).name} ({profile.provenance.get('dtype')}, "
          f"{profile.weights_tier} tier, {profile.provenance.get('format')}): {path}")
    print(f"  measured {profile.provenance.get('date')}; this call took {time.monotonic() - start:.1f} s")
    print(f"  stream into slots   {profile.stream_bytes_per_s / 1e9:.2f} GB/s")
    print(f"  FFN GEMM (rows: GFLOP/s)   {gemm}")
    print(f"  attention           {profile.attention_fit[0] * 1e6:.0f} us + {profile.attention_fit[1] * 1e6:.2f} us "
          f"x tokens + {profile.attention_fit[2] * 1e9:.3f} ns x tokens x attended, per layer")
    print(f"  overheads           {profile.pass_overhead_s * 1e3:.2f} ms per pass + "
          f"{profile.position_overhead_s * 1e6:.1f} us per position")
    print(f"  draft step of {config.drafter_name!r} (rows: ms)   {steps}")
    print("  conditions          " + (f"other processes {others:.2f} cores" if others is not None else
                                      "others' load unknown") +
          (f", largest spread {spread:.0%} ({conditions.get('spread_of')})" if spread is not None else "") +
          (f"; DISTURBED: {conditions['disturbed']}" if conditions.get("disturbed") else ""))
    return 0


def _plan(args: argparse.Namespace) -> int:
    from specoffload.planner import Workload
    from specoffload.planner.units import format_bytes

    from .drafter_choice import choose_drafter
    from .engine import Engine
    from .models.model import Transformer
    from .offline.prompt_file import read_prompts_file
    from .offload.profiler import load_or_measure, profile_path
    from .planning import ModelPair, job_max_seq_len, make_plan
    from .tokenizer import load_tokenizer
    from .warmup import plan_job

    prompts = read_prompts_file(args.prompts) if args.prompts else []
    auto = args.drafter == "auto"
    if auto and not prompts:
        raise ValueError("--drafter auto measures each drafter on the job's prompts: give --prompts")
    base = EngineConfig(target=args.target, draft=args.draft, drafter=None if auto else args.drafter, dtype=args.dtype,
                        device=args.device, device_memory=args.device_memory,
                        host_memory=args.host_memory, weights_tier=args.weights_tier, max_seq_len=args.max_seq_len,
                        num_draft_tokens=args.num_draft_tokens, max_batch_size=args.batch_size,
                        drafter_options=drafter_options(args))
    sampling, note = job_sampling(args)
    print(note, file=sys.stderr)
    max_new = SamplingParams(**sampling).max_new_tokens  # the flag, the model's default, else vLLM's 16
    max_seq_len = job_max_seq_len(base, prompts, max_new)
    config = replace(base, max_seq_len=max_seq_len)  # what `specoffload generate` sizes the KV caches to
    profile = load_or_measure(config, quick=args.quick_profile, log=lambda m: print(m, file=sys.stderr),
                              open_engine=Engine)
    print(f"hardware profile: {profile_path(config)}", file=sys.stderr)
    tok = load_tokenizer(args.target) if any(isinstance(p, str) for p in prompts) else None
    encoded = [tok.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p) for p in prompts]
    target = Transformer(args.target, dtype=base.torch_dtype)  # shapes only: no weights are loaded
    models = ModelPair.for_config(config, target, shares_kv=True)  # as the local backend's engine counts it
    params = SamplingParams(**sampling, ignore_eos=True)
    if auto:
        return _print_choice(args, choose_drafter(config, target, encoded, params, max_seq_len, profile,
                                                  quick=args.quick_profile), max_seq_len)
    if encoded and args.alpha is None:  # the warm-up on the job's prompts, then the maximin search over its range
        job = plan_job(config, models, encoded, params, max_seq_len, profile=profile)
        plan, workload = job.plan, job.workload
        alpha_source = job.warmup.describe() if job.warmup is not None else "no draft"
        if job.replayed is not None:
            alpha_source = (f"{job.replayed.alpha:.3f} per proposed token, match rate {job.replayed.match_rate:.0%} "
                            f"(replayed on a no-draft warm-up of the job's prompts)")
    else:
        alpha = args.alpha if args.alpha is not None else base.acceptance_prior
        alpha_source = "--alpha" if args.alpha is not None else "prior (no prompts to measure it on)"
        workload = (Workload.of_prompts([len(p) for p in encoded], max_new) if encoded else
                    Workload(num_prompts=256, prompt_len=max_seq_len / 2, new_tokens=max_new))
        plan = make_plan(config, models, max_seq_len, workload=workload, alpha=alpha, profile=profile)
        alpha_source = f"{alpha:.3f} ({alpha_source})"
    print(f"workload: {workload.num_prompts} prompts x {workload.prompt_len:.0f} tokens, "
          f"{workload.new_tokens} new tokens, KV sized for {max_seq_len} tokens per row; "
          f"acceptance alpha = {alpha_source}")
    if plan.policy is None:
        print(f"fixed plan (--batch-size and -k given): {plan.describe()}")
        return 0
    best = plan.policy
    print(f"chosen policy: batch {best.decode_batch} (prefill = decode = draft batch), k = {best.k}: "
          f"predicted {best.predicted_tokens_per_s:.2f} tokens/s")
    print(best.placement_table)
    print("\n| batch | k | predicted tok/s | at the low end of alpha | worst ratio to best | bound | device memory |")
    print("|---:|---:|---:|---:|---:|---|---:|")
    for p in plan.alternatives[: args.top]:
        bound = p.estimate.step.bound if p.estimate is not None else ""
        low = f"{p.predicted_low:.2f}" if p.predicted_low is not None else ""
        print(f"| {p.decode_batch} | {p.k} | {p.predicted_tokens_per_s:.2f} | {low} | {p.worst_ratio:.2f} | {bound} | "
              f"{format_bytes(int(p.memory.get('device_footprint', 0)))} |")
    print(f"\nrun it: specoffload generate ... --device-memory {args.device_memory} --max-seq-len {max_seq_len} "
          f"--batch-size {best.decode_batch} -k {best.k}")
    return 0


def _print_choice(args: argparse.Namespace, choice: DrafterChoice, max_seq_len: int) -> int:
    """`specoffload plan --drafter auto`: the drafters compared, the chosen plan and how to run it."""
    workload, best = choice.workload, choice.best
    print(f"workload: {workload.num_prompts} prompts x {workload.prompt_len:.0f} tokens, {workload.new_tokens} new "
          f"tokens ({workload.mean_new_tokens:.0f} on average), KV sized for {max_seq_len} tokens per row; drafters "
          f"measured on the job's prompts in {choice.seconds:.0f} s")
    print(choice.table())
    policy = best.plan.policy
    print(f"\nchosen drafter: {best.drafter}, batch {best.plan.batch}, k = {best.plan.k}: predicted "
          f"{best.predicted:.4g} tokens/s")
    if policy is not None:
        print(policy.placement_table)
    k = f" -k {best.plan.k}" if best.plan.k else ""
    print(f"\nrun it: specoffload generate ... --device-memory {args.device_memory} --max-seq-len {max_seq_len} "
          f"--batch-size {best.plan.batch} --drafter {best.drafter}{k}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from .backends import BackendOptions, load_backend
    from .offline.job import JobSpec, run_job
    from .offline.source import InputSource

    if args.drafter == "auto" and args.device_memory is None:
        raise ValueError("--drafter auto plans against a memory budget: give --device-memory")
    if args.prompts:
        source = InputSource.file(args.prompts)
    elif args.dataset:
        source = InputSource.dataset(args.dataset)
    else:
        source = InputSource.humaneval(args.humaneval)
    sampling, note = job_sampling(args)
    params = SamplingParams(
        **sampling,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        min_tokens=args.min_tokens,
        stop=tuple(args.stop or ()),
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )
    config = EngineConfig(
        target=args.target,
        draft=args.draft,
        device=args.device,
        drafter=None if args.drafter == "auto" else args.drafter,
        dtype=args.dtype,
        draft_dtype=args.draft_dtype,
        num_draft_tokens=args.num_draft_tokens,
        max_batch_size=args.batch_size,
        num_threads=args.threads,
        device_memory=args.device_memory,
        host_memory=args.host_memory,
        weights_tier=args.weights_tier,
        num_buffers=args.num_buffers,
        max_seq_len=args.max_seq_len,
        expert_loading=args.expert_loading,
        expert_group=args.expert_group,
        packed_weights=args.packed_weights,
        interleave={"on": True, "off": False, None: None}.get(args.interleave, "auto"),
        refill=not args.no_refill,
        prefill_chunk=args.prefill_chunk,
        kv_block_size=args.kv_block_size,
        trace=args.trace is not None,
        exact={"on": True, "off": False}.get(args.exact, "auto"),
        drafter_options=drafter_options(args),
    )
    spec = JobSpec(source=source, output=args.output, input_format=args.input_format, resume=args.resume,
                   overwrite=args.overwrite, chunk_size=args.chunk_size, params=params, progress=not args.no_progress,
                   progress_interval=args.progress_interval, summary=args.summary,
                   choose_drafter=args.drafter == "auto", plan_here=args.backend == "local", sampling_note=note)
    options = BackendOptions(progress=not args.no_progress, show_placement=args.show_placement, trace=args.trace,
                             ray_address=args.ray_address, replicas=args.replicas)
    backend = load_backend(args.backend)  # an unknown name fails before any file is touched
    return run_job(spec, config, lambda job_config, plan: backend(job_config, options, plan=plan))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specoffload")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _add_drafter_options(p: argparse.ArgumentParser) -> None:
    """A flag per registered drafter option (runtime/offload/drafters/: each drafter's `options` dataclass), in a
    group per drafter: `prompt_lookup_max` is --prompt-lookup-max. Unset flags keep the drafter's default."""
    seen: set[type] = set()  # (a drafter registered under two names has one group)
    for name, cls in DRAFTERS.items():
        fields = dataclasses.fields(cls.options)
        if not fields or cls.options in seen:
            continue
        seen.add(cls.options)
        g = p.add_argument_group(f"drafter {name!r} options")
        for f in fields:
            kind = type(f.default) if f.default is not None else int  # (an option without a default: a count)
            g.add_argument(f"--{f.name.replace('_', '-')}", dest=f"drafter_option_{f.name}", type=kind, default=None,
                           metavar=f.name.split("_")[-1].upper(),
                           help=f"{f.metadata.get('help', '')} (default {f.default})")


def drafter_options(args: argparse.Namespace) -> dict[str, object]:
    """The drafter options given on the command line (`_add_drafter_options`)."""
    prefix = "drafter_option_"
    return {key.removeprefix(prefix): value for key, value in vars(args).items()
            if key.startswith(prefix) and value is not None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specoffload", description=__doc__, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"specoffload {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_plan(sub)
    _add_profile(sub)
    quantize.add_parser(sub)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse's message, with the closest flag this command knows (vLLM's spellings included)
        known = list(sub.choices[args.command]._option_string_actions)
        flag = next((u.split("=", 1)[0] for u in unknown if u.startswith("--")), "")
        close = difflib.get_close_matches(flag, known, n=1) if flag else []
        hint = f" (did you mean {close[0]}?)" if close else ""
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    try:
        for name in ("target", "draft", "model"):  # a GGUF (file, or a directory holding one): its companion
            value = getattr(args, name, None)
            if isinstance(value, (str, Path)) and str(value) != "self":
                value = Path(os.path.expanduser(str(value)))
                if gguf_file_in(value) is not None:
                    setattr(args, name, type(getattr(args, name))(resolve_model(value)))
        if args.command == "quantize":
            return quantize.run(args, lambda m: print(m, file=sys.stderr))
        if args.command == "generate":
            return _generate(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "profile":
            return _profile(args)
    except (SpecOffloadError, PromptFileError, ValueError, FileNotFoundError, OSError) as e:
        print(f"specoffload: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specoffload: interrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
