"""``hisparse-triton advise``: pick ``device_buffer_size`` and the KV block size for a preset
and a GPU / host budget, with numbers (``hisparse_triton.advisor``; no torch).

Every setting of the sweep is planned (memory per request, steady-state concurrency) and its
miss rate measured on a top-k trace (the calibrated generator, or ``--trace``); the link time
per decode step uses ``--link-gbps``, the gather figures of a GPU ``bench`` result
(``--bench-json``) or the published row-gather speed (``hisparse_triton.link``); the compute
time per step comes from a step model (``--step-ms``: one figure, or figures at several
batch sizes). Each setting is compared with keeping every layer on the GPU; the best is
recommended, with the formula and the crossover (the number of concurrent requests from
which HiSparse wins).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any, Callable

from hisparse_triton.commands.argtypes import (
    bounded_int,
    bounded_int_list,
    bounded_number,
    existing_file,
    fraction,
    output_path,
)
from hisparse_triton.commands.flags import add_progress_flag, add_seed_flag, add_top_k_flag
from hisparse_triton.commands.output import (
    add_json_flag,
    json_document,
    report_stream,
    write_json,
)
from hisparse_triton.link import DEFAULT_LINK_GBPS, DEFAULT_LINK_SOURCE
from hisparse_triton.presets import DEFAULT_PRESET, list_presets
from hisparse_triton.units import byte_unit, in_unit

#: ``schema_version`` of ``advise --json`` (2: ``step_ms`` became ``step_model``, the
#: all-GPU row, the crossover and ``recommended.mode`` were added).
SCHEMA_VERSION = 2
#: ``--step-ms``'s default, spelled as the flag takes it (``advisor.DEFAULT_STEP_POINTS``).
DEFAULT_STEP_MS = "1:25,256:50"


def step_points(text: str) -> tuple[tuple[float, float], ...]:
    """``--step-ms``: ``MS`` (any batch) or ``BATCH:MS,BATCH:MS,...`` at distinct batches."""
    bad = argparse.ArgumentTypeError(
        f"must be MS or BATCH:MS points at distinct batches, batch in [1, 1048576], ms in "
        f"[0.001, 1000000] (e.g. 40, or 1:25,256:50), got {text!r}")
    points = []
    for part in [p for p in text.replace(" ", "").split(",") if p]:
        batch, _, ms = part.rpartition(":")
        try:
            point = (float(batch) if batch else 1.0, float(ms))
        except ValueError:
            raise bad from None
        if not (1 <= point[0] <= 1 << 20 and 0.001 <= point[1] <= 1e6):
            raise bad
        points.append(point)
    if not points or len({b for b, _ in points}) != len(points):
        raise bad
    return tuple(points)


def split_fraction(text: str) -> "float | None":
    """``--split-fraction``: ``auto`` (None) or a number in ``(0, 1]``."""
    if text.strip().lower() == "auto":
        return None
    value = fraction(text)
    if value <= 0.0:
        raise argparse.ArgumentTypeError(f"must be auto or in (0, 1], got {text!r}")
    return value


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
    parser.add_argument("--block-sizes", type=bounded_int_list(1, 4096), default=None,
                        metavar="LIST",
                        help="KV block sizes in tokens (default: those the preset's attention "
                             "kernel takes, 64 for DeepSeek-V3.2 and GLM-5 (FlashMLA sparse); "
                             "16,32,64 for tiny). Other sizes are shown but never recommended")
    add_top_k_flag(parser, type=bounded_int(1, 32768), default=None,
                   help="positions selected per step (default: the preset's index_topk)")
    parser.add_argument("--link-gbps", type=bounded_number(0.001, 10000, " GB/s",
                                                           "decimal GB/s, not bytes/s"),
                        default=None, help=f"host->device gather speed, GB/s (default "
                                           f"{DEFAULT_LINK_GBPS:g}: published 656 B "
                                           f"row-gather figures, 31-37 GB/s; or --bench-json)")
    parser.add_argument("--bench-json", metavar="PATH", default=None,
                        help="take the link speed from the gather figures of a GPU `bench "
                             "--json` (or bench/gpu_check.py) result: a file, or a directory "
                             "(its newest such file); CPU results are refused (default: the "
                             "--link-gbps default)")
    parser.add_argument("--step-ms", type=step_points, default=None, metavar="MS|B:MS,...",
                        help=f"decode step time without transfers: MS at any batch, or "
                             f"BATCH:MS points (linear in between), e.g. 1:25,256:50 (default "
                             f"{DEFAULT_STEP_MS}, an assumption: measure your engine's)")
    parser.add_argument("--overlap", type=fraction, default=0.0,
                        help="share of the gathers hidden under the step's compute, in [0, 1] "
                             "(default 0: none, pessimistic)")
    parser.add_argument("--tp-split", metavar="N", type=bounded_int(1, 64), default=1,
                        help="model N tensor-parallel ranks splitting each step's gather "
                             "(worker split_gather): 1/N of the missed rows over each GPU's "
                             "own host link, plus the exchange between the GPUs (default 1: "
                             "no split)")
    parser.add_argument("--exchange-gbps", type=bounded_number(0.001, 100000, " GB/s"),
                        default=None, help="with --tp-split: GPU-to-GPU all_gather speed "
                                           "per GPU, GB/s (default 360: an assumption for "
                                           "NVLink 4)")
    parser.add_argument("--split-fraction", type=split_fraction, default=None,
                        metavar="auto|F",
                        help="with --tp-split: share of the top-k columns the exchange "
                             "carries (split_gather_fraction); default auto: each setting's "
                             "miss rate plus a 25%% headroom, rounded up to a level (the "
                             "worker's auto rule), which advise recommends")
    parser.add_argument("--split-chunks", metavar="N", type=bounded_int(1, 64), default=2,
                        help="with --tp-split: chunks the split gather is pipelined in "
                             "(split_gather_chunks, default 2)")
    parser.add_argument("--mtp", metavar="Q", type=bounded_int(1, 16), default=1,
                        help="query tokens per decode step (speculative decoding): Q top-k "
                             "selections looked up as one union, Q tokens per step (every "
                             "draft accepted); buffers default to Q x (1,2,4,8) x top-k")
    parser.add_argument("--max-batch", type=bounded_int(1, 1 << 20), default=None,
                        help="cap on requests decoded together (default: what fits)")
    parser.add_argument("--trace", metavar="FILE", type=existing_file, default=None,
                        help="measure miss rates on a recorded trace (.npz) instead of the "
                             "calibrated generator (default: the generator)")
    parser.add_argument("--streams", type=bounded_int(1, 256), default=4,
                        help="calibrated streams (request x index group) to measure (default 4)")
    parser.add_argument("--steps", type=bounded_int(2, 4096), default=96,
                        help="decode steps per calibrated stream (default 96; the first quarter "
                             "is left out as warm-up)")
    add_seed_flag(parser, what="the calibrated trace")
    parser.add_argument("--plot", metavar="PATH", type=output_path, default=None,
                        help="write a PNG of the sweep (needs matplotlib: the 'bench' extra; "
                             "default: no plot)")
    add_progress_flag(parser)
    add_json_flag(parser, "the sweep and the recommendation")
    return parser


def _table_row(r: dict[str, Any], mark: str, step_unit: tuple[str, int],
               request_unit: tuple[str, int]) -> str:
    return (f"{r['block_size']:>5} {r['device_buffer_size']:>7} {100 * r['miss_rate']:>5.1f}% "
            f"{r['rows_per_step']:>10,.0f} {in_unit(r['bytes_per_step'], step_unit):>9} "
            f"{in_unit(r['gpu_bytes_per_request'], request_unit):>12} {r['concurrency']:>9.1f} "
            f"{r['batch']:>6} {r['link_ms_per_step']:>8.2f} {r['step_ms']:>8.2f} "
            f"{r['tokens_per_s']:>9,.0f}{mark}")


def partial_pages(p: dict[str, Any]) -> list[tuple[int, int]]:
    """``(block_size, device_buffer_size)`` of the swept settings whose hot buffer is not a
    whole number of pages."""
    return [(r["block_size"], r["device_buffer_size"]) for r in p["settings"]
            if r["device_buffer_size"] % r["block_size"]]


def partial_pages_note(p: dict[str, Any]) -> str:
    """advise's own sentence for the settings ``partial_pages`` finds ("" when none)."""
    pairs = partial_pages(p)
    if not pairs:
        return ""
    each = ", ".join(f"buffer {buffer} at block {block} takes "
                     f"{-(-buffer // block) * block} rows ({-(-buffer // block) * block - buffer}"
                     f" unused)" for block, buffer in pairs)
    return (f"note: the settings marked (part page) have a hot buffer that is not a whole number "
            f"of pages; a hot buffer takes whole pages, so each request holds rows it never "
            f"uses, and GPU memory per request counts them: {each}; a multiple of the block "
            f"size uses every row")


def _recommendation(p: dict[str, Any]) -> list[str]:
    from hisparse_triton.advisor import RECOMMEND_TOLERANCE

    best, gpu, cross = p.get("recommended"), p["all_gpu"], p["crossover"]
    tie = (f"estimates within {100 * RECOMMEND_TOLERANCE:g}% of the best count as equal, the "
           f"least GPU memory per request wins")
    if best is None:
        return ["recommended: none: no setting of the sweep fits the budget"]
    if best["mode"] == "all-gpu":
        hs, hs_batch = best.get("best_hisparse_tokens_per_s"), best.get("best_hisparse_batch")
        if hs is None:
            why = "no HiSparse setting of the sweep fits the budget"
        elif hs_batch <= best["batch"]:
            why = (f"the best HiSparse setting reaches {hs:,.0f} tokens/s at batch {hs_batch}: "
                   f"it runs no more requests than all-GPU here, so its gathers can only cost time")
        else:
            why = (f"the best HiSparse setting reaches {hs:,.0f} tokens/s at batch {hs_batch}: "
                   f"its gathers cost more than its larger batch gains")
        return [f"recommended: all-GPU (no HiSparse): about {best['tokens_per_s']:,.0f} "
                f"tokens/s at batch {best['batch']} (all-GPU holds {gpu['concurrency']:.1f} "
                f"requests); {why}"]
    kernel = p.get("attention_kernel")
    note = "" if best["supported"] else (
        f"; NOTE: {kernel} does not take block size {best['block_size']} (it takes "
        f"{', '.join(map(str, p['supported_block_sizes']))}) and none of the swept sizes it "
        f"takes fits")
    lines = [f"recommended: block_size {best['block_size']}, device_buffer_size "
             f"{best['device_buffer_size']}: about {best['tokens_per_s']:,.0f} tokens/s at "
             f"batch {best['batch']} (miss rate {100 * best['miss_rate']:.1f}%), "
             f"{best['vs_all_gpu']:.2f}x all-GPU's {gpu['tokens_per_s']:,.0f} ({tie}){note}"]
    if cross["requests"] is not None:
        lines.append(f"crossover: with this setting HiSparse decodes faster than all-GPU from "
                     f"{cross['requests']} concurrent requests on (all-GPU holds "
                     f"{cross['all_gpu_batch']}); with fewer, keep every layer on the GPU")
    return lines


def _split_recommendation(p: dict[str, Any]) -> list[str]:
    """The capacity fraction ``--tp-split`` recommends for ``split_gather_fraction``."""
    split, best = p["tp_split"], p.get("recommended") or {}
    fraction = split.get("recommended_fraction")
    if fraction is None:
        return []
    where = (f"block_size {best['block_size']}, device_buffer_size "
             f"{best['device_buffer_size']}" if best.get("mode") == "hisparse"
             else "the best HiSparse setting")
    miss = split["recommended_miss_rate"]
    return [f"split gather capacity: split_gather_fraction {fraction:g} for {where} (miss "
            f"rate {100 * miss:.1f}% + {100 * split['headroom']:g}% headroom, rounded up to "
            f"a level; 'auto', the default, settles there from the observed misses)"]


def format_advice(p: dict[str, Any]) -> str:
    """The human-readable sweep and recommendation."""
    kernel = p.get("attention_kernel")
    sizes = p.get("supported_block_sizes")
    given = [b for b in p["block_sizes"] if sizes and b not in sizes]
    blocks = (f"block sizes {', '.join(map(str, p['block_sizes']))} ("
              + (f"{kernel} takes {', '.join(map(str, sizes))} only"
                 + (f"; {', '.join(map(str, given))} shown, never recommended" if given else "")
                 if kernel else "any size: the preset names no attention kernel") + ")")
    mtp = (f", {p['mtp']} query tokens per step (one union; every draft token assumed "
           f"accepted)" if p["mtp"] > 1 else "")
    overlap = (f"{100 * p['overlap']:g}% of the gathers hidden under compute" if p["overlap"]
               else "gathers not overlapped with compute")
    step_unit = byte_unit([r["bytes_per_step"] for r in p["settings"] if "error" not in r])
    request_unit = byte_unit([r["gpu_bytes_per_request"] for r in p["settings"]
                              if "error" not in r] + [p["all_gpu"]["gpu_bytes_per_request"]])
    step_head, request_head = f"{step_unit[0]}/step", f"GPU {request_unit[0]}/req"
    lines = [
        f"hisparse-triton advise: {p['preset']} ({p['sparse_layers']} sparse layers, "
        f"{p['index_groups']} index groups, {p['row_bytes']} B rows), {p['context_len']} tokens "
        f"per request, {p['gpu_memory_gib']:g} GiB GPU KV budget, {p['host_pool_gib']:g} GiB "
        f"host pool, top-k {p['top_k']}{mtp}; {blocks}",
        f"miss rates: the runtime's LRU on the {p['trace']}, steady state (the first "
        f"{p['warmup_steps']} steps of each stream left out), the last 2 pages resident",
        f"link: {p['link_gbps']:g} GB/s ({p['link_source']})" + (
            f"; {p['tp_split']['ranks']} TP ranks split each gather (link ms per rank: 1/N "
            f"of the misses over its own link + the exchange at "
            f"{p['tp_split']['exchange_gbps']:g} GB/s; assumes every GPU has its own host "
            f"link)" if p.get("tp_split") else ""),
        f"decode step compute: {p['step_model']['text']} ({p['step_model']['source']}); "
        f"{overlap}",
        "",
        f"{'block':>5} {'buffer':>7} {'miss':>6} {'rows/step':>10} {step_head:>9} "
        f"{request_head:>12} {'requests':>9} {'batch':>6} {'link ms':>8} {'step ms':>8} "
        f"{'tokens/s':>9}",
    ]
    partial = set(partial_pages(p))
    best = p.get("recommended") or {}
    for r in p["settings"]:
        if "error" in r:
            lines.append(f"{r['block_size']:>5} {r['device_buffer_size']:>7}  does not fit: "
                         f"{r['error']}")
            continue
        mark = " <-" if best.get("mode") == "hisparse" and \
            (r["block_size"], r["device_buffer_size"]) == \
            (best.get("block_size"), best.get("device_buffer_size")) else ""
        if not r["supported"]:
            mark += f" (not {kernel})"
        if (r["block_size"], r["device_buffer_size"]) in partial:
            mark += " (part page)"
        lines.append(_table_row(r, mark, step_unit, request_unit))
    gpu = p["all_gpu"]
    mark = " <-" if best.get("mode") == "all-gpu" else ""
    lines.append(f"{'  all-GPU (every layer on the GPU)':<41} "
                 f"{in_unit(gpu['gpu_bytes_per_request'], request_unit):>12} "
                 f"{gpu['concurrency']:>9.1f} "
                 f"{gpu['batch']:>6} {0.0:>8.2f} {gpu['step_ms']:>8.2f} "
                 f"{gpu['tokens_per_s']:>9,.0f}{mark}")
    lines.append(f"(rows/step and {step_head}: gathered per request per decode step over all "
                 f"layers; link ms: the whole batch's gathers per step; step ms: compute and "
                 f"link together)")
    note = partial_pages_note(p)
    if note:
        lines.append(note)
    lines.append("")
    lines += _recommendation(p)
    lines.append(f"formula: {p['formula']}")
    if p.get("tp_split"):
        lines.append(f"split gather: {p['tp_split']['formula']}")
        lines += _split_recommendation(p)
    return "\n".join(lines)


def quietly_planned(sweep: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``sweep()`` without the planner's ``HiSparsePlanWarning`` on stderr: the sweep tries
    settings the planner warns about on purpose (a hot buffer that is not whole pages), and
    the report says so in its own words (``partial_pages_note``). Any other warning is passed
    on as it was raised."""
    from hisparse_triton.layout import HiSparsePlanWarning

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=HiSparsePlanWarning)
        return sweep()


def run(args: argparse.Namespace) -> int:
    """Entry point of ``hisparse-triton advise``."""
    from hisparse_triton.advisor import (
        DEFAULT_BUFFER_FACTORS, DEFAULT_EXCHANGE_GBPS, AdviseSettings, StepModel, attention_kernel,
        find_bench_result, link_from_bench, run_advise)
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
        source = DEFAULT_LINK_SOURCE
    if args.bench_json is not None:
        path, result = find_bench_result(args.bench_json)
        by_rows, source = link_from_bench(result, geometry.mla_row_bytes)
        link_gbps = by_rows(1 << 14)
        source = f"{source}, read from {path}; each setting at its rows per launch"
        print(f"hisparse-triton advise: link speed from {path}", file=sys.stderr)
    step = (StepModel(args.step_ms, "given") if args.step_ms is not None else
            StepModel(source="default, an assumption: measure your engine's with --step-ms"))
    buffers = args.buffers
    settings = AdviseSettings(
        preset=args.preset, gpu_memory_gib=args.gpu_memory_gib,
        host_pool_gib=args.host_pool_gib, context_len=args.context_len, buffers=buffers,
        block_sizes=args.block_sizes, top_k=args.top_k, link_gbps=link_gbps,
        link_source=source, step=step, overlap=args.overlap, mtp=args.mtp,
        max_batch=args.max_batch, trace=args.trace, streams=args.streams, steps=args.steps,
        warmup=max(1, args.steps // 4), seed=args.seed, link_by_rows=by_rows,
        tp_split=args.tp_split, split_fraction=args.split_fraction,
        split_chunks=args.split_chunks,
        exchange_gbps=args.exchange_gbps or DEFAULT_EXCHANGE_GBPS)
    blocks = args.block_sizes or attention_kernel(geometry.name)[1] or (16, 32, 64)
    total = len(blocks) * len(buffers or DEFAULT_BUFFER_FACTORS)
    bar = Progress(total, "advise", enabled=default_enabled(args.progress), unit="setting")
    try:
        payload = quietly_planned(lambda: run_advise(settings, on_setting=bar.step))
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
