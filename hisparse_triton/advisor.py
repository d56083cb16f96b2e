"""The sweep behind ``hisparse-triton advise`` (no torch): for a preset and a GPU / host
budget, every ``device_buffer_size`` x KV block size is planned (``hisparse_triton.layout``)
and its miss rate measured on a top-k trace; the setting with the best decode-throughput
estimate is recommended.

Per setting (``H`` hot-buffer rows, ``B`` tokens per block):

- ``miss_rate``: misses / valid top-k columns of the runtime's LRU (``policies``) on the
  trace's streams, in steady state (each stream's first ``warmup`` steps left out), with the
  steady-state residency of a loaded deployment: only the last ``ACTIVE_TAIL_PAGES`` pages
  of ``B`` tokens are on the GPU, every other position goes through the hot buffer;
- ``rows_per_step`` = ``miss_rate x top_k x index_groups`` per request, and
  ``bytes_per_step`` = ``miss_rate x top_k x sparse_layers x row_bytes`` (a miss is gathered
  into the leader and every follower);
- ``gpu_bytes_per_request`` and ``concurrency``: the planner's steady state at
  ``context_len`` tokens per request (``get_hisparse_concurrency``);
- ``batch = floor(min(concurrency, max_batch))``, ``link_s = batch x bytes_per_step /
  link_bytes_per_s``, ``tokens_per_s = batch / (step_s + link_s)``: a decode step of
  ``step_s`` seconds of compute plus the step's gathers, not overlapped (pessimistic).

The recommendation is the highest ``tokens_per_s``; estimates within 0.5% of it count as a
tie, won by the least GPU memory per request (``recommend``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from hisparse_triton.config import ACTIVE_TAIL_PAGES, GIB, EngineConfig, HiSparseConfig
from hisparse_triton.presets import build_kv_cache_spec, get_preset
from hisparse_triton.specs import cdiv

#: Swept by default: hot-buffer rows (x top-k) and KV block sizes (tokens).
DEFAULT_BUFFER_FACTORS = (1, 2, 4, 8)
DEFAULT_BLOCK_SIZES = (16, 32, 64)
#: Throughput estimates this close (relative) count as a tie in ``recommend``.
RECOMMEND_TOLERANCE = 0.005
THROUGHPUT_FORMULA = ("tokens/s = batch / (step_s + batch x bytes_per_step / link_Bps), "
                      "batch = floor(min(steady-state concurrency, max_batch))")


@dataclass(frozen=True)
class AdviseSettings:
    """One sweep (see the module docstring)."""

    preset: str = "deepseek-v3.2-fp8"
    gpu_memory_gib: float = 80.0
    host_pool_gib: float = 256.0
    context_len: Optional[int] = None
    buffers: Optional[tuple[int, ...]] = None
    block_sizes: tuple[int, ...] = DEFAULT_BLOCK_SIZES
    top_k: Optional[int] = None
    link_gbps: float = 50.0
    link_source: str = "given"
    step_ms: float = 40.0
    max_batch: Optional[int] = None
    trace: Optional[str] = None
    streams: int = 4
    steps: int = 96
    warmup: int = 24
    seed: int = 0
    link_by_rows: Optional[Callable[[int], float]] = field(default=None, compare=False)


def trace_streams(settings: AdviseSettings, top_k: int, context_len: int
                  ) -> tuple[list[tuple[list[np.ndarray], list[int]]], str]:
    """``[(selections, seq_lens)]`` per stream, and where they came from."""
    if settings.trace is not None:
        from hisparse_triton.trace import load_trace

        trace = load_trace(settings.trace)
        if trace.top_k != top_k:
            raise ValueError(f"the trace's top-k {trace.top_k} differs from {top_k}.")
        out = []
        for (request, _layer), rows in trace.streams().items():
            seqs = [int(s) for s in trace.seq_len[trace.request == request]]
            out.append((rows, seqs))
        return out, f"recorded trace {settings.trace}"
    from hisparse_triton.workload import CalibratedTrace, stream_selections

    history = max(top_k + 1, context_len - settings.steps)
    gen = CalibratedTrace(top_k, seed=settings.seed)
    out = []
    for i in range(settings.streams):
        rows = stream_selections(gen, history=history, steps=settings.steps, key=(i, 0))
        out.append((rows, [history + j + 1 for j in range(settings.steps)]))
        gen.forget(i)
    return out, f"calibrated synthetic trace ({settings.streams} streams x {settings.steps} " \
                f"steps at a {history}-token history)"


def steady_miss_rate(streams: Sequence[tuple[list[np.ndarray], list[int]]], capacity: int,
                     block_size: int, warmup: int) -> float:
    """LRU misses / valid columns after ``warmup`` steps, the last ``ACTIVE_TAIL_PAGES``
    pages of ``block_size`` tokens resident (see the module docstring)."""
    from hisparse_triton.policies import step_keys, stream_misses

    misses = columns = 0
    for rows, seqs in streams:
        through = []
        for row, seq in zip(rows, seqs):
            keys = step_keys(row[(row >= 0) & (row < seq)])
            tail = (cdiv(seq, block_size) - ACTIVE_TAIL_PAGES) * block_size
            through.append(keys[keys < tail])
        skip = min(warmup, max(0, len(rows) - 1))
        misses += int(stream_misses("lru", through, capacity, distinct=True)[skip:].sum())
        columns += sum(step_keys(row[(row >= 0) & (row < seq)]).size
                       for row, seq in list(zip(rows, seqs))[skip:])
    return misses / columns if columns else 0.0


def plan_setting(geometry: Any, *, block_size: int, buffer: int, top_k: int,
                 context_len: int, gpu_bytes: int, host_gib: float) -> dict[str, Any]:
    """The planner's figures for one setting (``ValueError`` when it does not fit)."""
    from hisparse_triton.layout import (
        get_all_gpu_baseline_concurrency, get_hisparse_concurrency,
        get_hisparse_kv_cache_config, get_hisparse_kv_cache_groups)

    spec = build_kv_cache_spec(geometry, block_size=block_size)
    hisparse = HiSparseConfig(index_topk=top_k, device_buffer_size=buffer,
                              host_pool_gib=host_gib)
    config = EngineConfig(max_model_len=context_len, hisparse=hisparse)
    groups = get_hisparse_kv_cache_groups(config, spec)
    kv = get_hisparse_kv_cache_config(config, groups, gpu_bytes, hisparse.host_pool_bytes)
    conc = get_hisparse_concurrency(config, kv)
    return {"concurrency": conc.steady_state, "limited_by": conc.limited_by,
            "gpu_bytes_per_request": conc.steady_blocks * kv.bytes_per_block,
            "bytes_per_block": kv.bytes_per_block, "num_gpu_blocks": kv.num_blocks,
            "baseline_concurrency": get_all_gpu_baseline_concurrency(config, spec, gpu_bytes)}


def run_advise(settings: AdviseSettings,
               on_setting: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """The sweep and its recommendation, as the JSON payload of ``advise``."""
    geometry = get_preset(settings.preset)
    top_k = settings.top_k or geometry.index_topk
    context = settings.context_len or min(16 * top_k, geometry.max_model_len)
    if context > geometry.max_model_len:
        raise ValueError(f"--context-len {context} exceeds the {settings.preset} preset's "
                         f"max context of {geometry.max_model_len}.")
    if context <= top_k:
        raise ValueError(f"--context-len {context} is not longer than top-k {top_k}: every "
                         f"step would select the whole history and nothing could miss.")
    buffers = settings.buffers or tuple(f * top_k for f in DEFAULT_BUFFER_FACTORS)
    small = [b for b in buffers if b < top_k]
    if small:
        raise ValueError(f"--buffers {small[0]} is smaller than top-k {top_k}: one step's "
                         f"top-k must fit the hot buffer.")
    streams, source = trace_streams(settings, top_k, context)
    gpu_bytes = int(settings.gpu_memory_gib * GIB)
    rows_out = []
    for block in settings.block_sizes:
        for buffer in buffers:
            label = f"B={block} H={buffer}"
            row: dict[str, Any] = {"block_size": block, "device_buffer_size": buffer}
            try:
                row.update(plan_setting(geometry, block_size=block, buffer=buffer, top_k=top_k,
                                        context_len=context, gpu_bytes=gpu_bytes,
                                        host_gib=settings.host_pool_gib))
            except ValueError as exc:
                row["error"] = " ".join(str(exc).split())
                rows_out.append(row)
                if on_setting is not None:
                    on_setting(label)
                continue
            miss = steady_miss_rate(streams, buffer, block, settings.warmup)
            rows_step = miss * top_k * geometry.num_indexer_layers
            bytes_step = miss * top_k * geometry.num_layers * geometry.mla_row_bytes
            cap = row["concurrency"] if settings.max_batch is None else \
                min(row["concurrency"], settings.max_batch)
            batch = max(0, math.floor(cap))
            gbps = settings.link_gbps
            if settings.link_by_rows is not None and batch:
                gbps = settings.link_by_rows(max(1, round(miss * top_k * batch)))
            link_s = batch * bytes_step / (gbps * 1e9) if batch else 0.0
            step_s = settings.step_ms / 1e3
            row.update({
                "miss_rate": miss, "hit_rate": 1.0 - miss,
                "rows_per_step": rows_step, "bytes_per_step": bytes_step,
                "batch": batch, "batch_rows_per_step": rows_step * batch,
                "batch_bytes_per_step": bytes_step * batch, "link_gbps": gbps,
                "link_ms_per_step": link_s * 1e3,
                "tokens_per_s": batch / (step_s + link_s) if batch else 0.0,
            })
            rows_out.append(row)
            if on_setting is not None:
                on_setting(label)
    ok = [r for r in rows_out if "error" not in r and r["batch"] > 0]
    best = recommend(ok)
    return {
        "preset": geometry.name, "top_k": top_k, "context_len": context,
        "gpu_memory_gib": settings.gpu_memory_gib, "host_pool_gib": settings.host_pool_gib,
        "sparse_layers": geometry.num_layers, "index_groups": geometry.num_indexer_layers,
        "row_bytes": geometry.mla_row_bytes, "step_ms": settings.step_ms,
        "max_batch": settings.max_batch, "link_gbps": settings.link_gbps,
        "link_source": settings.link_source, "trace": source,
        "warmup_steps": settings.warmup, "formula": THROUGHPUT_FORMULA,
        "settings": rows_out,
        "recommended": None if best is None else {
            "block_size": best["block_size"], "device_buffer_size": best["device_buffer_size"],
            "tokens_per_s": best["tokens_per_s"], "batch": best["batch"],
            "miss_rate": best["miss_rate"]},
    }


def recommend(rows: Sequence[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The setting with the best ``tokens_per_s``; settings within ``RECOMMEND_TOLERANCE`` of
    it count as equal, and the one with the least GPU memory per request (then the smaller
    buffer) wins among them."""
    if not rows:
        return None
    top = max(r["tokens_per_s"] for r in rows)
    near = [r for r in rows if r["tokens_per_s"] >= top * (1 - RECOMMEND_TOLERANCE)]
    return min(near, key=lambda r: (r["gpu_bytes_per_request"], r["device_buffer_size"]))


# ----------------------------------------------------------------- link speed from bench
def link_from_bench(result: dict[str, Any], row_bytes: int) -> tuple[Callable[[int], float],
                                                                     str]:
    """A GB/s lookup by rows gathered per launch, from a ``bench`` (or ``gpu_check``) JSON
    result: the verified ``gather`` figures of the row size nearest ``row_bytes``, the best
    method available (``triton_graph``, ``triton``, ``contiguous``, ``torch``, ``eager``);
    rows between two measured sizes take the nearer one (log scale)."""
    bench = result.get("bench", result)
    figs = [f for f in bench.get("transfers", []) if f.get("op") == "gather"
            and f.get("gbps") and f.get("verified", True) is not False]
    if not figs:
        raise ValueError("the bench result has no gather figures to take a link speed from.")
    size = min({f["row_bytes"] for f in figs}, key=lambda r: abs(math.log(r / row_bytes)))
    figs = [f for f in figs if f["row_bytes"] == size]
    for method in ("triton_graph", "triton", "contiguous", "torch", "eager"):
        chosen = [f for f in figs if f.get("method") == method]
        if chosen:
            break
    points: dict[int, float] = {}
    for f in chosen:  # the best figure of every size (layers, miss ratios)
        points[f["rows"]] = max(points.get(f["rows"], 0.0), float(f["gbps"]))
    sizes = sorted(points)

    def lookup(rows: int) -> float:
        nearest = min(sizes, key=lambda r: abs(math.log(r / max(rows, 1))))
        return points[nearest]

    where = result.get("environment", {}).get("gpu") or bench.get("device", "?")
    return lookup, (f"bench gather figures ({method}, {size} B rows, "
                    f"{len(sizes)} sizes) measured on {where}")


__all__ = ["AdviseSettings", "DEFAULT_BLOCK_SIZES", "DEFAULT_BUFFER_FACTORS",
           "RECOMMEND_TOLERANCE", "THROUGHPUT_FORMULA", "link_from_bench", "plan_setting",
           "recommend", "run_advise", "steady_miss_rate", "trace_streams"]
