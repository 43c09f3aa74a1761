"""Build MoE checkpoints from the dense target (no MoE weights can be fetched here).

    python -m scripts.make_moe upcycle [--dense DIR] [--out DIR] [--experts 8] [--top-k 2] [--calibration F ...]
    python -m scripts.make_moe moefy   [--dense DIR] [--out DIR] [--experts 16] [--top-k 8] [--shared 3584] ...
    python -m scripts.make_moe measure --moe DIR [--dense DIR] [--prompts 100:132] [--greedy-tokens 32]

`upcycle`: sparse upcycling (Komatsuzaki et al. 2022), every expert a stored copy of the dense FFN and a
k-means router, so greedy output equals the dense model's. `moefy`: MoEfication (Zhang et al. 2022) with a
shared expert, the FFN's neurons split into experts that genuinely differ; it approximates the dense model
and, after building, measures how well on held-out HumanEval prompts (report.json beside the weights).
`measure`: top-1 agreement with the dense model, expert hotness per layer, and (--greedy-tokens) whether the
MoE model reproduces the dense model's greedy continuations. Details in scripts/moe/.

Calibration text is the Python standard library's own source (--calibration overrides it), never HumanEval.
Every build writes provenance.json (source hashes, method, parameters, calibration files, date).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from scripts.get_models import default_cache, model_dir
from scripts.moe.calibration import Calibration, load_calibration, stdlib_files, tokenizer_encoder
from scripts.moe.errors import MoEBuildError
from scripts.moe.moefy import MoefyParams, moefy
from scripts.moe.shards import PROVENANCE, source_record
from scripts.moe.upcycle import UpcycleParams, upcycle
from specoffload.runtime.models.config import ModelConfig
from specoffload.runtime.models.errors import CheckpointError, UnsupportedModelError

KINDS = ("upcycle", "moefy")
#: HumanEval prompts the moefy sizes were chosen on (selection) and those its report is measured on (held out)
SELECTION_PROMPTS = "0:32"
REPORT_PROMPTS = "100:132"
REPORT = "report.json"
#: calibration tokens per stdlib file (32 files): k-means of 8 centroids is cheap, per-neuron statistics are not
SEQ_LEN = {"upcycle": 256, "moefy": 128}


def default_out(kind: str, dense: Path, experts: int, cache: Path | None = None) -> Path:
    """e.g. qwen2.5-coder-1.5b-upcycled-8x, qwen2.5-coder-1.5b-moefied beside the dense model in the cache."""
    stem = dense.name.removesuffix("-instruct")
    name = f"{stem}-upcycled-{experts}x" if kind == "upcycle" else f"{stem}-moefied"
    return (cache or dense.parent) / name


def calibration_for(dense: Path, files: Sequence[str] | None, seq_len: int) -> Calibration:
    paths = [Path(f) for f in files] if files else stdlib_files()
    return load_calibration(paths, tokenizer_encoder(dense), seq_len)


def humaneval_rows(dense: Path, span: str) -> list[list[int]]:
    """Token ids of HumanEval prompts start:end (task order), with the dense model's tokenizer."""
    from specoffload.runtime.prompts import humaneval_prompts

    start, _, end = span.partition(":")
    prompts = humaneval_prompts()[int(start) : int(end) if end else None]
    if not prompts:
        raise MoEBuildError(f"no HumanEval prompts in {span!r}")
    encode = tokenizer_encoder(dense)
    return [encode(p) for p in prompts]


def measure(dense: Path, moe: Path, span: str, greedy_tokens: int = 0) -> dict[str, object]:
    """The measurement report of `moe` against `dense` on HumanEval prompts `span` (see scripts/moe/measure.py).

    The dense model runs first and is freed before the MoE model loads.
    """
    from scripts.moe import measure as m

    rows = humaneval_rows(dense, span)
    report: dict[str, object] = {"dense": str(dense), "moe": str(moe), "humaneval_prompts": span}
    if greedy_tokens:
        ref = m.greedy_reference(m.load_model(dense), rows, greedy_tokens)
        return report | {"greedy": m.greedy_identity(m.load_model(moe), ref)}
    ref = m.agreement_reference(m.load_model(dense), rows)
    return report | m.agreement(m.load_model(moe), ref)


def is_current(out: Path, dense: Path, parameters: dict[str, object]) -> bool:
    """True if `out` was built from this very dense checkpoint with these parameters."""
    try:
        record = json.loads((out / PROVENANCE).read_text())
    except (OSError, ValueError):
        return False
    source = record.get("source") or {}
    same = {k: v for k, v in record.get("parameters", {}).items() if k in parameters} == parameters
    return same and source.get("sha256") == source_record(dense)["sha256"]


def build_moe_models(dense: Path, kinds: Sequence[str], cache: Path | None = None) -> dict[str, Path]:
    """Build (or reuse) the default upcycled / moefied checkpoints of `dense`; used by get_models --moe."""
    from dataclasses import asdict

    built = {}
    for kind in kinds:
        params = UpcycleParams() if kind == "upcycle" else MoefyParams()
        out = default_out(kind, dense, params.experts, cache)
        if is_current(out, dense, asdict(params)):
            print(f"[{kind}] up to date: {out}")
        else:
            calibration = calibration_for(dense, None, SEQ_LEN[kind])
            record = (upcycle if kind == "upcycle" else moefy)(dense, out, calibration, params)  # type: ignore[arg-type]
            print(f"[{kind}] built in {record['build_seconds']:.0f} s: {out}")
            if kind == "moefy":
                _write_report(out, measure(dense, out, REPORT_PROMPTS))
        built[kind] = out
    return built


def write_compressed(moe: Path, scheme: str) -> Path:
    """A compressed copy of a built MoE checkpoint beside it (runtime/quantize.py), unless it exists."""
    from specoffload.runtime.formats import weight_format
    from specoffload.runtime.quantize import quantize_checkpoint

    try:
        spec = weight_format(scheme)
    except ValueError as exc:
        raise MoEBuildError(f"--compress: {exc}") from None
    out = moe.with_name(f"{moe.name}-{spec.label}")
    if not out.exists():
        quantize_checkpoint(moe, out, spec)
    return out


def _write_report(out: Path, report: dict[str, object]) -> None:
    (out / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    short = {k: v for k, v in report.items() if k != "load_per_layer"}
    print(json.dumps(short, indent=2))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m scripts.make_moe", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for kind, params in (("upcycle", UpcycleParams()), ("moefy", MoefyParams())):
        p = sub.add_parser(kind, help=f"build a{'n upcycled' if kind == 'upcycle' else ' MoEfied'} checkpoint")
        p.add_argument("--dense", type=Path, help="dense checkpoint (default: the fetched target)")
        p.add_argument("--out", type=Path, help="output directory (default: beside the dense model)")
        p.add_argument("--experts", type=int, default=params.experts, help="(routed) experts per layer")
        p.add_argument("--top-k", type=int, default=params.top_k, help="experts per token")
        p.add_argument("--calibration", nargs="+", metavar="FILE", help="calibration text files (default: stdlib)")
        p.add_argument("--seq-len", type=int, default=SEQ_LEN[kind], help="calibration tokens taken from each file")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--compress", default="", metavar="int8,int4",
                       help="also write compressed copies of the built model (`specoffload quantize`; int4 at group "
                            "64) beside it, named OUT-int8 / OUT-int4g64")
        if kind == "moefy":
            p.add_argument("--shared", type=int, default=params.shared, help="neurons of the shared expert")
            p.add_argument("--active-fraction", type=float, default=params.active_fraction)
            p.add_argument("--report-prompts", default=REPORT_PROMPTS, help="HumanEval start:end to measure on")
            p.add_argument("--no-report", action="store_true", help="skip the agreement measurement")
    m = sub.add_parser("measure", help="agreement with the dense model, expert hotness, greedy identity")
    m.add_argument("--moe", type=Path, required=True)
    m.add_argument("--dense", type=Path, help="dense checkpoint (default: the fetched target)")
    m.add_argument("--prompts", default=REPORT_PROMPTS, help="HumanEval start:end (default %(default)s)")
    m.add_argument("--greedy-tokens", type=int, default=0, help="check greedy identity over this many tokens")
    m.add_argument("--report", type=Path, help="also write the JSON report here")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    dense = (args.dense or model_dir("target")).expanduser()
    try:
        if not dense.is_dir():
            raise MoEBuildError(
                f"dense checkpoint directory not found: {dense} (fetch it: python -m scripts.get_models)"
            )
        if args.command == "measure":
            if not args.moe.is_dir():
                raise MoEBuildError(f"MoE checkpoint directory not found: {args.moe}")
            report = measure(dense, args.moe.expanduser(), args.prompts, args.greedy_tokens)
            print(json.dumps({k: v for k, v in report.items() if k != "load_per_layer"}, indent=2))
            if args.report:
                args.report.write_text(json.dumps(report, indent=2) + "\n")
            return 0
        if args.command == "upcycle":
            params: UpcycleParams | MoefyParams = UpcycleParams(args.experts, args.top_k, seed=args.seed)
            params.check()
        else:
            params = MoefyParams(args.experts, args.top_k, args.shared, args.active_fraction, seed=args.seed)
            params.expert_width(ModelConfig.from_dir(dense).intermediate_size)
        out = (args.out or default_out(args.command, dense, args.experts, default_cache())).expanduser()
        calibration = calibration_for(dense, args.calibration, args.seq_len)
        print(f"calibration: {calibration.num_tokens} tokens from {len(calibration.files)} files")
        build = upcycle if args.command == "upcycle" else moefy
        record = build(dense, out, calibration, params)  # type: ignore[arg-type]
        print(f"{args.command}: {out} ({record['checkpoint_bytes'] / 2**30:.2f} GiB, {record['build_seconds']:.0f} s)")
        if args.command == "moefy" and not args.no_report:
            _write_report(out, measure(dense, out, args.report_prompts))
        for scheme in filter(None, args.compress.split(",")):
            compressed = write_compressed(out, scheme)
            print(f"{scheme}: {compressed}")
    except (MoEBuildError, CheckpointError, UnsupportedModelError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
