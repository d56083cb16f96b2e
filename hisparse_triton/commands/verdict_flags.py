"""The live verdict's flags, shared by ``simulate --verdict`` and ``metrics`` (no torch).

The verdict is the advise model fed with the miss rate a run observed
(``hisparse_triton.metrics.verdict``); these flags are advise's model inputs, spelled as
``advise`` spells them. Budgets default to the run's own pools and the tokens per request
to the run's longest request (prompt + output), so a verdict without flags judges the
deployment that was simulated.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

from hisparse_triton.commands.argtypes import bounded_int, bounded_number, fraction

#: ``dest`` of every flag ``add_verdict_flags`` adds (without ``--link-gbps``).
VERDICT_FLAGS = ("gpu_memory_gib", "host_pool_gib", "context_len", "step_ms", "overlap",
                 "max_batch", "bench_json")


def add_verdict_flags(parser: Any, *, link_flag: bool) -> None:
    """The verdict's model inputs (advise's flags); ``link_flag`` adds ``--link-gbps`` too
    (``simulate`` has its own)."""
    from hisparse_triton.commands.advise import DEFAULT_STEP_MS, step_points

    parser.add_argument("--gpu-memory-gib", type=bounded_number(0.0001, 1 << 16, " GiB"),
                        default=None, help="GPU memory for the KV cache in the verdict's "
                                           "model, GiB (default: the run's device pool)")
    parser.add_argument("--host-pool-gib", type=bounded_number(0.0001, 1 << 20, " GiB"),
                        default=None, help="host pool in the verdict's model, GiB (default: "
                                           "the run's host pool)")
    parser.add_argument("--context-len", type=bounded_int(2, 1 << 22), default=None,
                        help="tokens per request in the verdict's model (default: the run's "
                             "longest request, prompt + output)")
    parser.add_argument("--step-ms", type=step_points, default=None, metavar="MS|B:MS,...",
                        help=f"decode step time without transfers, as advise takes it "
                             f"(default {DEFAULT_STEP_MS}, an assumption: measure your "
                             f"engine's)")
    parser.add_argument("--overlap", type=fraction, default=None,
                        help="share of the gathers hidden under the step's compute, in "
                             "[0, 1] (default 0)")
    parser.add_argument("--max-batch", type=bounded_int(1, 1 << 20), default=None,
                        help="cap on requests decoded together in the verdict's model "
                             "(default: what fits)")
    parser.add_argument("--bench-json", metavar="PATH", default=None,
                        help="the link speed from the gather figures of a GPU `bench --json` "
                             "result (a file, or a directory: its newest); CPU results are "
                             "refused (default: the --link-gbps default)")
    if link_flag:
        add_link_flag(parser, "host->device gather speed of the verdict's model (or "
                              "--bench-json)")


def add_link_flag(parser: Any, what: str) -> None:
    """``--link-gbps``: ``what`` it is used for, then its default."""
    from hisparse_triton.link import DEFAULT_LINK_GBPS

    parser.add_argument("--link-gbps", type=bounded_number(0.001, 10000, " GB/s",
                                                           "decimal GB/s, not bytes/s"),
                        default=None,
                        help=f"{what}, GB/s (default {DEFAULT_LINK_GBPS:g}: published 656 B "
                             f"row-gather figures, see docs/tools.md)")


def given_verdict_flags(args: argparse.Namespace) -> list[str]:
    """The verdict flags set on the command line (``--gpu-memory-gib``, ...)."""
    return [f"--{name.replace('_', '-')}" for name in VERDICT_FLAGS
            if getattr(args, name, None) is not None]


def verdict_settings(args: argparse.Namespace, preset: Optional[str],
                     link_gbps: Optional[float]) -> Any:
    """``VerdictSettings`` of the parsed flags for ``preset`` (None: the run's, filled in
    by ``run_simulation``); ``link_gbps``: the speed the
    command was given (None: the default, or ``--bench-json``). ``ValueError`` for
    ``--bench-json`` together with a given link speed, or a bench result that has no GPU
    gather figures."""
    from hisparse_triton.advisor import StepModel, find_bench_result, link_from_bench
    from hisparse_triton.link import DEFAULT_LINK_GBPS, DEFAULT_LINK_SOURCE
    from hisparse_triton.metrics.verdict import VerdictSettings
    from hisparse_triton.presets import DEFAULT_PRESET, get_preset

    link, source, by_rows = link_gbps or DEFAULT_LINK_GBPS, "given", None
    if link_gbps is None:
        source = DEFAULT_LINK_SOURCE
    if args.bench_json is not None:
        if link_gbps is not None:
            raise ValueError("give --link-gbps or --bench-json, not both.")
        path, result = find_bench_result(args.bench_json)
        row_bytes = get_preset(preset or DEFAULT_PRESET).mla_row_bytes
        by_rows, source = link_from_bench(result, row_bytes)
        link, source = by_rows(1 << 14), f"{source}, read from {path}"
        print(f"hisparse-triton: verdict link speed from {path}", file=sys.stderr)
    step = (StepModel(args.step_ms, "given") if args.step_ms is not None else
            StepModel(source="default, an assumption: measure your engine's with --step-ms"))
    return VerdictSettings(
        preset=preset, gpu_memory_gib=args.gpu_memory_gib, host_pool_gib=args.host_pool_gib,
        context_len=args.context_len, link_gbps=link, link_source=source,
        link_by_rows=by_rows, step=step, overlap=args.overlap or 0.0,
        max_batch=args.max_batch)


__all__ = ["VERDICT_FLAGS", "add_link_flag", "add_verdict_flags", "given_verdict_flags",
           "verdict_settings"]
