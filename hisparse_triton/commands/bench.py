"""``hisparse-triton bench``: measure gather / backup / page-copy GB/s and resolve latency.

On a CUDA device: the Triton kernels, the torch backend and the two baselines (torch eager,
contiguous pinned copy) over a sweep of row sizes, rows moved, layers per launch and miss
ratios; on a CPU: the torch paths only, on tiny defaults (kernel timings need a GPU).
Prints a table; ``--json PATH|-`` writes the full result (a PATH is also rewritten after every
case while the sweep runs, so a crash or a kill keeps what was measured), ``--plot PATH`` a PNG
(matplotlib). See ``hisparse_triton.benchmarks`` for what is measured and how, and
docs/benchmarking.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from hisparse_triton.benchmarks.registry import ALL_OPS
from hisparse_triton.benchmarks.settings import METHODS
from hisparse_triton.commands.argtypes import (
    bounded_int,
    bounded_int_list,
    bounded_number,
    choice_list,
    op_list,
    output_path,
    ratio_list,
)
from hisparse_triton.commands.flags import (
    add_device_flag,
    add_progress_flag,
    add_seed_flag,
    add_threads_flag,
    add_top_k_flag,
    set_torch_threads,
)
from hisparse_triton.commands.output import add_json_flag, json_document, report_stream, write_json
from hisparse_triton.presets import list_presets



#: Plausible ranges of the numeric flags (a value outside is rejected with the range named).
MAX_ROWS = 2**31 - 1
MAX_LAYERS = 1024
TIME_MS = bounded_number(0.001, 1e6, " ms")


def add_output_flags(parser: argparse.ArgumentParser) -> None:
    """``--json PATH|-`` and ``--progress/--no-progress`` (``bench`` and ``tune``)."""
    add_json_flag(parser, "the full result")
    add_progress_flag(parser)


def preset_shapes(preset: str) -> tuple[int, tuple[int, ...]]:
    """``(row_bytes, layer counts)`` of a preset's transfers: its MLA row, and the layers of
    one index group (a gather fills the leader and its followers) and of the whole-step
    mirror (every sparse layer in one launch)."""
    from hisparse_triton.presets import get_preset

    g = get_preset(preset)
    return g.mla_row_bytes, tuple(sorted({g.index_share, g.num_layers}))


# ----------------------------------------------------------------- the command

def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` and its flags."""
    parser = subparsers.add_parser(
        "bench", help="measure gather/backup/page-copy GB/s and resolve latency",
        description="Measure, on the current device, the transfer kernels (GB/s) and resolve "
                    "(latency) against the torch-eager and contiguous-copy baselines. Without "
                    "CUDA only the torch paths run, on tiny defaults: kernel timings need a GPU.")
    sweep = parser.add_argument_group(
        "sweep", "defaults: the full sweep on CUDA, a tiny one on CPU (docs/benchmarking.md)")
    sweep.add_argument("--preset", choices=list_presets(), default=None,
                       help="a model's real shapes: its MLA row size, top-k, and the layer "
                            "counts of one index group and of the whole-step mirror (e.g. 1 "
                            "and 61 on DeepSeek-V3.2); explicit flags still win (default: none, "
                            "the sweep's own defaults)")
    sweep.add_argument("--row-bytes", type=bounded_int_list(1, 1 << 20), default=None,
                       metavar="LIST", help="row sizes in bytes (GPU default 132,656,1152)")
    sweep.add_argument("--rows", type=bounded_int_list(1, MAX_ROWS), default=None,
                       metavar="LIST", help="rows moved per launch per layer, e.g. 512,4k,256k "
                                            "(GPU default 512,2k,8k,32k,128k,256k)")
    sweep.add_argument("--layers", type=bounded_int_list(1, MAX_LAYERS), default=None,
                       metavar="LIST", help="layers per launch (GPU default 1,4)")
    sweep.add_argument("--miss-ratios", type=ratio_list, default=None, metavar="LIST",
                       help="valid fraction of each [R, top_k] plan row, also the target "
                            "miss ratio of resolve (GPU default 1,0.3,0.067)")
    sweep.add_argument("--batch", type=bounded_int_list(1, 1 << 16), default=None,
                       metavar="LIST", help="resolve batch sizes (GPU default 1,4,16,64,256)")
    add_top_k_flag(sweep, type=bounded_int(1, 32768), default=None,
                   help="top-k columns per plan row / resolve row (default 2048)")
    sweep.add_argument("--hot-slots", type=bounded_int(1, 32768), default=None, metavar="N",
                       help="hot-buffer slots per request for resolve (default 4096)")
    sweep.add_argument("--seq-len", type=bounded_int(1, 1 << 22), default=None, metavar="N",
                       help="tokens per request for resolve (default 32768)")
    sweep.add_argument("--ops", type=op_list(ALL_OPS), default=None, metavar="LIST",
                       help=f"what to measure: {','.join(ALL_OPS)}, or a group: rows, pages, "
                            f"transfers, all (default all)")
    sweep.add_argument("--methods", type=choice_list(METHODS), default=None, metavar="LIST",
                       help=f"methods: {','.join(METHODS)} (default all; triton needs CUDA)")
    sweep.add_argument("--quick", action="store_true",
                       help="a small sweep (GPU: 656 B rows, 4k and 64k rows, miss ratios 1 "
                            "and 0.067, batch 64)")
    timing = parser.add_argument_group("timing")
    add_device_flag(timing, help="where to run the sweep")
    timing.add_argument("--warmup-ms", type=TIME_MS, default=None,
                        help="warm-up per figure in ms (default 10 on CUDA, 2 on a CPU; "
                             "--quick: 5 and 1)")
    timing.add_argument("--rep-ms", type=TIME_MS, default=None,
                        help="measurement time per figure in ms, the median is reported "
                             "(default 50 on CUDA, 10 on a CPU; --quick: 25 and 5)")
    timing.add_argument("--no-verify", action="store_true",
                        help="skip checking the moved rows / resolve outputs against the "
                             "source rows / the torch reference")
    timing.add_argument("--no-graph", action="store_true",
                        help="skip the CUDA-graph replays of the Triton kernels")
    timing.add_argument("--no-overlap", action="store_true",
                        help="with --decode-step: skip the step with a stand-in compute kernel "
                             "per layer, serial vs side stream (gpu_check runs it in its "
                             "decode-checks step)")
    timing.add_argument("--decode-step", action="store_true",
                        help="instead of the sweep (CUDA): a whole decode step of --preset "
                             "(default deepseek-v3.2-fp8) at --batch 64, every request on the "
                             "host path: the eager step and the step with its decode forward "
                             "replayed from a CUDA graph (host and device time of each), the "
                             "resolves alone from the graph, misses and GB/s per step")
    add_threads_flag(timing, default=None,
                     help="torch CPU threads (default 1 when the sweep runs on the CPU, as "
                          "simulate: CPU figures swing with the machine's load when torch "
                          "spreads over every core; on CUDA torch's own default, so that the "
                          "eager baseline's host-side copies are not slowed)")
    add_seed_flag(timing, what="the workloads")
    out = parser.add_argument_group("output")
    add_output_flags(out)
    out.add_argument("--plot", metavar="PATH", default=None, type=output_path,
                     help="write a PNG of GB/s vs rows moved, one line per method "
                          "(needs matplotlib: the 'bench' extra; default: no plot)")
    return parser


def _check_plot_available() -> None:
    from hisparse_triton.benchmarks.plot import plot_available

    if not plot_available():
        raise ValueError("--plot needs matplotlib, which is not installed; "
                         "pip install 'hisparse-triton[bench]' (or pip install matplotlib).")


def settings_from_args(args: argparse.Namespace, device: Any) -> Any:
    """``BenchSettings`` of ``device``'s defaults with the flags applied."""
    from hisparse_triton.benchmarks import BenchSettings, override
    from hisparse_triton.benchmarks.settings import min_seq_len

    base = BenchSettings.for_device(device, quick=args.quick)
    if args.preset is not None:
        row_bytes, layers = preset_shapes(args.preset)
        from hisparse_triton.presets import get_preset

        top_k = get_preset(args.preset).index_topk
        base = override(base, row_bytes=(row_bytes,), layers=layers, top_k=top_k,
                        hot_slots=max(base.hot_slots, 2 * top_k))
    settings = override(base, row_bytes=args.row_bytes, rows=args.rows, layers=args.layers,
                        miss_ratios=args.miss_ratios, batch=args.batch, top_k=args.top_k,
                        hot_slots=args.hot_slots, seq_len=args.seq_len, ops=args.ops,
                        methods=args.methods, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                        seed=args.seed)
    if args.no_verify:
        settings = override(settings, verify=False)
    if args.no_graph:
        settings = override(settings, graph=False)
    if args.top_k is not None and args.hot_slots is None and settings.hot_slots < args.top_k:
        settings = override(settings, hot_slots=2 * args.top_k)
    shortest = min_seq_len(settings.top_k, settings.hot_slots)
    if args.seq_len is None and settings.seq_len < shortest:
        settings = override(settings, seq_len=max(16 * settings.top_k, shortest))
    settings.validate()
    return settings


#: A CPU sweep estimated above this many bytes of RAM says so before it starts.
LARGE_RUN_BYTES = 1 << 30


def check_host_memory(settings: Any) -> None:
    """Before a CPU sweep: print its RAM estimate when it is large, refuse it (``ValueError``)
    when it exceeds the RAM available to this process."""
    from hisparse_triton.benchmarks.settings import host_memory_estimate
    from hisparse_triton.memory import available_ram_bytes

    def format_bytes(n: int) -> str:
        return f"{n / 2**30:.1f} GiB" if n >= 1 << 30 else f"{n / 2**20:.0f} MiB"

    need = host_memory_estimate(settings)
    if need["total"] < LARGE_RUN_BYTES:
        return
    parts = ", ".join(f"{name} {format_bytes(need[name])}"
                      for name in ("pools", "staging", "verify", "plans", "base"))
    available = available_ram_bytes()
    text = (f"this CPU sweep needs about {format_bytes(need['total'])} of RAM ({parts}; the "
            f"largest case: {max(settings.rows)} rows x {max(settings.layers)} layers)")
    if need["total"] > available:
        raise ValueError(f"{text}, more than the {format_bytes(available)} available; shrink "
                         f"it with --layers, --rows or --row-bytes.")
    print(f"hisparse-triton bench: {text}; {format_bytes(available)} available. --layers, "
          f"--rows or --row-bytes shrink it.", file=sys.stderr)


def resolve_device(name: str) -> Any:
    """The torch device of ``--device`` (``simulation.resolve_device``: the same values and
    messages as ``simulate``)."""
    from hisparse_triton.simulation import resolve_device as resolve

    return resolve(name)


def run_decode_step(args: argparse.Namespace) -> int:
    """``bench --decode-step``: a whole decode step on the GPU (``benchmarks.decode_step``)."""
    from hisparse_triton.benchmarks.decode_step import decode_step_device, overlap_step

    device = resolve_device(args.device)
    if device.type != "cuda":
        raise ValueError("--decode-step times kernels: it needs a CUDA device "
                         "(bench/host_cost.py in a source checkout measures the host side "
                         "on any machine).")
    result = decode_step_device(batch=args.batch[0] if args.batch else 64,
                                prompt_len=4096 if not args.quick else 2560,
                                steps=6 if args.quick else 12,
                                preset=args.preset or "deepseek-v3.2-fp8", device=str(device))
    if args.json:  # the eager figures are kept even if the overlap runs are cut short
        write_json(json_document("bench-decode-step", 1, result), args.json)
    if not args.no_overlap:
        try:  # the same step with a stand-in compute kernel, without and with the side stream
            result["overlap"] = overlap_step(device, args.quick,
                                             batch=args.batch[0] if args.batch else 64)
        except Exception as exc:  # the eager figures above still stand
            result["overlap"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    lines = [f"decode step: {result['preset']}, batch {result['batch']}, {result['prompt_len']}"
             f"-token histories, {result['index_groups']} index groups, every request on the "
             f"host path (locality {result['locality']})",
             f"  host time per step: eager {result['eager_step_host_ms']} ms, graph-replayed "
             f"{result.get('graph_step_host_ms')} ms (the decode forward from one CUDA "
             f"graph; plan, apply and mirror eager)",
             f"  device time per step: eager {result['eager_step_device_ms']} ms, "
             f"graph-replayed {result.get('graph_step_device_ms')} ms; "
             f"{result['misses_per_step']:.0f} misses, "
             f"{result['h2d_bytes_per_step'] / 2**20:.1f} MiB gathered per step "
             f"({result.get('h2d_gbps_in_step')} GB/s over the eager step)",
             f"  every index group's resolve_rows alone from the graph: "
             f"{result.get('graph_resolves_ms')} ms per step, "
             f"{result.get('graph_resolve_us_per_group')} us per index group"]
    for key, figures in sorted((result.get("overlap") or {}).items()):
        if key.startswith("budget"):
            lines.append(f"  with a stand-in compute kernel per layer, gather grid budget "
                         f"{figures['gather_programs_per_sm']} per SM: "
                         f"{figures['step_ms_serial']} ms serial, "
                         f"{figures['step_ms_side_stream']} ms with the side stream")
    if "error" in (result.get("overlap") or {}):
        lines.append(f"  overlap: failed: {result['overlap']['error']}")
    print("\n".join(lines), file=report_stream(args.json))
    if args.json:
        write_json(json_document("bench-decode-step", 1, result), args.json)
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the sweep, print the table, write ``--json`` / ``--plot``."""
    if args.decode_step:
        return run_decode_step(args)
    if args.plot:
        _check_plot_available()
    from hisparse_triton import benchmarks as bm

    device = resolve_device(args.device)
    settings = settings_from_args(args, device)
    threads = set_torch_threads(args.threads if args.threads is not None or
                                device.type == "cuda" else 1)
    if device.type != "cuda":
        check_host_memory(settings)
    if args.plot and not any(op in bm.TRANSFER_OPS for op in settings.ops):
        raise ValueError("--plot draws transfer throughput; add a transfer op to --ops "
                         f"(one of {', '.join(bm.TRANSFER_OPS)}).")
    if device.type != "cuda" and set(settings.methods) == {"triton"}:
        raise ValueError("--methods triton needs a CUDA device (kernel timings need a GPU); "
                         "on this machine choose from torch, eager, contiguous.")
    from hisparse_triton.benchmarks.progress import default_enabled

    progress = bm.Progress(bm.count_steps(settings, device), "bench",
                           enabled=default_enabled(args.progress))
    checkpoint = None
    if args.json and args.json != "-":
        checkpoint = (lambda partial: write_json(partial, args.json))
    try:
        result = bm.run_bench(settings, device, progress=progress, checkpoint=checkpoint)
    except (MemoryError, RuntimeError) as exc:
        progress.close()  # torch.OutOfMemoryError is a RuntimeError
        text = " ".join(str(exc).split())
        if not isinstance(exc, MemoryError) and not any(
                needle in text for needle in ("allocate", "out of memory")):
            raise
        raise ValueError(f"out of memory for this sweep ({text}); shrink it with --rows, "
                         f"--layers, --row-bytes, --batch or --hot-slots.") from None
    progress.close()
    result["torch_threads"] = threads
    table = bm.format_table(result)
    print(table, file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json:
        write_json(result, args.json)
    if args.plot and any(f.get("gbps") for f in result["transfers"]):
        bm.write_plot(result, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    if result["interrupted"]:
        print("hisparse-triton bench: interrupted; the figures measured so far were written.",
              file=sys.stderr)
        return 130
    failed = [f for f in bm.iter_figures(result) if f.get("error")]
    if failed:
        first = failed[0]
        print(f"hisparse-triton bench: {len(failed)} figure(s) failed; first: {first['op']} "
              f"{first['method']}: {first['error']}", file=sys.stderr)
        return 1
    return 0
