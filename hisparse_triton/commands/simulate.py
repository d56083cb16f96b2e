"""``hisparse-triton simulate``: replay a decode workload through the real runtime.

The simulator itself is ``hisparse_triton.simulation`` (``run_simulation``); this module is
its command line and report. Defaults scale with the preset (top-k, prompts of 16 x top-k
tokens, a few index groups of a large model); the device pool is sized like a deployment at
steady state, so the runtime works under memory pressure and misses happen. ``--trace FILE``
replays recorded top-k positions, ``--record FILE`` writes the run's positions in that
format (``hisparse_triton.trace``), ``--policies`` compares the runtime's LRU with FIFO and
the offline optimum on the same positions. Imports torch only inside ``run``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from hisparse_triton.commands.argtypes import (
    bounded_int,
    bounded_number,
    existing_file,
    fraction,
    output_path,
)
from hisparse_triton.commands.flags import (
    add_device_flag,
    add_progress_flag,
    add_seed_flag,
    add_threads_flag,
    add_top_k_flag,
    set_torch_threads,
)
from hisparse_triton.commands.verdict_flags import (
    add_link_flag,
    add_verdict_flags,
    given_verdict_flags,
    verdict_settings,
)
from hisparse_triton.commands.output import (
    add_json_flag,
    json_document,
    report_stream,
    write_json,
)
from hisparse_triton.link import DEFAULT_LINK_GBPS, DEFAULT_LINK_SOURCE
from hisparse_triton.presets import DEFAULT_PRESET, list_presets
from hisparse_triton.units import format_duration_us

#: ``policies.POLICIES`` and ``workload.WORKLOADS``, spelled here so that building the parser
#: does not import numpy (a test checks they agree).
POLICIES = ("lru", "fifo", "belady")
WORKLOADS = ("calibrated", "locality")
#: ``schema_version`` of ``simulate --json``.
SCHEMA_VERSION = 1
MAX_BLOCKS = 2**31 - 1
#: Flags that size a synthetic workload (a trace brings its own schedule).
SYNTHETIC_FLAGS = ("requests", "max_running", "prompt_len", "output_len", "workload",
                   "locality")


def _policy_list(text: str) -> tuple[str, ...]:
    names = [p for p in text.replace(" ", "").split(",") if p]
    if names == ["none"]:
        return ()
    if names == ["all"]:
        return POLICIES
    bad = [n for n in names if n not in POLICIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(bad) or 'empty list'}; choose "
                                         f"from {', '.join(POLICIES)}, all or none")
    return tuple(dict.fromkeys(names))


def add_shape_flags(group: Any) -> None:
    """The workload's size: ``--requests``, ``--max-running``, ``--prompt-len``,
    ``--output-len``, ``--top-k`` and ``--device-buffer-size`` (also ``metrics``' demo)."""
    group.add_argument("--requests", type=bounded_int(1, 1 << 20), default=None,
                       help="requests in the workload (default 8)")
    group.add_argument("--max-running", type=bounded_int(1, 4096), default=None,
                       help="requests decoded together (default 4)")
    group.add_argument("--prompt-len", type=bounded_int(1, 1 << 22), default=None,
                       help="prompt tokens per request (default 16 x top-k, within the "
                            "preset's context)")
    group.add_argument("--output-len", type=bounded_int(1, 1 << 20), default=None,
                       help="generated tokens per request (default 64)")
    add_top_k_flag(group, type=bounded_int(1, 32768), default=None,
                   help="positions selected per step (default: the preset's index_topk)")
    group.add_argument("--device-buffer-size", type=bounded_int(1, 32768), default=None,
                       help="hot-buffer rows per request (default 2 x top-k)")


def add_watermark_flag(group: Any) -> None:
    """``--free-block-watermark``."""
    group.add_argument("--free-block-watermark", type=bounded_number(0.0, 1.0), default=None,
                       help="fraction of the device pool that must stay truly free before "
                            "requests offload; below it committed pages leave the GPU "
                            "(default 0.1; 1 = pure HiSparse: every committed page outside "
                            "the active tail is read through the hot buffer)")


def add_runtime_flags(group: Any) -> None:
    """``--device``, ``--backend`` and ``--threads``."""
    add_device_flag(group, help="where the runtime runs")
    group.add_argument("--backend", default="auto", choices=("auto", "triton", "torch"),
                       help="kernel backend (default auto: triton on CUDA, torch elsewhere)")
    add_threads_flag(group, default=1, help="CPU threads for torch (default 1, as bench: the "
                                            "ops are small, and more threads make the timing "
                                            "swing with the machine's load)")


def add_verify_flag(group: Any) -> None:
    """``--verify/--no-verify``."""
    group.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None,
                       help="check every resolved row against a dense copy (default: on "
                            "when the dense copy is under 256 MiB)")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``simulate`` and its flags."""
    parser = subparsers.add_parser(
        "simulate", help="replay a decode workload through the runtime",
        description="Replay a decode workload (continuous batching; a calibrated synthetic "
                    "top-k trace, or a recorded one) through the real HiSparse runtime and "
                    "report hit rate, bytes moved, transfer time and GPU memory saved, the "
                    "runtime's LRU next to FIFO and the offline optimum; --verify checks "
                    "every resolved row against a dense copy. Defaults scale with the preset.")
    parser.add_argument("--preset", default=None, choices=list_presets(),
                        help=f"model geometry (default {DEFAULT_PRESET}, or with --trace the "
                             f"preset the trace was recorded with; tiny runs in seconds)")
    parser.add_argument("--layers", type=bounded_int(1, 1024), default=None,
                        help="sparse layers to simulate (default: all of a preset with at "
                             "most 8, else 4 index groups: a sample, scaled to the model)")
    work = parser.add_argument_group("workload (defaults from the preset)")
    add_shape_flags(work)
    work.add_argument("--workload", choices=WORKLOADS, default=None,
                      help="top-k generator: calibrated (default: reproduces the published "
                           "GLM-5.1 LRU miss curve) or locality (--locality)")
    work.add_argument("--locality", type=fraction, default=None,
                      help="for --workload locality (implied): fraction of each step's top-k "
                           "repeated from the previous step (default 0.8)")
    work.add_argument("--trace", metavar="FILE", type=existing_file, default=None,
                      help="replay recorded top-k positions (.npz, see docs/tools.md) instead "
                           "of a generator; the trace sets requests, lengths and top-k, and "
                           "a trace written by --record also the preset, layers and pool "
                           "settings (flags override; default: the generator)")
    work.add_argument("--record", metavar="FILE", type=output_path, default=None,
                      help="write this run's top-k positions as a trace (.npz; default: not "
                           "written)")
    work.add_argument("--prefill-chunk", type=bounded_int(1, 1 << 22), default=None,
                      help="prompt tokens appended and committed at a time (default 8192, "
                           "at most --max-num-batched-tokens)")
    work.add_argument("--max-num-batched-tokens", type=bounded_int(1, 1 << 22), default=None,
                      help="the engine's chunk limit: the runtime refuses more uncommitted "
                           "tokens per request, and a request longer than one chunk offloads "
                           "(default: unset)")
    work.add_argument("--shared-prefix", metavar="FRACTION", type=fraction, default=None,
                      help="every prompt starts with the same FRACTION x prompt-len tokens; "
                           "token ids go to add_request and only the uncached rest is "
                           "appended (default: no token ids, no prefix reuse)")
    work.add_argument("--mtp", metavar="Q", type=bounded_int(1, 16), default=1,
                      help="query tokens per decode step (speculative decoding): Q tokens "
                           "appended, their top-k resolved as one [R, Q, K] union (default 1)")
    add_seed_flag(work, what="the trace and the KV bytes")
    pools = parser.add_argument_group("pools and runtime")
    add_watermark_flag(pools)
    pools.add_argument("--offload-threshold-pages", type=bounded_int(1, 1 << 20), default=None,
                       help="a request that should offload does so once this many of its "
                            "pages can leave the GPU (default 1)")
    pools.add_argument("--host-blocks", type=bounded_int(2, MAX_BLOCKS), default=None,
                       help="host pool blocks (default: every running request's reservation)")
    pools.add_argument("--device-blocks", type=bounded_int(2, MAX_BLOCKS), default=None,
                       help="device pool blocks (default: steady state of --max-running "
                            "requests: indexer, hot region and resident tail each, plus one "
                            "prefill chunk)")
    add_runtime_flags(pools)
    report = parser.add_argument_group("report")
    report.add_argument("--policies", type=_policy_list, default=POLICIES, metavar="LIST",
                        help=f"hot-buffer policies to compare on the same positions: "
                             f"{','.join(POLICIES)}, all (default) or none")
    add_verify_flag(report)
    add_link_flag(report, "host<->device bandwidth for the transfer-time estimate and the "
                          "verdict")
    report.add_argument("--warmup-steps", type=bounded_int(0, 1 << 20), default=None,
                        metavar="N",
                        help="resolves of each request and index group left out of the "
                             "steady-state miss rate (default: until its hot buffer is full, "
                             "at most half of them); with --verdict also the decode steps "
                             "left out of the verdict's window (default: the first quarter)")
    add_progress_flag(report)
    add_json_flag(report, "the report")
    judge = parser.add_argument_group(
        "live verdict (--verdict: the advise model fed with the run's observed miss rate)")
    judge.add_argument("--verdict", action="store_true",
                       help="end the report with the live verdict: the run's counters "
                            "sampled after every decode step, the steady-state miss rate "
                            "after --warmup-steps decode steps (default: the first quarter) "
                            "fed to the advise model: estimated throughput against keeping "
                            "every layer on the GPU, and the setting advise would pick")
    add_verdict_flags(judge, link_flag=False)
    return parser


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _residency_line(r: dict[str, Any]) -> str:
    if r["free_block_watermark"] is not None and not isinstance(r["free_block_watermark"], int) \
            and r["free_block_watermark"] >= 1.0:
        return (f"residency: {r['unpinned_pages']} pages dropped from the GPU as soon as they "
                f"were durable (watermark 1: pure HiSparse, they are read from the host "
                f"through the hot buffer from then on), so no transfer was avoided")
    return (f"residency: {r['unpinned_pages']} pages unpinned (readable until their block is "
            f"reused), {r['lost_pages']} lost; keeping them readable avoided "
            f"{r['unpinned_misses_avoided']} transfers "
            f"({_bytes(r['unpinned_h2d_bytes_avoided'])}): the same LRU with them dropped at "
            f"once misses {r['misses_if_unpinned_dropped']}")


def _memory_line(r: dict[str, Any]) -> str:
    head = (f"GPU memory (decode working set, peak, simulated layers): all layers on GPU "
            f"{_bytes(r['all_gpu_peak_bytes'])}, HiSparse {_bytes(r['device_peak_bytes'])} "
            f"+ host {_bytes(r['host_peak_bytes'])}")
    saved = r["gpu_bytes_saved"]
    if saved == 0:
        return f"{head} -> no GPU memory saved (every page stayed on the GPU)"
    if saved > 0:
        return (f"{head} -> {_bytes(saved)} of GPU memory saved "
                f"({100 * r['gpu_saved_fraction']:.0f}%)")
    why = ("the pool held every page (nothing offloaded) and the indexer's pages take whole "
           "pool blocks; HiSparse saves memory only under pressure" if not r["unpinned_pages"]
           else "the hot regions and the indexer's whole pool blocks cost more than the pages "
                "that left the GPU")
    return (f"{head} -> {_bytes(-saved)} MORE GPU memory than all layers on the GPU "
            f"({100 * -r['gpu_saved_fraction']:.0f}%): {why}")


def _steady_line(r: dict[str, Any]) -> str:
    st = r["steady_state"]
    if st["warmup"] == "buffer-full":
        warm = "each request's resolves until its hot buffer was full (at most half of them)"
    else:
        warm = f"each request's first {st['warmup_steps']} resolves per index group"
    if not st["columns"]:
        return f"steady state: nothing left after the warm-up ({warm}); see the whole run"
    return (f"steady state: miss rate {_pct(st['miss_rate'])} of top-k columns after a "
            f"warm-up of {warm}: "
            f"{st['resolved_rows']} of {st['resolved_rows_total']} resolved rows counted "
            f"(the whole run's {_pct(r['miss_rate'])} includes each buffer's cold start)")


def format_report(r: dict[str, Any]) -> str:
    """The human-readable report."""
    sampled = (f"{r['sparse_layers']} of {r['model_sparse_layers']} sparse layers simulated "
               f"({r['index_groups']} of {r['model_index_groups']} index groups, a sample)"
               if r["sampled"] else f"{r['sparse_layers']} sparse layers, "
               f"{r['index_groups']} index groups")
    source = {"trace": f"recorded trace {r['trace']}",
              "calibrated": "calibrated synthetic top-k trace",
              "locality": f"synthetic top-k trace, locality {r['locality']}"}[r["workload"]]
    mtp = r["mtp"]
    serving = "".join([
        f", engine chunk limit {r['max_num_batched_tokens']}"
        if r["max_num_batched_tokens"] is not None else "",
        f", a shared prefix of {r['shared_prefix_tokens']} tokens ({_pct(r['shared_prefix'])} "
        f"of each prompt)" if r["shared_prefix"] is not None else "",
        f", {mtp} query tokens per decode step" if mtp > 1 else ""])
    pool = (f"set by --device-blocks, watermark {r['free_block_watermark']:g}"
            if r["device_pool_sizing"] == "given" else
            f"steady state of {r['max_running']} requests, under memory pressure")
    columns = f"({mtp} x {r['top_k']})" if mtp > 1 else f"{r['top_k']}"
    preset = r["preset"] + {"trace": ", from the trace", "default": ", the default",
                            "given": ""}[r.get("preset_source", "given")]
    lines = [
        f"hisparse-triton simulate: preset {preset} ({sampled}; {r['resident_groups']} "
        f"resident + {r['resident_groups']} hot groups), device {r['device']}, backend "
        f"{r['backend']}",
        f"workload: {source}; {r['requests']} requests x ({r['prompt_len']} prompt + "
        f"{r['output_len']} output) tokens, {r['max_running']} running at a time, prefill "
        f"chunks of {r['prefill_chunk']}{serving}; top-k {r['top_k']}, hot buffer "
        f"{r['device_buffer_size']} rows",
    ]
    taken = [name for name in r.get("from_trace", []) if name != "preset"]
    if taken:
        lines.append(f"from the trace's metadata: {', '.join(taken)} (flags override)")
    cal = r.get("calibration")
    if cal:
        ours = " / ".join(_pct(x) for x in cal["lru_miss_rates"])
        published = " / ".join(_pct(x) for x in cal["published_miss_rates"])
        lines.append(f"generator calibration (the generator's own fit, not this run): LRU miss "
                     f"rate at buffer k / 2k / 4k = {ours} on one {cal['history']}-token "
                     f"stream at top-k {cal['top_k']}; published GLM-5.1 at k = 2048: "
                     f"{published}")
    lines += [
        f"device pool: {r['device_pool_blocks']} blocks ({_bytes(r['device_pool_bytes'])}: "
        f"{pool}); host pool {_bytes(r['host_pool_bytes'])}",
        f"decode: {r['decode_steps']} steps, {r['generated_tokens']} tokens, {r['resolves']} "
        f"resolve calls, {r['resolved_rows']} rows x {columns} columns"
        + (" (each row's selections resolved as one union)" if mtp > 1 else ""),
        f"top-k columns: {r['hits']} hits ({r['resident_hits']} from resident pages, "
        f"{r['hot_hits']} from the hot buffer), {r['misses']} misses (gathered), "
        f"{r['masked']} masked -> hit rate {_pct(r['hit_rate'])} (miss rate "
        f"{_pct(r['miss_rate'])} of top-k columns, whole run)",
        _steady_line(r),
    ]
    if r.get("query_tokens"):
        per = ", ".join(f"token {q['query']} {_pct(q['hit_rate'])} ({q['misses']} misses)"
                        for q in r["query_tokens"])
        lines.append(f"per query token (a miss counts for the first token selecting it): "
                     f"hit rate {per}; {r['misses_per_generated_token']:.1f} misses per "
                     f"generated token")
    lines.append(_residency_line(r))
    if r["shared_prefix"] is not None:
        lines.append(
            f"prefix cache: {r['prefix_hit_tokens']} of {r['prefix_query_tokens']} prompt "
            f"tokens hit ({_pct(r['prefix_hit_rate'])}): not recomputed, "
            f"{_bytes(r['prefix_d2h_bytes_avoided'])} of write-through not repeated; "
            f"{r['readopted_pages']} pages adopted from the GPU")
    policies = r.get("policies")
    if policies:
        lines.append(f"hot-buffer policies on the same positions ({r['device_buffer_size']} "
                     f"slots; {r['buffer_lookups']} lookups: the distinct positions of each "
                     f"step whose page was not on the GPU; miss rate here = misses / lookups, "
                     f"not / top-k columns):")
        notes = {"lru": "the runtime's rule" + (
                     f": equals its {r['misses']} misses" if r.get("lru_matches_runtime")
                     else f": MISMATCH with the runtime's {r['misses']} misses"),
                 "fifo": "", "belady": "offline optimum (needs the future)"}
        for name, v in policies.items():
            lines.append(f"  {name:<7}{v['misses']:>12} misses  {_pct(v['miss_rate']):>6} of "
                         f"lookups  {notes[name]}".rstrip())
    scale = (f" (scaled to {r['model_index_groups']} index groups)" if r["sampled"] else "")
    link = "" if r.get("link_source", "given") == "given" else f" ({r['link_source']})"
    lines += [
        f"bytes moved: host->device {_bytes(r['h2d_bytes'])} (misses), device->host "
        f"{_bytes(r['d2h_bytes'])} (write-through of every new row)",
        f"at {r['link_gbps']:g} GB/s{link}: host->device "
        f"{format_duration_us(r['h2d_seconds_per_step_model'] * 1e6)} per decode step{scale}, "
        f"{_bytes(r['h2d_bytes_per_step_model'])}",
        _memory_line(r),
    ]
    if r["verified"]:
        lines.append(f"verify: exact ({r['rows_checked']} resolved rows checked against the "
                     f"dense copy, leaders and followers)")
    else:
        lines.append("verify: off")
    verdict = r.get("verdict")
    if verdict:
        lines.append(verdict["text"])
    rec = r.get("record")
    if rec:
        lines.append(f"recorded: {rec['records']} top-k selections ({rec['requests']} requests, "
                     f"{rec['decode_steps']} decode steps, {rec['index_groups']} index groups "
                     f"x top-k {rec['top_k']}, with the preset and pool settings) to "
                     f"{rec['path']}; replay it with: hisparse-triton simulate --trace "
                     f"{rec['path']}")
    total = r.get("command_seconds")
    lines.append(f"wall time {r['wall_seconds']:.2f} s" if total is None else
                 f"wall time {total:.2f} s (the command from its start to this report, imports, "
                 f"setup and checks included, Python's own start-up and exit not; the "
                 f"decode loop took {r['wall_seconds']:.2f} s of it)")
    return "\n".join(lines)


def settings_from_args(args: argparse.Namespace) -> Any:
    """``SimSettings`` of the parsed flags (``ValueError`` for flags that do not combine)."""
    from hisparse_triton.simulation import SimSettings

    if args.trace is not None:
        given = [f"--{name.replace('_', '-')}" for name in SYNTHETIC_FLAGS
                 if getattr(args, name) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} cannot be combined with --trace: the trace "
                             f"sets the requests, their lengths and the positions.")
    workload = args.workload
    if workload is None:
        workload = "locality" if args.locality is not None else "calibrated"
    if args.locality is not None and workload != "locality":
        raise ValueError(f"--locality applies to --workload locality, not {workload}.")
    judge = given_verdict_flags(args)
    if judge and not args.verdict:
        raise ValueError(f"{', '.join(judge)} set the live verdict's model: add --verdict.")
    verdict = (verdict_settings(args, args.preset, args.link_gbps) if args.verdict else None)
    return SimSettings(
        preset=args.preset, layers=args.layers, requests=args.requests,
        max_running=args.max_running, prompt_len=args.prompt_len, output_len=args.output_len,
        top_k=args.top_k, device_buffer_size=args.device_buffer_size, workload=workload,
        locality=args.locality if args.locality is not None else 0.8, trace=args.trace,
        record=args.record, policies=args.policies, prefill_chunk=args.prefill_chunk,
        max_num_batched_tokens=args.max_num_batched_tokens, shared_prefix=args.shared_prefix,
        mtp=args.mtp,
        offload_threshold_pages=args.offload_threshold_pages,
        free_block_watermark=args.free_block_watermark, host_blocks=args.host_blocks,
        device_blocks=args.device_blocks, seed=args.seed, device=args.device,
        backend=args.backend, verify=args.verify,
        link_gbps=args.link_gbps if args.link_gbps is not None else DEFAULT_LINK_GBPS,
        link_source="given" if args.link_gbps is not None else DEFAULT_LINK_SOURCE,
        warmup_steps=args.warmup_steps, verdict=verdict)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``hisparse-triton simulate``."""
    started = time.perf_counter()
    set_torch_threads(args.threads)  # refuses more threads than CPUs, naming the count
    settings = settings_from_args(args)
    from hisparse_triton.benchmarks.progress import Progress, default_enabled
    from hisparse_triton.errors import HiSparseError
    from hisparse_triton.oracle import OracleMismatch
    from hisparse_triton.simulation import run_simulation

    out = report_stream(args.json)
    bar: list[Any] = []

    def on_step(done: int, total: int) -> None:
        if not bar:
            bar.append(Progress(total, "simulate", enabled=default_enabled(args.progress)))
        bar[0].step()

    try:
        report = run_simulation(settings, on_step=on_step)
    except OracleMismatch as exc:
        print(f"hisparse-triton simulate: verify FAILED: {' '.join(str(exc).split())}",
              file=sys.stderr)
        return 1
    except HiSparseError as exc:
        print(f"hisparse-triton simulate: error: {' '.join(str(exc).split())}",
              file=sys.stderr)
        return 1
    finally:
        if bar:
            bar[0].close()
    for warning in report["warnings"]:
        print(f"hisparse-triton simulate: warning: {warning}.", file=sys.stderr)
    report["command_seconds"] = time.perf_counter() - started
    print(format_report(report), file=out)
    if report.get("lru_matches_runtime") is False:
        print("hisparse-triton simulate: error: the LRU model disagrees with the runtime's "
              "miss count on the same positions (a bug; please report it).", file=sys.stderr)
        return 1
    if args.json:
        write_json(json_document("simulate", SCHEMA_VERSION, report), args.json)
    return 0
