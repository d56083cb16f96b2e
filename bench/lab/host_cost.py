"""Host (Python) cost of one decode-path resolve: ``ops.resolve`` + ``ops.copy_rows``.

The Triton launches are replaced by counting stand-ins (``lab.launches.record_launches``),
so what is timed is everything the wrappers do on the host besides Triton's own launch call:
argument checks, output / scratch allocation, launch-shape arithmetic, backend dispatch (plus
the stand-in's own call, well under a microsecond). It runs on CPU
tensors (they stand in for CUDA ones; no GPU needed) and reports microseconds per call and
the number of kernel launches one call makes.

    from lab.host_cost import resolve_host_cost
    resolve_host_cost(batch=64, top_k=2048, hot_slots=4096)   # DeepSeek-V3.2 decode shape

Triton's own launch path (binding, specialisation, cache lookup, its Python launcher) is
measured by ``step_cost.launch_path_host_cost`` against the stand-in sm_90 driver;
``bench/host_cost.py`` reports both.
"""

from __future__ import annotations

import inspect
import os
import statistics
import time
from typing import Any

import torch

__all__ = ["resolve_host_cost"]


def _state(batch: int, top_k: int, hot_slots: int, block_size: int) -> dict[str, Any]:
    S, P = batch + 8, 4096 // block_size
    i32 = torch.int32
    return dict(
        topk=torch.zeros(batch, top_k, dtype=i32),
        state_rows=torch.arange(batch, dtype=i32),
        seq_lens=torch.zeros(S, dtype=i32),
        resident_blocks=torch.zeros(S, P, dtype=i32),
        host_blocks=torch.zeros(S, P, dtype=i32),
        hot_blocks=torch.zeros(S, -(-hot_slots // block_size), dtype=i32),
        slot_host_rows=torch.full((S, hot_slots), -1, dtype=i32),
        lru=torch.arange(hot_slots, dtype=i32).repeat(S, 1),
    )


def _tables(layers: int, row_bytes: int, block_size: int):
    from hisparse_triton.row_table import RowTable

    page = block_size * row_bytes
    host = RowTable.build(torch.zeros(4 * layers * page, dtype=torch.uint8),
                          [layer * 4 * page for layer in range(layers)], row_bytes=row_bytes,
                          block_size=block_size, block_stride=page, num_rows=4 * block_size)
    dev = RowTable.build(torch.zeros(4 * layers * page, dtype=torch.uint8),
                         [layer * page for layer in range(layers)], row_bytes=row_bytes,
                         block_size=block_size, block_stride=layers * page,
                         num_rows=4 * block_size)
    return dev, host


def resolve_host_cost(batch: int = 64, top_k: int = 2048, hot_slots: int = 4096, *,
                      layers: int = 1, row_bytes: int = 656, block_size: int = 64,
                      iters: int = 200, repeats: int = 5) -> dict[str, Any]:
    """Host microseconds of one ``ops.resolve`` + ``ops.copy_rows`` (the runtime's
    per-index-group decode call) with the kernel launches stubbed out: the median over
    ``repeats`` runs of ``iters`` calls (and the best run: on a shared machine the median
    moves with the load).

    Uses the reusable-workspace form (``workspace=``, ``out=``, ``counters=``) when
    ``ops.resolve`` has it, as the runtime will. Returns ``{"us_per_call", "best_us",
    "resolve_us", "copy_us", "launches_per_call", "api", shape...}``.
    """
    from hisparse_triton import ops
    from lab.launches import record_launches

    state = _state(batch, top_k, hot_slots, block_size)
    dev, host = _tables(layers, row_bytes, block_size)
    sizes = dict(block_size=block_size, num_device_blocks=1 << 20, num_host_blocks=1 << 20)
    params = inspect.signature(ops.resolve).parameters
    extra: dict[str, Any] = {}
    if "workspace" in params:
        extra = dict(workspace=ops.ResolveWorkspace(torch.device("cpu")),
                     out=torch.empty(batch, top_k, dtype=torch.int32),
                     counters=torch.zeros(3, dtype=torch.int64))
    args = tuple(state.values())

    def resolve():
        return ops.resolve(*args, **sizes, **extra, backend="triton")

    def copy(plan):
        ops.copy_rows(dev, host, plan.miss_src, plan.miss_dst, plan.miss_count,
                      backend="triton")

    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors accepted by the "triton" backend
    try:
        with record_launches(store=False) as launches:
            copy(resolve())  # first use: table checks, workspace sizing, caches
            launches.clear()
            copy(resolve())
            per_call = len(launches)
            totals, resolves, copies = [], [], []
            for _ in range(repeats):
                t_resolve = t_copy = 0.0
                for _ in range(iters):
                    t0 = time.perf_counter()
                    plan = resolve()
                    t1 = time.perf_counter()
                    copy(plan)
                    t2 = time.perf_counter()
                    t_resolve += t1 - t0
                    t_copy += t2 - t1
                launches.clear()
                resolves.append(t_resolve / iters * 1e6)
                copies.append(t_copy / iters * 1e6)
                totals.append((t_resolve + t_copy) / iters * 1e6)
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return {"us_per_call": round(statistics.median(totals), 1),
            "best_us": round(min(totals), 1),
            "resolve_us": round(statistics.median(resolves), 1),
            "copy_us": round(statistics.median(copies), 1),
            "launches_per_call": per_call,
            "api": "workspace" if extra else "allocating",
            "batch": batch, "top_k": top_k, "hot_slots": hot_slots, "layers": layers}

