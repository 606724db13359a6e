"""`python -m sim trace validate|info|import|cut|synth`: check, describe, import, cut and
generate traces (the trace format of bubblesim/core/trace.py). Every command exits 2 with one line
on bad
input and writes only through `bubblesim.core.trace.write_trace` (validated, temp file +
os.replace).

A model is checked (context length, vocab) only when a config is named (`--config`/`--set`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from bubblesim.core.cli import (
    UsageError,
    add_config_args,
    add_force_arg,
    config_from_args,
    run_main,
)
from bubblesim.core.models import ModelSpec, get_model, with_context
from bubblesim.core.outplace import TRACE_FILE, check_place, output_place
from bubblesim.core.trace import Trace, read_trace, trace_sha256, write_trace
from bubblesim.core.tracecut import cut_trace
from bubblesim.workloads.arrivals import ARRIVALS
from bubblesim.workloads.stats import format_stats, trace_stats

IMPORT_FORMATS = ("azure", "mooncake", "lengths-csv")


def add_trace_parser(sub: argparse._SubParsersAction) -> None:
    trace = sub.add_parser("trace", help="validate, describe, import, cut or synthesise a trace")
    tsub = trace.add_subparsers(dest="trace_command", required=True)

    p = tsub.add_parser(
        "validate",
        help="check a trace's columns, types and values (and, with --config or --set, that "
        "every request fits the model's context)",
    )
    p.add_argument("file", help="trace parquet file")
    add_config_args(p, output=False)
    p.set_defaults(func=cmd_validate)

    p = tsub.add_parser("info", help="rows, rate, burstiness, lengths, prefixes, spec columns")
    p.add_argument("file", help="trace parquet file")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    add_config_args(p, output=False)
    p.set_defaults(func=cmd_info)

    p = tsub.add_parser("import", help="convert a public trace into this tool's trace format")
    p.add_argument(
        "format",
        choices=IMPORT_FORMATS,
        help="azure: Azure LLM inference CSV (timestamps, token counts); mooncake: Mooncake "
        "JSONL (timestamps, lengths, prompt hash blocks); lengths-csv: a CSV of prompt and "
        "output token counts, with arrivals drawn at --rate",
    )
    p.add_argument("src", help="source file (CSV or JSONL)")
    _output_arg(p)
    p.add_argument(
        "--max-total-len",
        type=int,
        metavar="N",
        help="drop requests with prompt + output > N tokens (counted in the summary)",
    )
    p.add_argument("--limit", type=int, metavar="N", help="lengths-csv: only the first N rows")
    _arrival_args(p, rate_default=None)
    add_config_args(p, output=False)
    p.set_defaults(func=cmd_import)

    p = tsub.add_parser(
        "cut",
        help="a window of a trace: requests arriving in [--from-s, --to-s), moved to start at 0",
        description="Keep the requests that arrive in [FROM, TO) seconds, shift their arrivals "
        "so the window starts at 0 and divide them by --speedup (every inter-arrival time "
        "shrinks by that factor): arrival' = (arrival - FROM) / SPEEDUP. Requests with prompts "
        "longer than --max-prompt-len are dropped and counted. The trace's metadata is kept; "
        "its description names the window and a 'cut' key records what was cut.",
    )
    p.add_argument("file", help="trace parquet file to cut from")
    p.add_argument("--from-s", type=float, default=0.0, metavar="A", help="window start (s)")
    p.add_argument("--to-s", type=float, required=True, metavar="B", help="window end (s)")
    p.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        metavar="X",
        help="divide arrival times in the window by X (default 1: as recorded)",
    )
    p.add_argument(
        "--max-prompt-len",
        type=int,
        metavar="N",
        help="drop requests whose prompt is longer than N tokens (their count is printed)",
    )
    _output_arg(p)
    add_config_args(p, output=False)
    p.set_defaults(func=cmd_cut)

    p = tsub.add_parser("synth", help="generate a synthetic trace")
    _output_arg(p)
    _arrival_args(p, rate_default=1.0)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--num-requests", type=int, metavar="N", help="generate N requests")
    size.add_argument(
        "--duration-s",
        type=float,
        metavar="S",
        help="generate arrivals for S seconds (servegen: the window length, default 600)",
    )
    p.add_argument(
        "--prompt-len", metavar="DIST", help="N | uniform:LO:HI | lognormal:MED:SIGMA[:MAX]"
    )
    p.add_argument("--output-len", metavar="DIST", help="as --prompt-len")
    p.add_argument(
        "--lengths-from",
        metavar="FILE",
        help="draw (prompt, output) pairs from a trace or length CSV",
    )
    p.add_argument(
        "--servegen",
        metavar="DIR",
        help="ServeGen DeepSeek-R1 client tables: per-client arrivals and lengths",
    )
    p.add_argument(
        "--start-s", type=float, default=0.0, help="servegen: start within the day (s, default 0)"
    )
    p.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        help="servegen: multiply every client's rate (default 1)",
    )
    p.add_argument(
        "--max-output",
        type=int,
        default=32_768,
        help="servegen: cap on output tokens (default 32768)",
    )
    p.add_argument(
        "--needs-history",
        type=float,
        metavar="FRACTION",
        help="fraction of requests that need the output history (default 0; servegen 1)",
    )
    p.add_argument(
        "--token-ids",
        action="store_true",
        help="real token ids: bytes of Python's standard-library sources",
    )
    p.add_argument(
        "--ngram-friendly",
        action="store_true",
        help="with --token-ids: pick the most repetitive text windows",
    )
    p.add_argument(
        "--accept-rate",
        type=float,
        metavar="P",
        help="add an accept_rate column (per-draft-token acceptance)",
    )
    p.add_argument("--description", help="trace description for the metadata")
    add_config_args(p, output=False)
    p.set_defaults(func=cmd_synth)


def _output_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        required=True,
        help="trace parquet to write (an existing file is replaced only with --force)",
    )
    add_force_arg(p)


def _arrival_args(p: argparse.ArgumentParser, rate_default: float | None) -> None:
    p.add_argument(
        "--arrival", choices=ARRIVALS, default="poisson", help="arrival process (default poisson)"
    )
    p.add_argument("--rate", type=float, default=rate_default, help="requests per second")
    p.add_argument(
        "--cv",
        type=float,
        default=1.0,
        help="inter-arrival coefficient of variation (gamma, weibull)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of every random draw (default 0)")


# ---- helpers ----------------------------------------------------------------------------------
def _model(args: argparse.Namespace) -> ModelSpec | None:
    if args.config is None and not args.sets:
        return None
    cfg = config_from_args(args)
    try:
        return with_context(get_model(cfg.model), cfg.max_model_len)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _summary_line(trace: Trace) -> str:
    span = float(trace.arrival_s.max() - trace.arrival_s.min())
    rate = f", {(len(trace) - 1) / span:.3g} req/s" if span > 0 else ""
    return (
        f"{len(trace):,} requests over {span:.1f} s{rate}; prompt mean "
        f"{trace.prompt_len.mean():.0f}, output mean {trace.output_len.mean():.0f}"
    )


def _write(trace: Trace, args: argparse.Namespace, extra: str = "") -> int:
    out = Path(args.output)
    with output_place(out, TRACE_FILE, args.force):
        try:
            write_trace(trace, out, _model(args))
        except OSError as e:  # disk full, ...
            raise UsageError(f"-o {out}: cannot write ({e.strerror or e})") from None
    size_kib = out.stat().st_size / 1024
    print(f"wrote {out} ({size_kib:,.0f} KiB): {_summary_line(trace)}{extra}")
    return 0


# ---- commands ---------------------------------------------------------------------------------
def cmd_validate(args: argparse.Namespace) -> int:
    model = _model(args)
    trace = read_trace(args.file, model)
    against = f" against model '{model.name}' ({model.max_context} tokens)" if model else ""
    print(f"ok: {args.file}{against}: {_summary_line(trace)}")
    print(f"sha256 {trace_sha256(args.file)}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    trace = read_trace(args.file, _model(args))
    stats = trace_stats(trace)
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        print(format_stats(args.file, stats))
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from bubblesim.workloads.importers import import_azure, import_lengths_csv
    from bubblesim.workloads.mooncake import import_mooncake

    check_place(Path(args.output), TRACE_FILE, args.force)  # before the import's work
    dropped = 0
    if args.format == "mooncake":
        trace, dropped = import_mooncake(args.src, args.max_total_len)
    else:
        if args.format == "azure":
            trace = import_azure(args.src)
        else:
            if args.rate is None:
                raise UsageError("import lengths-csv: give --rate (requests per second)")
            rng = np.random.default_rng(args.seed)
            trace = import_lengths_csv(args.src, rng, args.arrival, args.rate, args.cv, args.limit)
        if args.max_total_len is not None:
            keep = trace.prompt_len.astype(np.int64) + trace.output_len <= args.max_total_len
            dropped = int((~keep).sum())
            if dropped == len(trace):
                raise UsageError(f"--max-total-len {args.max_total_len}: drops every request")
            trace = trace.take(np.flatnonzero(keep))
    extra = f"; dropped {dropped} over {args.max_total_len} tokens" if dropped else ""
    return _write(trace, args, extra)


def cmd_cut(args: argparse.Namespace) -> int:
    src = read_trace(args.file)
    cut = cut_trace(
        src, args.from_s, args.to_s, args.speedup, args.max_prompt_len, source=str(args.file)
    )
    extra = f"; {cut.in_window:,} of {len(src):,} requests in [{args.from_s:g}, {args.to_s:g}) s"
    if cut.dropped_long_prompt:
        extra += f", dropped {cut.dropped_long_prompt:,} with prompts over {args.max_prompt_len}"
    return _write(cut.trace, args, extra)


def cmd_synth(args: argparse.Namespace) -> int:
    from bubblesim.workloads.lengths import parse_length
    from bubblesim.workloads.servegen import servegen_trace
    from bubblesim.workloads.synth import SynthSpec, synthesize

    check_place(Path(args.output), TRACE_FILE, args.force)  # before the generator's work
    if args.servegen:
        for opt in ("num_requests", "lengths_from", "prompt_len", "output_len"):
            if getattr(args, opt) is not None:
                raise UsageError(
                    f"--servegen draws its own arrivals and lengths; drop --{opt.replace('_', '-')}"
                )
        if args.token_ids or args.accept_rate is not None:
            raise UsageError("--servegen takes neither --token-ids nor --accept-rate")
        hist = 1.0 if args.needs_history is None else args.needs_history
        trace = servegen_trace(
            args.servegen,
            args.seed,
            args.start_s,
            args.duration_s or 600.0,
            args.rate_scale,
            args.max_output,
            hist,
        )
    else:
        if args.num_requests is None and args.duration_s is None:
            raise UsageError("synth: give --num-requests N or --duration-s S")
        spec = SynthSpec(
            arrival=args.arrival,
            rate=args.rate,
            cv=args.cv,
            num_requests=args.num_requests,
            duration_s=args.duration_s,
            prompt_len=parse_length(args.prompt_len, "--prompt-len") if args.prompt_len else None,
            output_len=parse_length(args.output_len, "--output-len") if args.output_len else None,
            lengths_from=args.lengths_from,
            needs_history=args.needs_history or 0.0,
            accept_rate=args.accept_rate,
            token_ids=args.token_ids,
            ngram_friendly=args.ngram_friendly,
            seed=args.seed,
        )
        trace = synthesize(spec)
    if args.description:
        trace.metadata["description"] = args.description
    return _write(trace, args)


def main(argv: list[str] | None = None) -> int:
    """`python -m bubblesim.workloads.tracecmd ...` = `python -m sim trace ...` (handy without
    sim/__main__)."""
    parser = argparse.ArgumentParser(prog="python -m sim")
    add_trace_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["trace", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(run_main(main))
