"""``hisparse-triton advise``: pick ``device_buffer_size`` and the KV block size for a preset
and a GPU / host budget, with numbers (``hisparse_triton.advisor``; no torch).

Every setting of the sweep is planned (memory per request, steady-state concurrency) and its
miss rate measured on a top-k trace (the calibrated generator, or ``--trace``); the link time
per decode step uses ``--link-gbps`` or the gather figures of a ``bench`` result
(``--bench-json``). The setting with the best throughput estimate is recommended; the
formula is printed with it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Any

from hisparse_triton.commands.argtypes import (
    bounded_int,
    bounded_int_list,
    bounded_number,
    existing_file,
    output_path,
)
from hisparse_triton.commands.flags import add_progress_flag, add_seed_flag, add_top_k_flag
from hisparse_triton.commands.output import (
    add_json_flag,
    json_document,
    report_stream,
    write_json,
)
from hisparse_triton.presets import DEFAULT_PRESET, list_presets

#: ``schema_version`` of ``advise --json``.
SCHEMA_VERSION = 1
DEFAULT_LINK_GBPS = 50.0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``advise`` and its flags."""
    parser = subparsers.add_parser(
        "advise", help="recommend device_buffer_size and block size for a GPU/host budget",
        description="Sweep device_buffer_size and the KV block size for a preset and a GPU / "
                    "host budget: miss rate (calibrated or recorded top-k trace), rows and "
                    "bytes gathered per decode step, link time, GPU memory per request, "
                    "steady-state concurrency and a throughput estimate; recommend the best.")
    parser.add_argument("--preset", default=DEFAULT_PRESET, choices=list_presets(),
                        help=f"model geometry (default {DEFAULT_PRESET})")
    parser.add_argument("--gpu-memory-gib", type=bounded_number(0.01, 1 << 16, " GiB"),
                        default=80.0, help="GPU memory for the KV cache, GiB (default 80)")
    parser.add_argument("--host-pool-gib", type=bounded_number(0.01, 1 << 20, " GiB"),
                        default=256.0, help="pinned host pool, GiB (default 256)")
    parser.add_argument("--context-len", type=bounded_int(2, 1 << 22), default=None,
                        help="tokens per request (default 16 x top-k, 32768 on DeepSeek-V3.2: "
                             "where the calibrated trace matches the published miss curve)")
    parser.add_argument("--buffers", type=bounded_int_list(1, 32768), default=None,
                        metavar="LIST",
                        help="device_buffer_size values (default k,2k,4k,8k for top-k k)")
    parser.add_argument("--block-sizes", type=bounded_int_list(1, 4096), default=(16, 32, 64),
                        metavar="LIST", help="KV block sizes in tokens (default 16,32,64)")
    add_top_k_flag(parser, type=bounded_int(1, 32768), default=None,
                   help="positions selected per step (default: the preset's index_topk)")
    parser.add_argument("--link-gbps", type=bounded_number(0.001, 10000, " GB/s",
                                                           "decimal GB/s, not bytes/s"),
                        default=None, help=f"host->device gather speed, GB/s (default "
                                           f"{DEFAULT_LINK_GBPS:g}, or --bench-json)")
    parser.add_argument("--bench-json", metavar="PATH", default=None,
                        help="take the link speed from the gather figures of a `bench --json` "
                             "result (a file, or a directory: its newest *.json)")
    parser.add_argument("--step-ms", type=bounded_number(0.001, 1e6, " ms"), default=40.0,
                        help="decode step time without transfers, ms (default 40)")
    parser.add_argument("--max-batch", type=bounded_int(1, 1 << 20), default=None,
                        help="cap on requests decoded together (default: what fits)")
    parser.add_argument("--trace", metavar="FILE", type=existing_file, default=None,
                        help="measure miss rates on a recorded trace (.npz) instead of the "
                             "calibrated generator")
    parser.add_argument("--streams", type=bounded_int(1, 256), default=4,
                        help="calibrated streams (request x index group) to measure (default 4)")
    parser.add_argument("--steps", type=bounded_int(2, 4096), default=96,
                        help="decode steps per calibrated stream (default 96; the first quarter "
                             "is left out as warm-up)")
    add_seed_flag(parser, what="the calibrated trace")
    parser.add_argument("--plot", metavar="PATH", type=output_path, default=None,
                        help="write a PNG of the sweep (needs matplotlib: the 'bench' extra)")
    add_progress_flag(parser)
    add_json_flag(parser, "the sweep and the recommendation")
    return parser


def _newest_json(path: str) -> str:
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "*.json")), key=os.path.getmtime)
        if not files:
            raise ValueError(f"--bench-json {path}: the directory holds no .json file.")
        return files[-1]
    if not os.path.isfile(path):
        raise ValueError(f"--bench-json {path}: no such file or directory.")
    return path


def _bytes(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def format_advice(p: dict[str, Any]) -> str:
    """The human-readable sweep and recommendation."""
    from hisparse_triton.advisor import RECOMMEND_TOLERANCE

    lines = [
        f"hisparse-triton advise: {p['preset']} ({p['sparse_layers']} sparse layers, "
        f"{p['index_groups']} index groups, {p['row_bytes']} B rows), {p['context_len']} tokens "
        f"per request, {p['gpu_memory_gib']:g} GiB GPU KV budget, {p['host_pool_gib']:g} GiB "
        f"host pool, top-k {p['top_k']}",
        f"miss rates: the runtime's LRU on the {p['trace']}, steady state (the first "
        f"{p['warmup_steps']} steps of each stream left out), the last 2 pages resident",
        f"link: {p['link_gbps']:g} GB/s ({p['link_source']}); decode step {p['step_ms']:g} ms "
        f"of compute plus the step's gathers (not overlapped)",
        "",
        f"{'block':>5} {'buffer':>7} {'miss':>6} {'rows/step':>10} {'MiB/step':>9} "
        f"{'GPU MiB/req':>12} {'requests':>9} {'batch':>6} {'link ms':>8} {'tokens/s':>9}",
    ]
    best = p.get("recommended") or {}
    for r in p["settings"]:
        if "error" in r:
            lines.append(f"{r['block_size']:>5} {r['device_buffer_size']:>7}  does not fit: "
                         f"{r['error']}")
            continue
        mark = " <-" if (r["block_size"], r["device_buffer_size"]) == \
            (best.get("block_size"), best.get("device_buffer_size")) else ""
        lines.append(
            f"{r['block_size']:>5} {r['device_buffer_size']:>7} {100 * r['miss_rate']:>5.1f}% "
            f"{r['rows_per_step']:>10,.0f} {_bytes(r['bytes_per_step']):>9} "
            f"{_bytes(r['gpu_bytes_per_request']):>12} {r['concurrency']:>9.1f} "
            f"{r['batch']:>6} {r['link_ms_per_step']:>8.2f} {r['tokens_per_s']:>9,.0f}{mark}")
    lines.append("(rows/step and MiB/step: gathered per request per decode step over all "
                 "layers; link ms: the whole batch's gathers per step)")
    lines.append("")
    if best:
        lines.append(f"recommended: block_size {best['block_size']}, device_buffer_size "
                     f"{best['device_buffer_size']}: about {best['tokens_per_s']:,.0f} "
                     f"tokens/s at batch {best['batch']} (miss rate "
                     f"{100 * best['miss_rate']:.1f}%; estimates within "
                     f"{100 * RECOMMEND_TOLERANCE:g}% of the best count as equal, the least GPU "
                     f"memory per request wins)")
    else:
        lines.append("recommended: none: no setting of the sweep fits the budget")
    lines.append(f"formula: {p['formula']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``hisparse-triton advise``."""
    from hisparse_triton.advisor import (
        DEFAULT_BUFFER_FACTORS, AdviseSettings, link_from_bench, run_advise)
    from hisparse_triton.benchmarks.progress import Progress, default_enabled
    from hisparse_triton.presets import get_preset

    if args.plot:
        from hisparse_triton.benchmarks.plot import plot_available

        if not plot_available():
            raise ValueError("--plot needs matplotlib, which is not installed; "
                             "pip install 'hisparse-triton[bench]' (or pip install matplotlib).")
    if args.link_gbps is not None and args.bench_json is not None:
        raise ValueError("give --link-gbps or --bench-json, not both.")
    if args.trace is not None and (args.streams != 4 or args.steps != 96):
        raise ValueError("--streams and --steps size the calibrated trace; a --trace brings "
                         "its own.")
    geometry = get_preset(args.preset)
    link_gbps, source, by_rows = args.link_gbps or DEFAULT_LINK_GBPS, "given", None
    if args.link_gbps is None and args.bench_json is None:
        source = "default; --link-gbps or --bench-json for yours"
    if args.bench_json is not None:
        path = _newest_json(args.bench_json)
        try:
            with open(path, encoding="utf-8") as handle:
                result = json.load(handle)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--bench-json {path}: not a readable JSON file ({exc}).") from None
        by_rows, source = link_from_bench(result, geometry.mla_row_bytes)
        link_gbps = by_rows(1 << 14)
        source = f"{source}, {path}; per setting at its rows per launch"
    buffers = args.buffers
    settings = AdviseSettings(
        preset=args.preset, gpu_memory_gib=args.gpu_memory_gib,
        host_pool_gib=args.host_pool_gib, context_len=args.context_len, buffers=buffers,
        block_sizes=args.block_sizes, top_k=args.top_k, link_gbps=link_gbps,
        link_source=source, step_ms=args.step_ms, max_batch=args.max_batch, trace=args.trace,
        streams=args.streams, steps=args.steps, warmup=max(1, args.steps // 4), seed=args.seed,
        link_by_rows=by_rows)
    total = len(args.block_sizes) * len(buffers or DEFAULT_BUFFER_FACTORS)
    bar = Progress(total, "advise", enabled=default_enabled(args.progress), unit="setting")
    try:
        payload = run_advise(settings, on_setting=bar.step)
    finally:
        bar.close()
    print(format_advice(payload), file=report_stream(args.json))
    if args.plot:
        from hisparse_triton.benchmarks.plot import write_advise_plot

        write_advise_plot(payload, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    if args.json:
        write_json(json_document("advise", SCHEMA_VERSION, payload), args.json)
    return 0
