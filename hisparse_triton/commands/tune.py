"""``hisparse-triton tune``: search the transfer kernels' launch configs for this GPU and save
the fastest to the per-device tuning cache (``hisparse_triton.tuning_cache``).

The search itself (candidates, their check against the torch reference, timing, cache
entries) is ``hisparse_triton.benchmarks.tuner``; this module is its command line. Each
(kernel, layers) is saved to the cache as soon as it is tuned; Ctrl-C (SIGINT) stops the
search, keeps what was tuned (``--json`` says ``"interrupted": true``) and exits 130.
``--dry-run`` lists the candidates (works without a GPU); without CUDA the command refuses.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from typing import Any, Optional

from hisparse_triton.benchmarks.registry import PAGE_OPS, TUNABLE_OPS
from hisparse_triton.benchmarks.tuner import (
    BLOCK_SIZE,
    STAGE2,
    Space,
    Tuner,
    best_config,
    candidate_space,
    config_text,
    save_records,
    tune_space,
)
from hisparse_triton.commands.argtypes import bounded_int, bounded_int_list, op_list
from hisparse_triton.commands.bench import (
    MAX_LAYERS,
    MAX_ROWS,
    TIME_MS,
    add_output_flags,
    preset_shapes,
)
from hisparse_triton.commands.flags import add_seed_flag, add_top_k_flag
from hisparse_triton.commands.output import json_document, report_stream, write_json
from hisparse_triton.presets import list_presets

#: ``schema_version`` of ``tune --json``.
SCHEMA_VERSION = 1
DEFAULT_ROW_BYTES = 656
DEFAULT_LAYERS = (1, 4)

NO_GPU = ("tuning needs a CUDA GPU and none is available (torch.cuda.is_available() is "
          "False); `hisparse-triton tune --dry-run` lists the candidates without one")


def tune_one(space: Space, args: argparse.Namespace, progress_enabled: bool, *,
             tuner: Optional[Any] = None) -> dict[str, Any]:
    """Both search stages of ``space`` with the flags' sizes; the JSON record.

    ``tuner`` defaults to a ``Tuner`` on the current GPU built from ``args``."""
    if tuner is None:
        tuner = Tuner(space.kernel, args.row_bytes, space.num_layers, rows=args.rows,
                      top_k=args.top_k, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                      seed=args.seed)
    return tune_space(space, tuner, row_bytes=args.row_bytes,
                      progress_enabled=progress_enabled)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``tune`` and its flags."""
    parser = subparsers.add_parser(
        "tune", help="tune the transfer kernels' launch configs for this GPU",
        description="Search launch configs of the transfer kernels for the current GPU, one "
                    "row size and layer counts; every candidate is checked against the torch "
                    "reference before it is timed; the fastest is saved to the per-device "
                    "tuning cache that the kernels read at start-up. Needs CUDA, except "
                    "--dry-run.")
    parser.add_argument("--kernel", type=op_list(TUNABLE_OPS), default=TUNABLE_OPS,
                        metavar="LIST", help=f"kernels to tune: {','.join(TUNABLE_OPS)}, or a "
                                             f"group: rows, pages, all (default all)")
    parser.add_argument("--preset", choices=list_presets(), default=None,
                        help="tune for a model's real shapes: its MLA row size and the layer "
                             "counts of one index group and of the whole-step mirror (e.g. 1 "
                             "and 61 on DeepSeek-V3.2); --row-bytes / --layers still win "
                             "(default: none)")
    parser.add_argument("--row-bytes", type=bounded_int(1, 1 << 20), default=None, metavar="N",
                        help=f"bytes of one row of one layer (default {DEFAULT_ROW_BYTES}, or "
                             f"the preset's; pages are 64 rows)")
    parser.add_argument("--layers", type=bounded_int_list(1, MAX_LAYERS), default=None,
                        metavar="LIST", help="layers per launch to tune for (default 1,4, or "
                                             "the preset's)")
    parser.add_argument("--rows", type=bounded_int(1, MAX_ROWS), default=16384, metavar="N",
                        help="rows moved per timed launch (default 16384; pages: N/64)")
    add_top_k_flag(parser, type=bounded_int(1, 32768), default=2048,
                   help="plan width of the row kernels (default 2048)")
    parser.add_argument("--quick", action="store_true", help="a smaller candidate grid")
    parser.add_argument("--dry-run", action="store_true",
                        help="list the candidates and exit (no GPU needed)")
    parser.add_argument("--warmup-ms", type=TIME_MS, default=5.0,
                        help="warm-up per candidate in ms (default 5)")
    parser.add_argument("--rep-ms", type=TIME_MS, default=25.0,
                        help="timing per candidate in ms, median reported (default 25)")
    add_seed_flag(parser, what="the plans")
    parser.add_argument("--cache", metavar="PATH", default=None,
                        help="cache file to update (default: $HISPARSE_TRITON_TUNING_CACHE or "
                             "the user cache directory, one file per GPU model)")
    parser.add_argument("--no-save", action="store_true", help="do not write the cache")
    add_output_flags(parser)
    return parser


def _dry_run(args: argparse.Namespace, spaces: list[Space], out: Any) -> int:
    from hisparse_triton import tuning_cache

    cache_path = args.cache or tuning_cache.cache_path()
    print(f"hisparse-triton tune --dry-run: candidates for {args.row_bytes} B rows "
          f"(cache: {cache_path})", file=out)
    records = []
    for space in spaces:
        s2 = {n: space.values[n] for n in STAGE2 if n in space.values}
        layers = f"{space.num_layers} layer{'s' if space.num_layers > 1 else ''}"
        print(f"\n{space.kernel}, {space.span} B spans, {layers}: {len(space.stage1)} stage-1 "
              f"candidates, then stage 2 around the best", file=out)
        print(f"  default: {config_text(space.default)}", file=out)
        for name, vals in s2.items():
            print(f"  stage 2: {name} in {vals}", file=out)
        if space.fixed:
            print(f"  fixed at the default: {', '.join(space.fixed)}", file=out)
        for i, cand in enumerate(space.stage1, 1):
            print(f"  {i:3d}. {config_text(cand, space.default)}", file=out)
        records.append({"kernel": space.kernel, "span_bytes": space.span,
                        "num_layers": space.num_layers, "default": asdict(space.default),
                        "stage1": [asdict(c) for c in space.stage1], "stage2": s2,
                        "fixed": space.fixed})
    if args.json:
        write_json(json_document("tune", SCHEMA_VERSION, {
            "dry_run": True, "preset": args.preset, "row_bytes": args.row_bytes,
            "cache": str(cache_path), "spaces": records}), args.json)
    return 0


def apply_preset(args: argparse.Namespace) -> None:
    """Fill ``--row-bytes`` / ``--layers`` from ``--preset`` (or the defaults) in place."""
    row_bytes, layers = (preset_shapes(args.preset) if args.preset is not None
                         else (DEFAULT_ROW_BYTES, DEFAULT_LAYERS))
    if args.row_bytes is None:
        args.row_bytes = row_bytes
    if args.layers is None:
        args.layers = layers


def run(args: argparse.Namespace) -> int:
    """Tune (or, with ``--dry-run``, list) and save the winners to the cache."""
    from hisparse_triton.benchmarks.progress import default_enabled

    apply_preset(args)
    out = report_stream(args.json)
    if args.rows < BLOCK_SIZE and any(k in PAGE_OPS for k in args.kernel):
        raise ValueError(f"--rows={args.rows} is less than one page ({BLOCK_SIZE} rows).")
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print(f"hisparse-triton tune: error: {NO_GPU}.", file=sys.stderr)
        return 1
    sm_count = (torch.cuda.get_device_properties(torch.cuda.current_device())
                .multi_processor_count if cuda else None)
    spaces = [candidate_space(k, args.row_bytes, n, quick=args.quick, sm_count=sm_count)
              for k in args.kernel for n in args.layers]
    if args.dry_run:
        return _dry_run(args, spaces, out)

    from pathlib import Path

    from hisparse_triton import benchmarks as bm
    from hisparse_triton import tuning_cache

    device_name = torch.cuda.get_device_name(torch.cuda.current_device())
    path = Path(args.cache) if args.cache else tuning_cache.cache_path(device_name)
    env = bm.environment()
    records: list[dict[str, Any]] = []
    interrupted = False
    try:
        for space in spaces:
            record = tune_one(space, args, default_enabled(args.progress))
            records.append(record)
            _print_record(record, space, args.row_bytes, out)
            if not args.no_save:  # each space as soon as it is tuned: a kill keeps it
                save_records([record], path, device_name, env)
    except KeyboardInterrupt:
        interrupted = True
        print(f"hisparse-triton tune: interrupted after {len(records)} of {len(spaces)} "
              f"kernel/layer searches; those are kept.", file=sys.stderr)
    saved = bool(records) and not args.no_save
    if saved:
        print(f"saved {len(records)} entr{'y' if len(records) == 1 else 'ies'} to {path}",
              file=out)
    if args.json:
        write_json(json_document("tune", SCHEMA_VERSION, {
            "dry_run": False, "preset": args.preset, "environment": env,
            "row_bytes": args.row_bytes, "cache": str(path), "saved": saved,
            "interrupted": interrupted, "results": records}), args.json)
    return 130 if interrupted else 0


def _print_record(record: dict[str, Any], space: Space, row_bytes: int, out: Any) -> None:
    best, default = record["best"], record["default"]
    print(f"{space.kernel:8s} {row_bytes} B x{space.num_layers} layers: best "
          f"{best['gbps']:.2f} GB/s ({best['time_us']:.1f} us)"
          + (f", default {default['gbps']:.2f} GB/s -> x{record['speedup_vs_default']:.2f}"
             if default and default.get("gbps") else "")
          + f"; {record['candidates']} candidates, {record['rejected']} rejected", file=out)
    print(f"         {config_text(best_config(best), space.default)}", file=out)


__all__ = ["DEFAULT_LAYERS", "DEFAULT_ROW_BYTES", "NO_GPU", "SCHEMA_VERSION", "add_parser",
           "apply_preset", "run", "tune_one"]
