"""``hisparse-triton metrics``: a demo workload through the real runtime, its live metrics
and verdict, served to Prometheus (``--serve PORT``).

The workload is ``simulate``'s (``hisparse_triton.simulation``; the ``tiny`` preset by
default, seconds on a CPU); a ``hisparse_triton.metrics.HiSparseMetrics`` samples the
runtime's counters after every decode step without a host sync. With ``--serve PORT`` a
``MetricsServer`` answers ``/metrics`` (Prometheus text format) and ``/verdict`` (one line)
from before the first request until ``--duration`` seconds after the workload finished, or
until interrupted (SIGINT or SIGTERM: a clean stop, exit status 0). Without ``--serve`` the
command prints the last scrape and exits. The ``metrics`` extra (``prometheus_client``) is
needed for both. Imports torch only in ``run``.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import threading
import time
from typing import Any, Optional

from hisparse_triton.commands.argtypes import bounded_int, bounded_number
from hisparse_triton.commands.flags import add_progress_flag, add_seed_flag, set_torch_threads
from hisparse_triton.commands.output import (
    add_json_flag,
    json_document,
    report_stream,
    write_json,
)
from hisparse_triton.commands.simulate import (
    add_runtime_flags,
    add_shape_flags,
    add_verify_flag,
    add_watermark_flag,
)
from hisparse_triton.commands.verdict_flags import add_verdict_flags, verdict_settings
from hisparse_triton.presets import list_presets

#: ``schema_version`` of ``metrics --json``.
SCHEMA_VERSION = 1
#: The demo's preset unless ``--preset`` says otherwise.
DEMO_PRESET = "tiny"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``metrics`` and its flags."""
    parser = subparsers.add_parser(
        "metrics", help="serve a demo workload's live metrics and verdict to Prometheus",
        description="Run a demo decode workload through the real HiSparse runtime (simulate's, "
                    "the tiny preset by default) and export its live counters (hits, misses, "
                    "rows and bytes each way, pool use, offloaded requests, per index group "
                    "miss rates, device step timings on a GPU) with the live verdict: the "
                    "advise model fed with the observed miss rate. --serve PORT serves "
                    "/metrics and /verdict over HTTP; without it the last scrape is printed. "
                    "Needs prometheus_client (pip install 'hisparse-triton[metrics]').")
    parser.add_argument("--serve", metavar="PORT", type=bounded_int(0, 65535), default=None,
                        help="serve /metrics and /verdict on PORT (0: a free port, printed) "
                             "while the workload runs and after it (default: print the last "
                             "scrape and exit)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to serve on (default 127.0.0.1: this machine only)")
    parser.add_argument("--duration", metavar="S", type=bounded_number(0, 1e7, " s"),
                        default=None,
                        help="with --serve: keep serving S seconds after the workload "
                             "finished, then exit (default: until interrupted)")
    parser.add_argument("--preset", default=DEMO_PRESET, choices=list_presets(),
                        help=f"model geometry of the demo (default {DEMO_PRESET}: seconds on "
                             f"a CPU)")
    work = parser.add_argument_group("demo workload (simulate's flags and defaults)")
    add_shape_flags(work)
    add_watermark_flag(work)
    work.add_argument("--warmup-steps", type=bounded_int(0, 1 << 20), default=None,
                      metavar="N", help="decode steps left out of the verdict's window "
                                        "(default: the first quarter)")
    add_seed_flag(work, what="the trace and the KV bytes")
    add_runtime_flags(work)
    add_verify_flag(work)
    judge = parser.add_argument_group("live verdict (advise's model inputs)")
    add_verdict_flags(judge, link_flag=True)
    add_progress_flag(parser)
    add_json_flag(parser, "the run, its last sample and the verdict")
    return parser


def _settings(args: argparse.Namespace) -> Any:
    from hisparse_triton.link import DEFAULT_LINK_GBPS, DEFAULT_LINK_SOURCE
    from hisparse_triton.simulation import SimSettings

    if args.duration is not None and args.serve is None:
        raise ValueError("--duration applies to --serve.")
    return SimSettings(
        preset=args.preset, requests=args.requests, max_running=args.max_running,
        prompt_len=args.prompt_len, output_len=args.output_len, top_k=args.top_k,
        device_buffer_size=args.device_buffer_size,
        free_block_watermark=args.free_block_watermark, seed=args.seed, device=args.device,
        backend=args.backend, verify=args.verify, policies=(), warmup_steps=args.warmup_steps,
        link_gbps=args.link_gbps or DEFAULT_LINK_GBPS,
        link_source="given" if args.link_gbps is not None else DEFAULT_LINK_SOURCE,
        verdict=verdict_settings(args, args.preset, args.link_gbps))


def sample_dict(sample: Any) -> Optional[dict[str, Any]]:
    """A ``MetricsSample`` as JSON-ready values (None for None)."""
    import dataclasses

    if sample is None:
        return None
    return {"index": sample.index, "worker": dataclasses.asdict(sample.worker),
            "scheduler": (dataclasses.asdict(sample.scheduler)
                          if sample.scheduler is not None else None),
            "groups": [dataclasses.asdict(g) for g in sample.groups],
            "h2d_rows": sample.h2d_rows, "d2h_rows": sample.d2h_rows,
            "steps": dataclasses.asdict(sample.steps)}


def _short(layer: str) -> str:
    """``model.layers.12.self_attn.attn`` -> ``layer 12`` (other names as they are)."""
    match = re.search(r"layers\.(\d+)\.", layer)
    return f"layer {match.group(1)}" if match else layer


def format_summary(report: dict[str, Any], metrics: Any) -> str:
    """The human-readable end of a run: the counters of the last sample and the verdict."""
    last = metrics.latest()
    observed = metrics.observation()
    w, st = last.worker, last.scheduler
    steps = last.steps
    timing = (f"{steps.count} decode steps timed on the device, "
              f"{1e3 * steps.seconds / max(steps.count, 1):.2f} ms each on average"
              if steps.available else steps.reason)
    return "\n".join([
        f"hisparse-triton metrics: {report['preset']} demo: {report['requests']} requests, "
        f"{report['decode_steps']} decode steps, device {report['device']}, "
        f"{report['wall_seconds']:.2f} s",
        f"counters: {w.hits} hits, {w.misses} misses, {w.masked} masked; host->device "
        f"{last.h2d_rows} rows ({w.h2d_bytes} B), device->host {last.d2h_rows} rows "
        f"({w.d2h_bytes} B); host pool {st.host_blocks}/{st.host_blocks_total} blocks, "
        f"{st.offloaded_requests} requests offloaded now",
        f"window: miss rate {100 * observed.miss_rate:.1f}% over {observed.columns} top-k "
        f"columns ({'since the start' if observed.since_start else f'{observed.samples} samples'}"
        f"); per index group "
        + ", ".join(f"{_short(leader)} {100 * rate:.1f}%"
                    for leader, rate in metrics.group_miss_rates().items()),
        f"step timing: {timing}",
        metrics.verdict_text(),
    ])


def run(args: argparse.Namespace) -> int:
    """Entry point of ``hisparse-triton metrics``."""
    from hisparse_triton.metrics.prometheus import require_prometheus

    try:
        prom = require_prometheus()
    except ImportError as exc:
        raise ValueError(str(exc)) from None
    settings = _settings(args)
    set_torch_threads(args.threads)
    from hisparse_triton.benchmarks.progress import Progress, default_enabled
    from hisparse_triton.metrics.server import MetricsServer
    from hisparse_triton.simulation import run_simulation

    out = report_stream(args.json)
    held: dict[str, Any] = {}
    bar: list[Any] = []

    def on_metrics(metrics: Any) -> None:
        held["metrics"] = metrics
        if args.serve is not None:
            held["server"] = server = MetricsServer(metrics, host=args.host, port=args.serve)
            print(f"hisparse-triton metrics: serving {server.url} (and /verdict)",
                  file=sys.stderr, flush=True)

    def on_step(done: int, total: int) -> None:
        if not bar:
            bar.append(Progress(total, "metrics", enabled=default_enabled(args.progress)))
        bar[0].step()

    try:
        try:
            report = run_simulation(settings, on_step=on_step, on_metrics=on_metrics)
        finally:
            if bar:
                bar[0].close()
        metrics = held["metrics"]
        server = held.get("server")
        print(format_summary(report, metrics), file=out, flush=True)
        if server is None:  # the scrape it would have served
            registry = prom.CollectorRegistry()
            registry.register(metrics.collector())
            print(prom.generate_latest(registry).decode().rstrip(), file=out)
        if args.json:
            observed = metrics.observation()
            write_json(json_document("metrics", SCHEMA_VERSION, {
                "preset": report["preset"], "url": server.url if server else None,
                "report": report, "sample": sample_dict(metrics.latest()),
                "observed": {"hits": observed.hits, "misses": observed.misses,
                             "miss_rate": observed.miss_rate},
                "group_miss_rates": metrics.group_miss_rates(),
                "verdict": report.get("verdict")}), args.json)
        if server is not None:
            until = ("until interrupted" if args.duration is None else
                     f"for {args.duration:g} s")
            # From here an interrupt (SIGINT, SIGTERM) only ends the wait: a KeyboardInterrupt
            # raised wherever the main thread happens to be could skip the clean stop.
            with _StopOnSignal() as stop:
                print(f"hisparse-triton metrics: workload done; serving {server.url} {until}",
                      file=sys.stderr, flush=True)
                if stop.wait(args.duration):
                    print("hisparse-triton metrics: stopped", file=sys.stderr, flush=True)
    finally:
        if held.get("server") is not None:
            held["server"].close()
    return 0


class _StopOnSignal:
    """While entered, SIGINT and SIGTERM set an event instead of raising: ``wait(duration)``
    sleeps ``duration`` seconds or until one arrives (None: until one arrives) and says
    whether one did. The previous handlers come back on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._previous: dict = {}

    def __enter__(self) -> "_StopOnSignal":
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, lambda *_: self._stop.set())
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def wait(self, duration: Optional[float]) -> bool:
        end = None if duration is None else time.monotonic() + duration
        while not self._stop.is_set():
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return False
            # Short waits: the handler runs on the main thread between them.
            self._stop.wait(0.2 if left is None else min(0.2, left))
        return True
