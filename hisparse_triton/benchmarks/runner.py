"""``run_bench``: one sweep, in order (transfers per row size and layer count, then resolve),
into the JSON result ``hisparse-triton bench`` writes."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any, Callable, Iterable, Optional

import torch

from hisparse_triton.benchmarks.environment import environment
from hisparse_triton.benchmarks.figures import Figure
from hisparse_triton.benchmarks.noise import CpuProbe, judge_result, machine_load
from hisparse_triton.benchmarks.progress import Progress
from hisparse_triton.benchmarks.resolve import ResolveBench
from hisparse_triton.benchmarks.registry import PAGE_OPS, ROW_OPS, TRANSFER_OPS
from hisparse_triton.benchmarks.settings import (
    BASELINES,
    BLOCK_SIZE,
    KERNEL_METHODS,
    KERNELS_NEED_GPU,
    SCHEMA,
    VERSION,
    BenchSettings,
)
from hisparse_triton.benchmarks.targets import evaluate_targets
from hisparse_triton.benchmarks.transfers import TransferBench


def count_steps(settings: BenchSettings, device: torch.device) -> int:
    """Progress steps of ``run_bench`` (one per method and case; graph replays ride along)."""
    methods = [m for m in settings.methods if device.type == "cuda" or m != "triton"]
    kernels = len([m for m in methods if m in KERNEL_METHODS])
    baselines = len([m for m in methods if m in BASELINES])
    n = 0
    for rows in settings.rows:
        for op in settings.ops:
            if op not in TRANSFER_OPS or (op in PAGE_OPS and rows < BLOCK_SIZE):
                continue
            ratios = len(settings.miss_ratios) if op in ROW_OPS else 1
            n += ratios * kernels + baselines
    n *= len(settings.row_bytes) * len(settings.layers)
    if "resolve" in settings.ops:
        n += len(settings.batch) * len(settings.miss_ratios) * kernels
    return n


def _result(settings: BenchSettings, device: torch.device, env: dict[str, Any],
            started: float, transfers: list[Figure], resolves: list[Figure],
            interrupted: bool, finished: bool, probe: Optional[CpuProbe] = None,
            load_start: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    notes = []
    if device.type != "cuda":
        notes.append(KERNELS_NEED_GPU)
    if interrupted:
        notes.append("interrupted: the sweep stopped early, these are the figures measured "
                     "before")
    elif not finished:
        notes.append("in progress: a checkpoint of the figures measured so far")
    result = {
        "schema": SCHEMA,
        "schema_version": VERSION,
        "device": str(device),
        "kernel_timings": device.type == "cuda" and "triton" in settings.methods,
        "interrupted": interrupted,
        "finished": finished,
        "notes": notes,
        "environment": env,
        "settings": {k: list(v) if isinstance(v, tuple) else v
                     for k, v in asdict(settings).items()},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "wall_s": round(time.time() - started, 3),
        "transfers": [f.to_json() for f in transfers],
        "resolve": [f.to_json() for f in resolves],
    }
    judge_result(result, probe, load_start if load_start is not None else machine_load())
    result["targets"] = evaluate_targets(result)
    return result


def run_bench(settings: BenchSettings, device: Optional[torch.device] = None, *,
              progress: Optional[Progress] = None,
              checkpoint: Optional[Callable[[dict[str, Any]], None]] = None) -> dict[str, Any]:
    """Run the sweep on ``device`` (default: CUDA when present, else CPU); the JSON result.

    ``checkpoint(partial_result)`` is called after every case (``finished: false``), so a
    caller can write what was measured before a crash or a kill. Ctrl-C stops the sweep and
    returns what was measured (``interrupted: true``)."""
    settings.validate()
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    step = progress.step if progress is not None else None
    env = environment()
    started = time.time()
    load_start = machine_load()
    probe = CpuProbe()
    probe.calibrate()
    transfers: list[Figure] = []
    resolves: list[Figure] = []

    def save() -> None:
        if checkpoint is not None:
            checkpoint(_result(settings, device, env, started, transfers, resolves,
                               interrupted=False, finished=False, probe=probe,
                               load_start=load_start))

    interrupted = False
    try:
        if any(op in TRANSFER_OPS for op in settings.ops):
            bench = TransferBench(settings, device, step, probe=probe)
            for row_bytes in settings.row_bytes:
                for layers in settings.layers:
                    bench.group(row_bytes, layers, transfers, on_case=save)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            del bench
        if "resolve" in settings.ops:
            rbench = ResolveBench(settings, device, step, probe=probe)
            for batch in settings.batch:
                for ratio in settings.miss_ratios:
                    resolves += rbench.case(batch, ratio)
                    save()
    except KeyboardInterrupt:
        interrupted = True  # keep what was measured
    return _result(settings, device, env, started, transfers, resolves, interrupted,
                   finished=not interrupted, probe=probe, load_start=load_start)


def iter_figures(result: dict[str, Any]) -> Iterable[dict[str, Any]]:
    """Every figure record of a result (transfers, then resolve)."""
    yield from result.get("transfers", [])
    yield from result.get("resolve", [])
