"""``hisparse-triton simulate``: replay a synthetic decode workload through the real runtime.

Builds a preset's layout with pools sized for the workload (``workload.plan_for_workload``),
creates a ``HiSparseRuntime`` on the current device (CPU by default; CUDA when asked or
available with ``--device auto``), then runs continuous batching: requests are admitted up to
``--max-running`` at a time, prefilled in one chunk (append + write + commit), and decoded
one token per step; every step resolves a top-k trace with temporal locality
(``workload.TopkTrace``) for every index group, gathers the misses and mirrors the new rows.

With ``--verify`` (on by default when the dense copy is small) a ``DenseOracle`` writes random
KV bytes and checks every row ``resolve`` points at against a dense copy, for the leader and
all followers; the run fails (exit 1) on the first mismatch.

Reported: hit rate, bytes moved each way and what they cost at ``--link-gbps``, and the GPU
memory HiSparse needs against keeping every layer's history on the GPU. Imports torch only
inside ``run``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import deque
from typing import Any, Optional

from hisparse_triton.commands.argtypes import (
    fraction,
    nonnegative_int,
    positive_float,
    positive_int,
)
from hisparse_triton.presets import build_kv_cache_spec, get_preset, list_presets

DEFAULT_PRESET = "tiny"
#: ``--verify auto`` checks runs whose dense copy stays under this many bytes.
VERIFY_AUTO_MAX_BYTES = 256 << 20






def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``simulate`` and its flags."""
    parser = subparsers.add_parser(
        "simulate", help="replay a synthetic decode workload through the runtime",
        description="Replay a synthetic decode workload (continuous batching, a top-k trace "
                    "with temporal locality) through the real HiSparse runtime and report "
                    "hit rate, bytes moved, transfer time and GPU memory saved; --verify "
                    "checks every resolved row against a dense copy.")
    parser.add_argument("--preset", default=DEFAULT_PRESET, choices=list_presets(),
                        help=f"model geometry (default {DEFAULT_PRESET})")
    parser.add_argument("--layers", type=positive_int, default=None,
                        help="sparse layers to simulate (default: the preset's)")
    parser.add_argument("--requests", type=positive_int, default=8,
                        help="requests in the workload (default 8)")
    parser.add_argument("--max-running", type=positive_int, default=4,
                        help="requests decoded together (default 4)")
    parser.add_argument("--prompt-len", type=positive_int, default=768,
                        help="prompt tokens per request (default 768)")
    parser.add_argument("--output-len", type=positive_int, default=64,
                        help="generated tokens per request (default 64)")
    parser.add_argument("--topk", type=positive_int, default=None,
                        help="positions selected per step (default: the preset's index_topk)")
    parser.add_argument("--device-buffer-size", type=positive_int, default=None,
                        help="hot-buffer rows per request (default 2 x topk)")
    parser.add_argument("--locality", type=fraction, default=0.8,
                        help="fraction of each step's top-k repeated from the previous step "
                             "(default 0.8)")
    parser.add_argument("--offload-threshold-pages", type=positive_int, default=None,
                        help="offload a request's history once this many pages are sealed "
                             "outside the active tail (default: the hot region's blocks)")
    parser.add_argument("--host-blocks", type=positive_int, default=None,
                        help="host pool blocks (default: every request's reservation)")
    parser.add_argument("--device-blocks", type=positive_int, default=None,
                        help="device pool blocks (default: sized for --max-running requests)")
    parser.add_argument("--seed", type=nonnegative_int, default=0, help="trace seed")
    parser.add_argument("--device", default="cpu",
                        help="cpu (default), cuda, cuda:N or auto (cuda when available)")
    parser.add_argument("--backend", default="auto", choices=("auto", "triton", "torch"),
                        help="kernel backend (default auto: triton on CUDA, torch elsewhere)")
    parser.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None,
                        help="check every resolved row against a dense copy (default: on "
                             "when the dense copy is under 256 MiB)")
    parser.add_argument("--link-gbps", type=positive_float, default=50.0,
                        help="host<->device bandwidth for the transfer-time estimate, GB/s "
                             "(default 50)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="CPU threads for torch (default 1: the ops are small)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar on stderr (default: when stderr is a terminal)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser


class _Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.done, self._last = max(total, 1), enabled, 0, -1.0

    def step(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            width = 30
            filled = int(width * self.done / self.total)
            print(f"\rsimulate [{'#' * filled}{'.' * (width - filled)}] "
                  f"{self.done}/{self.total} steps", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr, flush=True)


def simulate(*, preset: str = DEFAULT_PRESET, layers: Optional[int] = None, requests: int = 8,
             max_running: int = 4, prompt_len: int = 768, output_len: int = 64,
             topk: Optional[int] = None, device_buffer_size: Optional[int] = None,
             locality: float = 0.8, offload_threshold_pages: Optional[int] = None,
             host_blocks: Optional[int] = None, device_blocks: Optional[int] = None,
             seed: int = 0, device: str = "cpu", backend: str = "auto",
             verify: Optional[bool] = None, link_gbps: float = 50.0,
             progress: bool = False) -> dict[str, Any]:
    """Run the workload; returns the report as a dict (see ``hisparse-triton simulate``).

    Raises ``ValueError`` for a bad configuration, ``HiSparseError`` when the pools cannot
    hold the workload, ``oracle.OracleMismatch`` when verification fails.
    """
    import numpy as np
    import torch

    from hisparse_triton.config import ACTIVE_TAIL_PAGES
    from hisparse_triton.oracle import DenseOracle
    from hisparse_triton.runtime import HiSparseRuntime
    from hisparse_triton.specs import cdiv
    from hisparse_triton.workload import TopkTrace, plan_for_workload

    geometry = get_preset(preset)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine.")
    topk = geometry.index_topk if topk is None else topk
    max_len = prompt_len + output_len
    if max_len > geometry.max_model_len:
        raise ValueError(f"prompt {prompt_len} + output {output_len} = {max_len} tokens exceed "
                         f"the {preset} preset's max context of {geometry.max_model_len}.")
    max_running = min(max_running, requests)
    spec = build_kv_cache_spec(geometry, num_layers=layers)
    plan = plan_for_workload(spec, max_model_len=max_len, num_requests=max_running, topk=topk,
                             device_buffer_size=device_buffer_size, prompt_len=prompt_len,
                             host_blocks=host_blocks, device_blocks=device_blocks)
    B = plan.block_size
    runtime = HiSparseRuntime(plan.kv_cache_config, plan.config, max_num_seqs=max_running,
                              device=device, backend=backend,
                              offload_threshold_pages=offload_threshold_pages,
                              free_block_watermark=1.0)
    try:
        leaders = runtime.leaders
        dense_bytes = max_running * max_len * sum(
            runtime.device_cache(layer).shape[-1] for layer in runtime.device_layers)
        if verify is None:
            verify = dense_bytes <= VERIFY_AUTO_MAX_BYTES
        oracle = DenseOracle(runtime, seed=seed) if verify else None
        trace = TopkTrace(topk, locality, seed=seed)
        waiting = deque(range(requests))
        running: dict[int, int] = {}  # request -> tokens generated
        total_steps = cdiv(requests, max_running) * output_len
        bar = _Progress(total_steps, progress)
        all_gpu_peak = device_peak_blocks = 0
        decode_steps = resolves = resolved_rows = 0
        start = time.perf_counter()
        while waiting or running:
            while waiting and len(running) < max_running:
                rid = waiting.popleft()
                runtime.add_request(rid, prompt_len, output_len)
                rows = runtime.append_slots(rid, prompt_len)
                if oracle is not None:
                    oracle.add(rid)
                    oracle.write(rid, rows)
                runtime.commit()
                running[rid] = 0
            ids = list(running)
            for rid in ids:
                rows = runtime.append_slots(rid, 1)
                if oracle is not None:
                    oracle.write(rid, rows)
            # Working set of this step, both ways: every running request's full history on
            # the GPU vs the blocks the runtime holds now (before this step's commit).
            all_gpu_peak = max(all_gpu_peak, sum(cdiv(runtime.seq_len(rid), B)
                                                 for rid in ids) * plan.all_gpu_bytes_per_page)
            device_peak_blocks = max(device_peak_blocks, runtime.device_block_pool.num_used)
            for leader in leaders:
                positions = np.stack([trace.next((rid, leader), runtime.seq_len(rid))
                                      for rid in ids])
                topk_t = torch.from_numpy(positions)
                if runtime.device.type == "cuda":  # what an indexer would hand over
                    topk_t = topk_t.pin_memory().to(runtime.device, non_blocking=True)
                out = runtime.resolve(leader, ids, topk_t)
                if oracle is not None:
                    oracle.check_resolve(leader, ids, topk_t, out)
                resolves += 1
                resolved_rows += len(ids)
            runtime.commit()
            decode_steps += 1
            bar.step()
            for rid in ids:
                running[rid] += 1
                if running[rid] == output_len:
                    if oracle is not None:
                        oracle.check_pages(rid)
                        oracle.check_host(rid, runtime.seq_len(rid))
                        oracle.free(rid)
                    runtime.free_request(rid)
                    trace.forget(rid)
                    del running[rid]
        if runtime.device.type == "cuda":
            torch.cuda.synchronize(runtime.device)
        wall = time.perf_counter() - start
        bar.close()
        stats = runtime.stats()
        leaked = stats.device_blocks + stats.host_blocks
        if leaked:
            raise RuntimeError(f"{leaked} blocks still in use after every request was freed.")
        kvc = plan.kv_cache_config
        host_block_bytes = sum(runtime.host_cache(layer).shape[1] *
                               runtime.host_cache(layer).shape[2]
                               for layer in runtime.source_layers)
        device_peak = device_peak_blocks * kvc.bytes_per_block
        host_peak = stats.peak_host_blocks * host_block_bytes
        link = link_gbps * 1e9
        groups = {"resident": sum(1 for g in kvc.kv_cache_groups
                                  if type(g.kv_cache_spec).__name__ == "HiSparseResidentSpec")}
        report: dict[str, Any] = {
            "preset": preset,
            "sparse_layers": len(runtime.source_layers),
            "index_groups": len(leaders),
            "resident_groups": groups["resident"],
            "device": str(runtime.device),
            "backend": backend,
            "requests": requests,
            "max_running": max_running,
            "prompt_len": prompt_len,
            "output_len": output_len,
            "block_size": B,
            "topk": topk,
            "device_buffer_size": runtime.device_buffer_size,
            "locality": locality,
            "offload_threshold_pages": runtime.offload_threshold_pages,
            "active_tail_pages": ACTIVE_TAIL_PAGES,
            "decode_steps": decode_steps,
            "resolves": resolves,
            "resolved_rows": resolved_rows,
            "hits": stats.hits,
            "misses": stats.misses,
            "masked": stats.masked,
            "hit_rate": stats.hit_rate,
            "h2d_bytes": stats.h2d_bytes,
            "d2h_bytes": stats.d2h_bytes,
            "link_gbps": link_gbps,
            "h2d_seconds": stats.h2d_bytes / link,
            "d2h_seconds": stats.d2h_bytes / link,
            "h2d_seconds_per_step": stats.h2d_bytes / link / max(decode_steps, 1),
            "all_gpu_peak_bytes": all_gpu_peak,
            "device_peak_bytes": device_peak,
            "device_peak_bytes_with_prefill": stats.peak_device_blocks * kvc.bytes_per_block,
            "host_peak_bytes": host_peak,
            "device_pool_bytes": kvc.num_blocks * kvc.bytes_per_block,
            "host_pool_bytes": runtime.kv_cache_config.hisparse_host_num_blocks
            * host_block_bytes,
            "gpu_bytes_saved": all_gpu_peak - device_peak,
            "gpu_saved_fraction": (all_gpu_peak - device_peak) / all_gpu_peak
            if all_gpu_peak else 0.0,
            "unpinned_pages": stats.unpinned_pages,
            "verified": bool(verify),
            "rows_checked": oracle.rows_checked if oracle is not None else 0,
            "wall_seconds": wall,
        }
        return report
    finally:
        runtime.close()


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def format_report(r: dict[str, Any]) -> str:
    """The human-readable report."""
    lines = [
        f"hisparse-triton simulate: preset {r['preset']} ({r['sparse_layers']} sparse layers, "
        f"{r['index_groups']} index groups, {r['resident_groups']} resident + "
        f"{r['resident_groups']} hot groups), device {r['device']}, backend {r['backend']}",
        f"workload: {r['requests']} requests x ({r['prompt_len']} prompt + {r['output_len']} "
        f"output) tokens, {r['max_running']} running at a time; top-k {r['topk']}, hot buffer "
        f"{r['device_buffer_size']} rows, locality {r['locality']:.2f}",
        f"decode: {r['decode_steps']} steps, {r['resolves']} resolve calls, "
        f"{r['resolved_rows']} rows x {r['topk']} columns",
        f"top-k columns: {r['hits']} hits, {r['misses']} misses (gathered), {r['masked']} "
        f"masked -> hit rate {100 * r['hit_rate']:.1f}%",
        f"bytes moved: host->device {_bytes(r['h2d_bytes'])} (misses), device->host "
        f"{_bytes(r['d2h_bytes'])} (write-through of every new row)",
        f"at {r['link_gbps']:g} GB/s: host->device {_seconds(r['h2d_seconds'])} "
        f"({_seconds(r['h2d_seconds_per_step'])} per decode step), device->host "
        f"{_seconds(r['d2h_seconds'])}",
        f"GPU memory (decode working set, peak): all layers on GPU "
        f"{_bytes(r['all_gpu_peak_bytes'])}, HiSparse {_bytes(r['device_peak_bytes'])} "
        f"+ host {_bytes(r['host_peak_bytes'])} -> {_bytes(r['gpu_bytes_saved'])} of GPU "
        f"memory saved ({100 * r['gpu_saved_fraction']:.0f}%); peak with one-chunk prefills "
        f"{_bytes(r['device_peak_bytes_with_prefill'])}",
    ]
    if r["verified"]:
        lines.append(f"verify: exact ({r['rows_checked']} resolved rows checked against the "
                     f"dense copy, leaders and followers)")
    else:
        lines.append("verify: off")
    lines.append(f"wall time {r['wall_seconds']:.2f} s")
    return "\n".join(lines)


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def run(args: argparse.Namespace) -> int:
    """Entry point of ``hisparse-triton simulate``."""
    import torch

    from hisparse_triton.errors import HiSparseError
    from hisparse_triton.oracle import OracleMismatch

    cpus = available_cpus()
    if args.threads > cpus:  # thousands of OpenMP threads fail to start or crash the process
        raise ValueError(f"--threads {args.threads} exceeds the {cpus} CPUs available to this "
                         f"process.")
    torch.set_num_threads(args.threads)
    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    try:
        report = simulate(
            preset=args.preset, layers=args.layers, requests=args.requests,
            max_running=args.max_running, prompt_len=args.prompt_len,
            output_len=args.output_len, topk=args.topk,
            device_buffer_size=args.device_buffer_size, locality=args.locality,
            offload_threshold_pages=args.offload_threshold_pages,
            host_blocks=args.host_blocks, device_blocks=args.device_blocks, seed=args.seed,
            device=args.device, backend=args.backend, verify=args.verify,
            link_gbps=args.link_gbps, progress=progress)
    except OracleMismatch as exc:
        print(f"hisparse-triton simulate: verify FAILED: {' '.join(str(exc).split())}",
              file=sys.stderr)
        return 1
    except HiSparseError as exc:
        print(f"hisparse-triton simulate: error: {' '.join(str(exc).split())}",
              file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 0
