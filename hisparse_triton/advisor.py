"""The sweep behind ``hisparse-triton advise`` (no torch): for a preset and a GPU / host
budget, every ``device_buffer_size`` x KV block size is planned (``hisparse_triton.layout``)
and its miss rate measured on a top-k trace; each is compared with keeping every layer on the
GPU (the all-GPU row), and the best is recommended.

Per setting (``H`` hot-buffer rows, ``B`` tokens per block, ``Q`` query tokens per decode
step, 1 without speculative decoding):

- ``miss_rate``: misses / valid top-k columns of the runtime's LRU (``policies``) on the
  trace's streams, in steady state (each stream's first ``warmup`` steps left out), with the
  steady-state residency of a loaded deployment: only the last ``ACTIVE_TAIL_PAGES`` pages
  of ``B`` tokens are on the GPU, every other position goes through the hot buffer; with
  ``Q > 1`` a step's ``Q`` selections are looked up as one union (a position several query
  tokens select is one lookup, as the runtime resolves them);
- ``rows_per_step`` = ``miss_rate x Q x top_k x index_groups`` per request, and
  ``bytes_per_step`` = ``miss_rate x Q x top_k x sparse_layers x row_bytes`` (a miss is
  gathered into the leader and every follower);
- ``gpu_bytes_per_request`` and ``concurrency``: the planner's steady state at
  ``context_len`` tokens per request (``get_hisparse_concurrency``);
- ``batch = floor(min(concurrency, max_batch))``, ``compute_s = step(batch)`` (the step
  model: decode time without transfers as a function of the batch), ``link_s = batch x
  bytes_per_step / link_bytes_per_s``, ``step_s = compute_s + link_s - min(overlap x link_s,
  compute_s)`` (``overlap``: the share of the gathers hidden under compute; 0 = none, the
  pessimistic default; 1 = all of it that fits), ``tokens_per_s = Q x batch / step_s``.

With ``tp_split = N`` tensor-parallel ranks splitting the gather (``HiSparseWorker(
split_gather=True)``), ``link_s`` is per rank: 1/N of the missed rows over its own host link
and the exchange of the other ranks' shares at ``exchange_gbps``, pipelined in
``split_chunks`` chunks (``SPLIT_FORMULA``; it assumes each GPU has its own host link). The
exchange carries a capacity fraction of the columns: by default (``split_fraction=None``,
the worker's ``"auto"``) the capacity rule of ``worker.split_capacity`` at the setting's
miss rate (the miss rate plus a 25% headroom, rounded up to a level), which is also the
fraction recommended for ``split_gather_fraction``.

The all-GPU row keeps every layer's whole history on the GPU (``get_all_gpu_baseline_
concurrency``): ``tokens_per_s = Q x batch / step(batch)``, no transfers. The crossover is the
smallest number of concurrent requests at which the recommended HiSparse setting decodes
faster than all-GPU can (all-GPU runs ``min(demand, its batch)``); below it, all-GPU wins.

Miss rates come from a ``MissCurve``: by default ``TraceMissCurve`` (the LRU replayed on the
trace, as above); a running deployment passes ``ObservedMissCurve`` (the miss rate its live
counters observed at its own setting, carried to the other settings along the calibrated
trace's curve: ``hisparse_triton.metrics``' live verdict). Every other formula is the same.

The recommendation is the highest ``tokens_per_s`` among the settings whose block size the
preset's attention kernel supports (``ATTENTION_KERNELS``); estimates within 0.5% of it count
as a tie, won by the least GPU memory per request (``recommend``). When the all-GPU row is as
fast (within the same 0.5%), all-GPU is recommended instead: HiSparse only pays when memory
limits the batch.
"""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np

from hisparse_triton.config import (
    ACTIVE_TAIL_PAGES, GIB, MAX_DEVICE_BUFFER_SIZE, EngineConfig, HiSparseConfig)
from hisparse_triton.link import DEFAULT_LINK_GBPS
from hisparse_triton.presets import ModelGeometry, build_kv_cache_spec, get_preset
from hisparse_triton.specs import cdiv
from hisparse_triton.worker.split_capacity import (SPLIT_CHUNKS, SPLIT_HEADROOM,
                                                   capacity_fraction, capacity_rows)

#: Swept by default: hot-buffer rows (x Q x top-k) and KV block sizes (tokens) of a preset
#: whose attention kernel takes any block size.
DEFAULT_BUFFER_FACTORS = (1, 2, 4, 8)
DEFAULT_BLOCK_SIZES = (16, 32, 64)
#: The attention kernel each preset's model decodes with, and the KV block sizes (tokens per
#: page) it accepts. The sparse MLA decode kernels of DeepSeek-V3.2 and GLM-5 (FlashMLA
#: sparse) read pages of 64 tokens only. A preset not listed takes any block size.
ATTENTION_KERNELS: dict[str, tuple[str, tuple[int, ...]]] = {
    "deepseek-v3.2-fp8": ("FlashMLA sparse", (64,)),
    "deepseek-v3.2-bf16": ("FlashMLA sparse", (64,)),
    "glm-5": ("FlashMLA sparse", (64,)),
    "glm-5-indexshare": ("FlashMLA sparse", (64,)),
}
#: Throughput estimates this close (relative) count as a tie in ``recommend``.
RECOMMEND_TOLERANCE = 0.005
#: The default step model: (batch, ms) points of a decode step without transfers. An
#: assumption, not a measurement: pass your engine's figures (``--step-ms``).
DEFAULT_STEP_POINTS: tuple[tuple[float, float], ...] = ((1, 25.0), (256, 50.0))
#: GPU <-> GPU speed of the split gather's exchange (NCCL all_gather bus bandwidth per GPU,
#: GB/s): an assumption for NVLink 4 (H100 / H200 SXM: 450 GB/s per direction, about 80%
#: of it reached by all_gather). Measure yours (``nccl-tests``) and pass ``--exchange-gbps``.
DEFAULT_EXCHANGE_GBPS = 360.0

THROUGHPUT_FORMULA = ("tokens/s = Q x batch / step_s, step_s = compute_s + link_s - "
                      "min(overlap x link_s, compute_s), compute_s = step(batch), link_s = "
                      "batch x bytes_per_step / link_Bps, batch = floor(min(steady-state "
                      "concurrency, max_batch))")


@dataclass(frozen=True)
class StepModel:
    """Decode-step time without transfers as a function of the batch: ``points`` of
    ``(batch, ms)``, linear between them and beyond the ends along the nearest segment; one
    point is a constant. ``source``: ``"given"`` or why these points."""

    points: tuple[tuple[float, float], ...] = DEFAULT_STEP_POINTS
    source: str = "default"

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a step model needs at least one (batch, ms) point.")
        batches = [b for b, _ in self.points]
        if len(set(batches)) != len(batches):
            raise ValueError(f"the step model names batch {batches} more than once.")
        if any(b < 1 or ms <= 0 for b, ms in self.points):
            raise ValueError(f"step model points must be batch >= 1 and ms > 0, got "
                             f"{list(self.points)}.")
        object.__setattr__(self, "points", tuple(sorted(self.points)))

    def ms(self, batch: float) -> float:
        """Milliseconds of one decode step of ``batch`` requests (at least 1 us)."""
        pts = self.points
        if len(pts) == 1:
            return pts[0][1]
        i = 0
        while i < len(pts) - 2 and batch > pts[i + 1][0]:
            i += 1
        (b0, m0), (b1, m1) = pts[i], pts[i + 1]
        return max(1e-3, m0 + (m1 - m0) * (batch - b0) / (b1 - b0))

    def describe(self) -> str:
        if len(self.points) == 1:
            return f"{self.points[0][1]:g} ms at any batch"
        text = ", ".join(f"{ms:g} ms at batch {b:g}" for b, ms in self.points)
        return f"{text}, linear in between"


@dataclass(frozen=True)
class AdviseSettings:
    """One sweep (see the module docstring). ``block_sizes=None``: the sizes the preset's
    attention kernel supports (``ATTENTION_KERNELS``), else ``DEFAULT_BLOCK_SIZES``."""

    preset: str = "deepseek-v3.2-fp8"
    gpu_memory_gib: float = 80.0
    host_pool_gib: float = 256.0
    context_len: Optional[int] = None
    buffers: Optional[tuple[int, ...]] = None
    block_sizes: Optional[tuple[int, ...]] = None
    top_k: Optional[int] = None
    link_gbps: float = DEFAULT_LINK_GBPS
    link_source: str = "given"
    step: StepModel = StepModel()
    overlap: float = 0.0
    mtp: int = 1
    max_batch: Optional[int] = None
    trace: Optional[str] = None
    streams: int = 4
    steps: int = 96
    warmup: int = 24
    seed: int = 0
    link_by_rows: Optional[Callable[[int], float]] = field(default=None, compare=False)
    tp_split: int = 1
    exchange_gbps: float = DEFAULT_EXCHANGE_GBPS
    split_fraction: Optional[float] = None
    split_chunks: int = SPLIT_CHUNKS


SPLIT_FORMULA = ("with N TP ranks splitting (worker split_gather): m = miss x Q x top_k "
                 "columns per index group, f = the capacity fraction (auto: the smallest "
                 "level >= miss x 1.25), C = ceil(f x Q x top_k / N); per rank PCIe bytes = "
                 "(min(m, N x C) / N + max(0, m - N x C)) x layers x row_bytes, exchange "
                 "bytes received = (N - 1) x C x layers x row_bytes (fixed shapes), pcie_s = "
                 "batch x PCIe bytes / link_Bps, exchange_s = batch x exchange bytes / "
                 "exchange_Bps, link_s = max(pcie_s, exchange_s) + min(pcie_s, exchange_s) / "
                 "chunks (the pull of a chunk runs while the previous one is exchanged); "
                 "assumes every GPU has its own host link (a PCIe switch shared by two GPUs "
                 "halves the gain) and a batch's misses pooled over its rows (past N x C "
                 "every rank pulls the rest itself)")


def split_bytes(miss_columns: float, columns: int, bytes_per_column: float, ranks: int,
                fraction: float) -> tuple[float, float]:
    """``(pcie_bytes, exchange_bytes)`` per rank and request of one step with ``ranks``
    tensor-parallel ranks splitting the gather (``SPLIT_FORMULA``): ``miss_columns`` missed
    columns of ``columns`` per index group, ``bytes_per_column`` over all layers. With one
    rank: everything over PCIe, no exchange."""
    if ranks <= 1:
        return miss_columns * bytes_per_column, 0.0
    cap = capacity_rows(1, columns, ranks, fraction)
    split = min(miss_columns, ranks * cap)
    pcie = (split / ranks + max(0.0, miss_columns - ranks * cap)) * bytes_per_column
    return pcie, (ranks - 1) * cap * bytes_per_column


def split_fraction(settings: AdviseSettings, miss_rate: float) -> float:
    """The split gather's capacity fraction at ``miss_rate``: ``settings.split_fraction``
    when given, else the worker's ``"auto"`` rule (``split_capacity.capacity_fraction``)."""
    if settings.split_fraction is not None:
        return settings.split_fraction
    return capacity_fraction(miss_rate)


def default_buffers(mtp: int, top_k: int) -> tuple[int, ...]:
    """The hot-buffer sizes swept by default: ``Q x top_k`` x ``DEFAULT_BUFFER_FACTORS``, at
    most ``MAX_DEVICE_BUFFER_SIZE``."""
    return tuple(f * mtp * top_k for f in DEFAULT_BUFFER_FACTORS
                 if f * mtp * top_k <= MAX_DEVICE_BUFFER_SIZE)


def attention_kernel(preset: str) -> tuple[Optional[str], Optional[tuple[int, ...]]]:
    """``(kernel name, supported block sizes)`` of a preset; ``(None, None)``: any size."""
    return ATTENTION_KERNELS.get(preset, (None, None))


def trace_streams(settings: AdviseSettings, top_k: int, context_len: int
                  ) -> tuple[list[tuple[list[np.ndarray], list[int]]], str]:
    """``[(selections, seq_lens)]`` per stream, and where they came from. With ``mtp`` Q > 1
    a step's selection is the concatenation of Q consecutive tokens' selections (each over
    its own history) and its ``seq_len`` the last token's."""
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

    q = settings.mtp
    history = max(top_k + 1, context_len - settings.steps * q)
    gen = CalibratedTrace(top_k, seed=settings.seed)
    out = []
    for i in range(settings.streams):
        tokens = stream_selections(gen, history=history, steps=settings.steps * q, key=(i, 0))
        rows = [np.concatenate(tokens[j:j + q]) for j in range(0, len(tokens), q)]
        out.append((rows, [history + (j + 1) * q for j in range(settings.steps)]))
        gen.forget(i)
    per = f", {q} query tokens per step" if q > 1 else ""
    return out, f"calibrated synthetic trace ({settings.streams} streams x {settings.steps} " \
                f"steps at a {history}-token history{per})"


def trace_miss_curve(settings: AdviseSettings, top_k: int, context_len: int) -> TraceMissCurve:
    """The ``TraceMissCurve`` of ``settings``' trace (``trace_streams``: recorded, or the
    calibrated generator at ``context_len``), ``settings.warmup`` steps left out."""
    streams, source = trace_streams(settings, top_k, context_len)
    return TraceMissCurve(streams, settings.warmup, source)


def stream_step_misses(rows: Sequence[np.ndarray], seqs: Sequence[int], capacity: int,
                       block_size: int) -> np.ndarray:
    """``[steps] int64``: the LRU misses of every step of one stream (``rows``: each step's
    top-k positions, ``seqs``: its sequence length) with a hot buffer of ``capacity`` rows,
    the last ``ACTIVE_TAIL_PAGES`` pages of ``block_size`` tokens resident."""
    from hisparse_triton.policies import step_keys, stream_misses

    through = []
    for row, seq in zip(rows, seqs):
        keys = step_keys(row[(row >= 0) & (row < seq)])
        tail = (cdiv(seq, block_size) - ACTIVE_TAIL_PAGES) * block_size
        through.append(keys[keys < tail])
    return stream_misses("lru", through, capacity, distinct=True)


def steady_miss_rate(streams: Sequence[tuple[list[np.ndarray], list[int]]], capacity: int,
                     block_size: int, warmup: int) -> float:
    """LRU misses / valid columns after ``warmup`` steps, the last ``ACTIVE_TAIL_PAGES``
    pages of ``block_size`` tokens resident (see the module docstring)."""
    misses = columns = 0
    for rows, seqs in streams:
        skip = min(warmup, max(0, len(rows) - 1))
        misses += int(stream_step_misses(rows, seqs, capacity, block_size)[skip:].sum())
        columns += sum(int(((row >= 0) & (row < seq)).sum())
                       for row, seq in list(zip(rows, seqs))[skip:])
    return misses / columns if columns else 0.0


class MissCurve(Protocol):
    """Where a sweep's miss rates come from: ``miss_rate(buffer, block_size)`` is the
    steady-state misses / valid top-k columns of a hot buffer of ``buffer`` rows with KV
    blocks of ``block_size`` tokens; ``source`` says what it was measured on (one line)."""

    source: str

    def miss_rate(self, buffer: int, block_size: int) -> float: ...


@dataclass(frozen=True)
class TraceMissCurve:
    """Miss rates measured on top-k streams (``trace_streams``): the runtime's LRU replayed
    at every setting (``steady_miss_rate``), each stream's first ``warmup`` steps left out;
    each setting is replayed once (``memo``)."""

    streams: Sequence[tuple[list[np.ndarray], list[int]]]
    warmup: int
    source: str
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    def miss_rate(self, buffer: int, block_size: int) -> float:
        key = (buffer, block_size)
        if key not in self.memo:
            self.memo[key] = steady_miss_rate(self.streams, buffer, block_size, self.warmup)
        return self.memo[key]


@dataclass(frozen=True)
class ObservedMissCurve:
    """Miss rates observed on a running deployment instead of measured on a trace:
    ``points`` of ``(device_buffer_size, block_size, miss_rate)`` (e.g. from its live
    counters). At an observed setting the observed rate is used as it is; at any other, the
    rate observed at the nearest buffer size (log scale) is carried along the ``reference``
    curve's shape: ``min(1, m0 x ref(H, B) / ref(H0, B0))`` (``m0`` as it is where the
    reference is 0 at ``(H0, B0)``). ``live_verdict`` uses advise's calibrated trace as the
    reference, so the curve is advise's default one, rescaled through the observed rate."""

    points: tuple[tuple[int, int, float], ...]
    reference: MissCurve
    source: str

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("an observed miss curve needs at least one (buffer, block size, "
                             "miss rate) point.")
        for buffer, block, miss in self.points:
            if buffer < 1 or block < 1 or not 0.0 <= miss <= 1.0:
                raise ValueError(f"observed miss curve points must be buffer >= 1, block size "
                                 f">= 1 and a miss rate in [0, 1], got {list(self.points)}.")

    def miss_rate(self, buffer: int, block_size: int) -> float:
        exact = [m for h, b, m in self.points if (h, b) == (buffer, block_size)]
        if exact:
            return exact[0]
        h0, b0, m0 = min(self.points, key=lambda p: (abs(math.log(p[0] / buffer)),
                                                      p[1] != block_size, p[0]))
        base = self.reference.miss_rate(h0, b0)
        if m0 == 0.0 or base == 0.0:
            return m0
        return min(1.0, m0 * self.reference.miss_rate(buffer, block_size) / base)


def plan_setting(geometry: ModelGeometry, *, block_size: int, buffer: int, top_k: int,
                 context_len: int, gpu_bytes: int, host_gib: float,
                 mtp: int = 1) -> dict[str, Any]:
    """The planner's figures for one setting (``ValueError`` when it does not fit)."""
    from hisparse_triton.layout import (
        get_all_gpu_baseline_concurrency, get_hisparse_concurrency,
        get_hisparse_kv_cache_config, get_hisparse_kv_cache_groups)

    spec = build_kv_cache_spec(geometry, block_size=block_size)
    hisparse = HiSparseConfig(index_topk=top_k, device_buffer_size=buffer,
                              host_pool_gib=host_gib, max_decode_query_len=mtp)
    config = EngineConfig(max_model_len=context_len, hisparse=hisparse)
    groups = get_hisparse_kv_cache_groups(config, spec)
    kv = get_hisparse_kv_cache_config(config, groups, gpu_bytes, hisparse.host_pool_bytes)
    conc = get_hisparse_concurrency(config, kv)
    return {"concurrency": conc.steady_state, "limited_by": conc.limited_by,
            "gpu_bytes_per_request": conc.steady_blocks * kv.bytes_per_block,
            "bytes_per_block": kv.bytes_per_block, "num_gpu_blocks": kv.num_blocks,
            "baseline_concurrency": get_all_gpu_baseline_concurrency(config, spec, gpu_bytes)}


def all_gpu_row(geometry: ModelGeometry, settings: AdviseSettings, *, context_len: int,
                gpu_bytes: int) -> dict[str, Any]:
    """Every layer's whole history on the GPU (no HiSparse), at the preset's block size."""
    from hisparse_triton.layout import get_all_gpu_bytes_per_request

    config = EngineConfig(max_model_len=context_len)
    per_request = get_all_gpu_bytes_per_request(config, build_kv_cache_spec(geometry))
    concurrency = gpu_bytes / per_request
    cap = concurrency if settings.max_batch is None else min(concurrency, settings.max_batch)
    batch = max(0, math.floor(cap))
    step_ms = settings.step.ms(batch) if batch else 0.0
    return {"gpu_bytes_per_request": per_request, "concurrency": concurrency, "batch": batch,
            "compute_ms_per_step": step_ms, "step_ms": step_ms,
            "tokens_per_s": settings.mtp * batch / (step_ms / 1e3) if batch else 0.0}


def step_seconds(settings: AdviseSettings, batch: int, bytes_per_step: float,
                 gbps: float, *, exchange_bytes: float = 0.0) -> tuple[float, float, float]:
    """``(compute_s, link_s, step_s)`` of one decode step of ``batch`` requests
    (``bytes_per_step`` over the host link per request, ``exchange_bytes`` per request
    between the GPUs at ``settings.exchange_gbps``: the split gather, pipelined in
    ``settings.split_chunks`` chunks: ``SPLIT_FORMULA``)."""
    compute = settings.step.ms(batch) / 1e3
    pcie = batch * bytes_per_step / (gbps * 1e9)
    exchange = batch * exchange_bytes / (settings.exchange_gbps * 1e9)
    link = max(pcie, exchange) + min(pcie, exchange) / settings.split_chunks
    return compute, link, compute + link - min(settings.overlap * link, compute)


def crossover(settings: AdviseSettings, row: dict[str, Any],
              all_gpu: dict[str, Any]) -> Optional[int]:
    """The fewest concurrent requests at which ``row`` decodes faster than all-GPU (which runs
    ``min(demand, its batch)`` of them); ``None`` when it never does within its batch."""
    def all_gpu_tokens(demand: int) -> float:
        b = min(demand, all_gpu["batch"])
        return settings.mtp * b / (settings.step.ms(b) / 1e3) if b else 0.0

    pcie, exchange = row["bytes_per_step"], 0.0
    if settings.tp_split > 1 and row["batch"]:   # per rank and request, as run_advise's
        pcie = row["pcie_bytes_per_rank_per_step"] / row["batch"]
        exchange = row["exchange_bytes_per_rank_per_step"] / row["batch"]
    for demand in range(1, row["batch"] + 1):
        _, _, step = step_seconds(settings, demand, pcie, row["link_gbps"],
                                  exchange_bytes=exchange)
        if settings.mtp * demand / step > all_gpu_tokens(demand) * (1 + RECOMMEND_TOLERANCE):
            return demand
    return None


def run_advise(settings: AdviseSettings,
               on_setting: Optional[Callable[[str], None]] = None, *,
               miss_curve: Optional[MissCurve] = None) -> dict[str, Any]:
    """The sweep and its recommendation, as the JSON payload of ``advise``.

    ``miss_curve``: where every setting's miss rate comes from; default: the runtime's LRU
    on ``settings``' trace (``trace_streams``, ``TraceMissCurve``). A live deployment passes
    the rates it observed (``ObservedMissCurve``); ``settings.trace`` must then be unset."""
    geometry = get_preset(settings.preset)
    top_k = settings.top_k or geometry.index_topk
    q = settings.mtp
    context = settings.context_len or min(16 * top_k, geometry.max_model_len)
    if context > geometry.max_model_len:
        raise ValueError(f"--context-len {context} exceeds the {settings.preset} preset's "
                         f"max context of {geometry.max_model_len}.")
    if context <= top_k:
        raise ValueError(f"--context-len {context} is not longer than top-k {top_k}: every "
                         f"step would select the whole history and nothing could miss.")
    if miss_curve is not None and settings.trace is not None:
        raise ValueError("a sweep takes its miss rates from a trace or from a given miss "
                         "curve, not both.")
    if q > 1 and settings.trace is not None:
        raise ValueError(f"--mtp {q} cannot be combined with --trace: a trace holds one top-k "
                         f"selection per request and step.")
    if not isinstance(settings.tp_split, int) or settings.tp_split < 1:
        raise ValueError(f"--tp-split must be an int >= 1, got {settings.tp_split!r}.")
    if settings.split_fraction is not None and not 0.0 < settings.split_fraction <= 1.0:
        raise ValueError(f"--split-fraction must be in (0, 1], got {settings.split_fraction!r}.")
    if not isinstance(settings.split_chunks, int) or settings.split_chunks < 1:
        raise ValueError(f"--split-chunks must be an int >= 1, got {settings.split_chunks!r}.")
    if not settings.exchange_gbps > 0:
        raise ValueError(f"--exchange-gbps must be positive, got {settings.exchange_gbps!r}.")
    if not 0.0 <= settings.overlap <= 1.0:
        raise ValueError(f"--overlap must be a fraction in [0, 1], got {settings.overlap!r}.")
    buffers = settings.buffers or default_buffers(q, top_k)
    small = [b for b in buffers if b < q * top_k]
    if small:
        what = f"{q} x top-k {top_k}" if q > 1 else f"top-k {top_k}"
        raise ValueError(f"--buffers {small[0]} is smaller than {what}: one step's "
                         f"selections must fit the hot buffer.")
    kernel, supported = attention_kernel(geometry.name)
    block_sizes = settings.block_sizes or supported or DEFAULT_BLOCK_SIZES
    if miss_curve is None:
        miss_curve = trace_miss_curve(settings, top_k, context)
    gpu_bytes = int(settings.gpu_memory_gib * GIB)
    rows_out = []
    for block in block_sizes:
        for buffer in buffers:
            label = f"B={block} H={buffer}"
            row: dict[str, Any] = {"block_size": block, "device_buffer_size": buffer,
                                   "supported": supported is None or block in supported}
            try:
                row.update(plan_setting(geometry, block_size=block, buffer=buffer, top_k=top_k,
                                        context_len=context, gpu_bytes=gpu_bytes,
                                        host_gib=settings.host_pool_gib, mtp=q))
            except ValueError as exc:
                row["error"] = " ".join(str(exc).split())
                rows_out.append(row)
                if on_setting is not None:
                    on_setting(label)
                continue
            miss = miss_curve.miss_rate(buffer, block)
            rows_step = miss * q * top_k * geometry.num_indexer_layers
            bytes_step = miss * q * top_k * geometry.num_layers * geometry.mla_row_bytes
            cap = row["concurrency"] if settings.max_batch is None else \
                min(row["concurrency"], settings.max_batch)
            batch = max(0, math.floor(cap))
            gbps = settings.link_gbps
            if settings.link_by_rows is not None and batch:
                gbps = settings.link_by_rows(max(1, round(miss * q * top_k * batch)))
            fraction = split_fraction(settings, miss)
            pcie_rank, exchange_rank = split_bytes(
                miss * q * top_k, q * top_k, geometry.num_layers * geometry.mla_row_bytes,
                settings.tp_split, fraction)
            compute_s, link_s, step_s = step_seconds(
                settings, batch, pcie_rank, gbps,
                exchange_bytes=exchange_rank) if batch else (0.0, 0.0, 0.0)
            row.update({
                "miss_rate": miss, "hit_rate": 1.0 - miss,
                "rows_per_step": rows_step, "bytes_per_step": bytes_step,
                "batch": batch, "batch_rows_per_step": rows_step * batch,
                "batch_bytes_per_step": bytes_step * batch, "link_gbps": gbps,
                "compute_ms_per_step": compute_s * 1e3, "link_ms_per_step": link_s * 1e3,
                "step_ms": step_s * 1e3,
                "tokens_per_s": q * batch / step_s if batch else 0.0,
                "pcie_bytes_per_rank_per_step": pcie_rank * batch,
                "exchange_bytes_per_rank_per_step": exchange_rank * batch,
            })
            if settings.tp_split > 1:
                row["split_fraction"] = fraction
            rows_out.append(row)
            if on_setting is not None:
                on_setting(label)
    ok = [r for r in rows_out if "error" not in r and r["batch"] > 0]
    eligible = [r for r in ok if r["supported"]] or ok
    best = recommend(eligible)
    gpu_row = all_gpu_row(geometry, settings, context_len=context, gpu_bytes=gpu_bytes)
    cross = crossover(settings, best, gpu_row) if best is not None else None
    if best is not None and best["tokens_per_s"] > gpu_row["tokens_per_s"] * (
            1 + RECOMMEND_TOLERANCE):
        recommended = {"mode": "hisparse", "block_size": best["block_size"],
                       "device_buffer_size": best["device_buffer_size"],
                       "tokens_per_s": best["tokens_per_s"], "batch": best["batch"],
                       "miss_rate": best["miss_rate"], "supported": best["supported"],
                       "vs_all_gpu": best["tokens_per_s"] / gpu_row["tokens_per_s"]
                       if gpu_row["tokens_per_s"] else None}
    elif gpu_row["batch"] > 0:
        recommended = {"mode": "all-gpu", "block_size": None, "device_buffer_size": None,
                       "tokens_per_s": gpu_row["tokens_per_s"], "batch": gpu_row["batch"],
                       "miss_rate": 0.0, "supported": True,
                       "best_hisparse_tokens_per_s": best["tokens_per_s"] if best else None,
                       "best_hisparse_batch": best["batch"] if best else None}
    else:
        recommended = None
    return {
        "preset": geometry.name, "top_k": top_k, "context_len": context, "mtp": q,
        "gpu_memory_gib": settings.gpu_memory_gib, "host_pool_gib": settings.host_pool_gib,
        "sparse_layers": geometry.num_layers, "index_groups": geometry.num_indexer_layers,
        "row_bytes": geometry.mla_row_bytes,
        "step_model": {"points": [list(p) for p in settings.step.points],
                       "source": settings.step.source, "text": settings.step.describe()},
        "overlap": settings.overlap, "max_batch": settings.max_batch,
        "tp_split": {"ranks": settings.tp_split, "exchange_gbps": settings.exchange_gbps,
                     "fraction": "auto" if settings.split_fraction is None
                     else settings.split_fraction,
                     "chunks": settings.split_chunks, "headroom": SPLIT_HEADROOM,
                     "recommended_fraction": None if best is None
                     else capacity_fraction(best["miss_rate"]),
                     "recommended_miss_rate": None if best is None else best["miss_rate"],
                     "formula": SPLIT_FORMULA}
        if settings.tp_split > 1 else None,
        "link_gbps": settings.link_gbps, "link_source": settings.link_source,
        "attention_kernel": kernel,
        "supported_block_sizes": list(supported) if supported else None,
        "block_sizes": list(block_sizes), "trace": miss_curve.source,
        "warmup_steps": settings.warmup, "formula": THROUGHPUT_FORMULA,
        "settings": rows_out, "all_gpu": gpu_row,
        "crossover": {"requests": cross, "all_gpu_batch": gpu_row["batch"],
                      "setting": None if best is None else
                      {"block_size": best["block_size"],
                       "device_buffer_size": best["device_buffer_size"]}},
        "recommended": recommended,
    }


def recommend(rows: Sequence[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The setting with the best ``tokens_per_s``; settings within ``RECOMMEND_TOLERANCE`` of
    it count as equal, and the one with the least GPU memory per request (then the smaller
    buffer) wins among them. Callers pass the supported settings only (``run_advise``)."""
    if not rows:
        return None
    top = max(r["tokens_per_s"] for r in rows)
    near = [r for r in rows if r["tokens_per_s"] >= top * (1 - RECOMMEND_TOLERANCE)]
    return min(near, key=lambda r: (r["gpu_bytes_per_request"], r["device_buffer_size"]))


# ----------------------------------------------------------------- link speed from bench
#: Gather methods a link speed may come from, best first (the contiguous copy is not a
#: gather of scattered rows, so it is never used).
GATHER_METHODS = ("triton_graph", "triton", "torch", "eager")
BENCH_SCHEMAS = ("hisparse-triton/bench", "hisparse-triton/gpu-check")


def _gpu_gather_figures(result: Any) -> list[dict[str, Any]]:
    """The verified GPU gather figures of a ``bench`` / ``gpu_check`` result, or
    ``ValueError`` saying why there are none."""
    if not isinstance(result, dict) or result.get("schema") not in BENCH_SCHEMAS:
        schema = result.get("schema") if isinstance(result, dict) else None
        raise ValueError(f"not a bench result (schema {schema!r}; expected one of "
                         f"{', '.join(BENCH_SCHEMAS)})")
    bench = result.get("bench", result)
    if not isinstance(bench, dict):
        raise ValueError("a gpu_check result without bench figures")
    device = str(bench.get("device", ""))
    if not device.startswith("cuda"):
        raise ValueError(f"a CPU bench result (device {device or '?'}): its figures time "
                         f"CPU memory copies, not the host -> device link; use a bench "
                         f"result measured on a GPU")
    figs = [f for f in bench.get("transfers", []) if f.get("op") == "gather"
            and f.get("method") in GATHER_METHODS and f.get("gbps")
            and f.get("verified", True) is not False]
    if not figs:
        raise ValueError("a GPU bench result without verified gather figures (run bench "
                         "with --ops gather)")
    return figs


def find_bench_result(path: str) -> tuple[str, dict[str, Any]]:
    """``(file, result)``: ``path`` itself, or the newest ``*.json`` of a directory that is a
    GPU gather result of ``bench`` (or ``bench/gpu_check.py``). ``ValueError`` naming the file
    (or every file of the directory) and why it was refused."""
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "*.json")), key=os.path.getmtime,
                       reverse=True)
        if not files:
            raise ValueError(f"--bench-json {path}: the directory holds no .json file.")
        reasons = []
        for name in files:
            try:
                return name, _read_gather_result(name)
            except ValueError as exc:
                reasons.append(f"{os.path.basename(name)}: {exc}")
        raise ValueError(f"--bench-json {path}: none of its {len(files)} .json files is a "
                         f"GPU gather result ({'; '.join(reasons[:3])}"
                         f"{'; ...' if len(reasons) > 3 else ''}).")
    if not os.path.isfile(path):
        raise ValueError(f"--bench-json {path}: no such file or directory.")
    try:
        return path, _read_gather_result(path)
    except ValueError as exc:
        raise ValueError(f"--bench-json {path}: {exc}.") from None


def _read_gather_result(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            result = json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a readable JSON file ({' '.join(str(exc).split())})") from None
    _gpu_gather_figures(result)
    return result


def link_from_bench(result: dict[str, Any], row_bytes: int) -> tuple[Callable[[int], float],
                                                                     str]:
    """A GB/s lookup by rows gathered per launch, from a GPU ``bench`` (or ``gpu_check``)
    JSON result: the verified ``gather`` figures of the row size nearest ``row_bytes``, the
    best method available (``GATHER_METHODS``); rows between two measured sizes take the
    nearer one (log scale). ``ValueError`` for a CPU result or one without gather figures."""
    figs = _gpu_gather_figures(result)
    bench = result.get("bench", result)
    size = min({f["row_bytes"] for f in figs}, key=lambda r: abs(math.log(r / row_bytes)))
    figs = [f for f in figs if f["row_bytes"] == size]
    for method in GATHER_METHODS:
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

    where = result.get("environment", {}).get("gpu") or bench.get("environment", {}).get(
        "gpu") or bench.get("device", "?")
    return lookup, (f"bench gather figures ({method}, {size} B rows, "
                    f"{len(sizes)} sizes) measured on {where}")


__all__ = ["ATTENTION_KERNELS", "AdviseSettings", "DEFAULT_BLOCK_SIZES",
           "DEFAULT_BUFFER_FACTORS", "DEFAULT_STEP_POINTS", "GATHER_METHODS", "MissCurve",
           "default_buffers",
           "ObservedMissCurve", "TraceMissCurve",
           "RECOMMEND_TOLERANCE", "StepModel", "THROUGHPUT_FORMULA", "all_gpu_row",
           "DEFAULT_EXCHANGE_GBPS", "SPLIT_FORMULA", "split_bytes", "split_fraction",
           "attention_kernel", "crossover", "find_bench_result", "link_from_bench",
           "plan_setting", "recommend", "run_advise", "step_seconds",
           "steady_miss_rate", "stream_step_misses", "trace_miss_curve", "trace_streams"]
