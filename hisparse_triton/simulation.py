"""The decode-workload simulator behind ``hisparse-triton simulate`` (torch imported lazily).

``run_simulation(settings)`` builds a preset's layout with a device pool sized like a real
deployment at steady state (``workload.steady_device_blocks``: per running request the
indexer, the hot region and a short resident tail, plus one prefill chunk; NOT every
request's history), creates a ``HiSparseRuntime`` and drives it through its public API only:
requests are admitted (``add_request``), prefilled chunk by chunk (``append_slots`` +
``commit``), decoded one token per step (``append_slots``, one ``resolve`` per index group,
``commit``) and freed. The top-k positions come from a generator (``workload.make_trace``)
or a recorded trace (``trace.load_trace``), and can be recorded (``--record``).

Large presets are *sampled*: a few index groups are simulated (``SimSettings.layers``) and
the per-step bytes and times are scaled to the model's layer count; the report says so.

With ``policies``, the positions each resolve sent through the hot buffer (valid positions
whose page had left the GPU, read with ``block_table``) are kept per (request, index group)
and replayed offline through LRU (which must give the runtime's miss count exactly), FIFO
and Belady's optimum (``hisparse_triton.policies``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import numpy as np

from hisparse_triton.presets import ModelGeometry, build_kv_cache_spec, get_preset
from hisparse_triton.specs import cdiv

#: ``verify=None`` checks runs whose dense copy stays under this many bytes.
VERIFY_AUTO_MAX_BYTES = 256 << 20
#: Presets with more sparse layers than this are sampled by default.
SAMPLE_ABOVE_LAYERS = 8
#: Index groups simulated by default when a preset is sampled.
SAMPLED_INDEX_GROUPS = 4
#: Default prefill chunk (tokens appended and committed at a time).
DEFAULT_PREFILL_CHUNK = 8192
#: Default decode steps per request.
DEFAULT_OUTPUT_LEN = 64


@dataclass(frozen=True)
class SimSettings:
    """One simulation. ``None`` fields take the preset's defaults (``with_defaults``)."""

    preset: str = "tiny"
    layers: Optional[int] = None
    requests: Optional[int] = None
    max_running: Optional[int] = None
    prompt_len: Optional[int] = None
    output_len: Optional[int] = None
    top_k: Optional[int] = None
    device_buffer_size: Optional[int] = None
    workload: str = "calibrated"
    locality: float = 0.8
    trace: Optional[str] = None
    record: Optional[str] = None
    policies: tuple[str, ...] = ("lru", "fifo", "belady")
    prefill_chunk: Optional[int] = None
    offload_threshold_pages: Optional[int] = None
    free_block_watermark: Optional[float] = None
    host_blocks: Optional[int] = None
    device_blocks: Optional[int] = None
    seed: int = 0
    device: str = "cpu"
    backend: str = "auto"
    verify: Optional[bool] = None
    link_gbps: float = 50.0
    sampled: bool = field(default=False, compare=False)


def default_layers(geometry: ModelGeometry) -> int:
    """Sparse layers simulated by default: all of a small preset, else
    ``SAMPLED_INDEX_GROUPS`` index groups (leaders and their followers)."""
    if geometry.num_layers <= SAMPLE_ABOVE_LAYERS:
        return geometry.num_layers
    return min(geometry.num_layers, SAMPLED_INDEX_GROUPS * geometry.index_share)


def with_defaults(settings: SimSettings) -> SimSettings:
    """``settings`` with every ``None`` size filled from the preset: top-k from the preset,
    prompts of ``16 x top-k`` tokens (32,768 on DeepSeek-V3.2, within the context),
    ``DEFAULT_OUTPUT_LEN`` generated tokens, 8 requests 4 at a time, prefill chunks of
    ``DEFAULT_PREFILL_CHUNK`` tokens, and ``default_layers``."""
    g = get_preset(settings.preset)
    top_k = settings.top_k if settings.top_k is not None else g.index_topk
    output = settings.output_len if settings.output_len is not None else DEFAULT_OUTPUT_LEN
    prompt = settings.prompt_len
    if prompt is None:
        prompt = max(1, min(16 * top_k, g.max_model_len - output))
    layers = settings.layers if settings.layers is not None else default_layers(g)
    requests = settings.requests if settings.requests is not None else 8
    running = settings.max_running if settings.max_running is not None else 4
    chunk = settings.prefill_chunk if settings.prefill_chunk is not None else \
        DEFAULT_PREFILL_CHUNK
    return replace(settings, top_k=top_k, output_len=output, prompt_len=prompt, layers=layers,
                   requests=requests, max_running=min(running, requests),
                   prefill_chunk=chunk, sampled=layers < g.num_layers)


# ----------------------------------------------------------------------------- schedules
@dataclass
class Schedule:
    """Who decodes when: per request its prompt and output lengths; per step the requests
    decoded and their lengths at that step (the token being decoded included)."""

    prompt_len: list[int]
    output_len: list[int]
    steps: list[tuple[list[int], list[int]]]
    first: list[int]
    last: list[int]
    max_live: int

    @property
    def max_len(self) -> int:
        return max(p + o for p, o in zip(self.prompt_len, self.output_len))


def synthetic_schedule(requests: int, max_running: int, prompt_len: int,
                       output_len: int) -> Schedule:
    """Continuous batching: up to ``max_running`` requests at a time, a finished request's
    place taken by the next one at the following step."""
    waiting = list(range(requests))[::-1]
    running: dict[int, int] = {}
    steps: list[tuple[list[int], list[int]]] = []
    first = [-1] * requests
    last = [-1] * requests
    while waiting or running:
        while waiting and len(running) < max_running:
            rid = waiting.pop()
            running[rid] = 0
            first[rid] = len(steps)
        ids = list(running)
        steps.append((ids, [prompt_len + running[r] + 1 for r in ids]))
        for rid in ids:
            running[rid] += 1
            if running[rid] >= output_len:
                last[rid] = len(steps) - 1
                del running[rid]
    return Schedule([prompt_len] * requests, [output_len] * requests, steps, first, last,
                    min(max_running, requests))


def trace_schedule(trace: Any) -> Schedule:
    """The schedule of a ``TopkTraceFile`` (record indices kept for the positions)."""
    steps = []
    for _, records in trace.steps():
        steps.append(([int(r) for r in trace.request[records]],
                      [int(s) for s in trace.seq_len[records]]))
    step_index = {int(s): i for i, (s, _) in enumerate(trace.steps())}
    first, last = trace.lifetimes()
    return Schedule([int(p) for p in trace.prompt_len], [int(o) for o in trace.output_len],
                    steps, [step_index.get(int(s), -1) for s in first],
                    [step_index.get(int(s), -1) for s in last], trace.max_live())


def cannot_miss_warnings(schedule: Schedule, top_k: int, buffer: int) -> list[str]:
    """Why this workload cannot miss (or only on first touch), if it cannot."""
    live = [i for i, f in enumerate(schedule.first) if f >= 0]
    history = max((schedule.prompt_len[i] + schedule.output_len[i] for i in live), default=0)
    out = []
    if history <= top_k:
        out.append(f"every request's history ({history} tokens at most) fits in one top-k "
                   f"selection ({top_k}): every step selects the whole history, so the "
                   f"workload cannot miss beyond first touch; use prompts longer than top-k")
    elif buffer >= history:
        out.append(f"the hot buffer ({buffer} rows) holds every request's whole history "
                   f"({history} tokens at most): nothing is ever evicted, so only first "
                   f"touches miss; use longer prompts or a smaller --device-buffer-size")
    return out


# ----------------------------------------------------------------------------- the run
def _check_memory(what: str, flag: Optional[int], needed: int, available: int) -> None:
    if needed > available:
        name = f"{flag} blocks (--{what}-blocks)" if flag is not None else "the planned pool"
        raise ValueError(f"{name}: the {what} pool would take {needed / 2**30:.2f} GiB, more "
                         f"than the {available / 2**30:.2f} GiB available on this machine.")


def _available_device_bytes(device: Any) -> int:
    import torch

    from hisparse_triton.pools import available_ram_bytes

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return available_ram_bytes()


def _resolve_device(name: str) -> Any:
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"device {name!r} is not a torch device: {exc}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r}: the runtime runs on a cpu or cuda device.")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine.")
    return device


class _Positions:
    """The top-k source of a run: a generator, or the records of a trace."""

    def __init__(self, settings: SimSettings, trace: Any) -> None:
        from hisparse_triton.workload import make_trace

        self.trace = trace
        self.generator = None if trace is not None else make_trace(
            settings.workload, settings.top_k, seed=settings.seed, locality=settings.locality)
        if trace is not None:
            self._records = list(trace.steps())

    def step(self, step: int, ids: list[int], seqs: list[int], layers: int) -> np.ndarray:
        """``[len(ids), layers, top_k] int32`` positions of one step."""
        if self.trace is not None:
            _, records = self._records[step]
            return self.trace.positions[records, :layers].astype(np.int32)
        out = np.empty((len(ids), layers, self.generator.topk), dtype=np.int32)
        for layer in range(layers):
            for i, (rid, seq) in enumerate(zip(ids, seqs)):
                out[i, layer] = self.generator.next((rid, layer), seq)
        return out

    def forget(self, rid: int) -> None:
        if self.generator is not None:
            self.generator.forget(rid)


def run_simulation(settings: SimSettings,
                   on_step: Optional[Callable[[int, int], None]] = None) -> dict[str, Any]:
    """Run one simulation; returns the report (see ``hisparse-triton simulate --json``).

    ``on_step(done, total)`` is called after every decode step (progress). Raises
    ``ValueError`` for a bad configuration, ``HiSparseError`` when the pools cannot hold the
    workload, ``oracle.OracleMismatch`` when verification fails.
    """
    import torch

    from hisparse_triton.config import ACTIVE_TAIL_PAGES
    from hisparse_triton.oracle import DenseOracle
    from hisparse_triton.policies import compare_policies
    from hisparse_triton.runtime import HiSparseRuntime
    from hisparse_triton.trace import TraceRecorder, load_trace, save_trace
    from hisparse_triton.workload import (
        CALIBRATION_HISTORY, PUBLISHED_MISS_RATES, calibration_rates, plan_for_workload)

    geometry = get_preset(settings.preset)
    trace = load_trace(settings.trace) if settings.trace is not None else None
    if trace is not None:
        if settings.top_k is not None and settings.top_k != trace.top_k:
            raise ValueError(f"--top-k {settings.top_k} differs from the trace's top-k "
                             f"{trace.top_k}.")
        layers = settings.layers
        if layers is None:
            layers = min(geometry.num_layers, trace.num_layers * geometry.index_share)
        settings = replace(settings, top_k=trace.top_k, layers=layers)
    s = with_defaults(settings)
    device = _resolve_device(s.device)
    if trace is not None:
        schedule = trace_schedule(trace)
    else:
        schedule = synthetic_schedule(s.requests, s.max_running, s.prompt_len, s.output_len)
    max_len = schedule.max_len
    if max_len > geometry.max_model_len:
        raise ValueError(f"prompt + output = {max_len} tokens exceed the {s.preset} preset's "
                         f"max context of {geometry.max_model_len}.")
    if s.layers > geometry.num_layers:
        raise ValueError(f"--layers {s.layers} exceeds the {s.preset} preset's "
                         f"{geometry.num_layers} sparse layers.")
    running = schedule.max_live
    spec = build_kv_cache_spec(geometry, num_layers=s.layers)
    longest_prompt = max(schedule.prompt_len)
    plan = plan_for_workload(spec, max_model_len=max_len, num_requests=running, topk=s.top_k,
                             device_buffer_size=s.device_buffer_size,
                             prompt_len=longest_prompt, host_blocks=s.host_blocks,
                             device_blocks=s.device_blocks, prefill_chunk=s.prefill_chunk)
    kvc = plan.kv_cache_config
    B = plan.block_size
    _check_memory("device", s.device_blocks, kvc.num_blocks * kvc.bytes_per_block,
                  _available_device_bytes(device))
    host_stride = kvc.hisparse_host_block_stride
    from hisparse_triton.pools import available_ram_bytes

    _check_memory("host", s.host_blocks, kvc.hisparse_host_num_blocks * host_stride,
                  available_ram_bytes())
    runtime = HiSparseRuntime(kvc, plan.config, max_num_seqs=running, device=device,
                              backend=s.backend,
                              offload_threshold_pages=s.offload_threshold_pages,
                              **({} if s.free_block_watermark is None else
                                 {"free_block_watermark": s.free_block_watermark}))
    try:
        leaders = runtime.leaders
        if trace is not None and len(leaders) > trace.num_layers:
            raise ValueError(f"{s.layers} layers make {len(leaders)} index groups, more than "
                             f"the trace's {trace.num_layers}.")
        buffer = runtime.device_buffer_size
        warnings = cannot_miss_warnings(schedule, s.top_k, buffer)
        dense_bytes = running * max_len * sum(
            runtime.device_cache(layer).shape[-1] for layer in runtime.device_layers)
        verify = s.verify if s.verify is not None else dense_bytes <= VERIFY_AUTO_MAX_BYTES
        oracle = DenseOracle(runtime, seed=s.seed) if verify else None
        positions = _Positions(s, trace)
        recorder = None
        if s.record is not None:
            recorder = TraceRecorder(s.top_k, len(leaders), metadata={
                "writer": "hisparse-triton simulate", "preset": s.preset,
                "workload": "trace" if trace is not None else s.workload, "seed": s.seed,
                "locality": s.locality if s.workload == "locality" else None})
        streams: dict[tuple[int, int], list[np.ndarray]] = {}
        chunk = s.prefill_chunk
        all_gpu_peak = device_peak_blocks = 0
        resolves = resolved_rows = 0
        total_steps = len(schedule.steps)
        start = time.perf_counter()

        def admit(rid: int) -> None:
            prompt, output = schedule.prompt_len[rid], schedule.output_len[rid]
            runtime.add_request(rid, prompt, output)
            if oracle is not None:
                oracle.add(rid)
            if recorder is not None:
                recorder.add_request(rid, prompt, output)
            done = 0
            while done < prompt:
                n = min(chunk, prompt - done)
                rows = runtime.append_slots(rid, n)
                if oracle is not None:
                    oracle.write(rid, rows)
                runtime.commit()
                done += n

        for step, (ids, seqs) in enumerate(schedule.steps):
            for rid in ids:
                if schedule.first[rid] == step:
                    admit(rid)
            for rid, seq in zip(ids, seqs):
                grow = seq - runtime.seq_len(rid)
                if grow > 0:
                    rows = runtime.append_slots(rid, grow)
                    if oracle is not None:
                        oracle.write(rid, rows)
            # Working set of this step, both ways: every running request's full history on
            # the GPU vs the blocks the runtime holds now (before this step's commit).
            all_gpu_peak = max(all_gpu_peak, sum(cdiv(seq, B) for seq in seqs)
                               * plan.all_gpu_bytes_per_page)
            device_peak_blocks = max(device_peak_blocks, runtime.stats().device_blocks)
            chosen = positions.step(step, ids, seqs, len(leaders))
            for li, leader in enumerate(leaders):
                topk_np = np.ascontiguousarray(chosen[:, li])
                topk_t = torch.from_numpy(topk_np)
                if runtime.device.type == "cuda":  # what an indexer would hand over
                    topk_t = topk_t.pin_memory().to(runtime.device, non_blocking=True)
                if s.policies:
                    for i, (rid, seq) in enumerate(zip(ids, seqs)):
                        row = topk_np[i].astype(np.int64)
                        row = row[(row >= 0) & (row < seq)]
                        resident = np.asarray(runtime.block_table(rid, leader), np.int64)
                        streams.setdefault((rid, li), []).append(row[resident[row // B] == 0])
                out = runtime.resolve(leader, ids, topk_t)
                if oracle is not None:
                    oracle.check_resolve(leader, ids, topk_t, out)
                resolves += 1
                resolved_rows += len(ids)
            if recorder is not None:
                recorder.add(step, ids, seqs, chosen)
            runtime.commit()
            for rid in ids:
                if schedule.last[rid] == step:
                    if oracle is not None:
                        oracle.check_pages(rid)
                        oracle.check_host(rid, runtime.seq_len(rid))
                        oracle.free(rid)
                    runtime.free_request(rid)
                    positions.forget(rid)
            if on_step is not None:
                on_step(step + 1, total_steps)
        if runtime.device.type == "cuda":
            torch.cuda.synchronize(runtime.device)
        wall = time.perf_counter() - start
        stats = runtime.stats()
        leaked = stats.device_blocks + stats.host_blocks
        if leaked:
            raise RuntimeError(f"{leaked} blocks still in use after every request was freed.")
        if recorder is not None:
            save_trace(recorder.build(), s.record)

        host_block_bytes = sum(runtime.host_cache(layer).shape[1]
                               * runtime.host_cache(layer).shape[2]
                               for layer in runtime.source_layers)
        device_peak = device_peak_blocks * kvc.bytes_per_block
        host_peak = stats.peak_host_blocks * host_block_bytes
        link = s.link_gbps * 1e9
        decode_steps = total_steps
        sim_layers = len(runtime.source_layers)
        layer_scale = geometry.num_layers / sim_layers
        group_scale = geometry.num_indexer_layers / len(leaders)
        h2d_step = stats.h2d_bytes / max(decode_steps, 1) * group_scale
        d2h_total = stats.d2h_bytes * layer_scale
        resident_groups = sum(1 for g in kvc.kv_cache_groups
                              if type(g.kv_cache_spec).__name__ == "HiSparseResidentSpec")
        report: dict[str, Any] = {
            "preset": s.preset,
            "model_sparse_layers": geometry.num_layers,
            "model_index_groups": geometry.num_indexer_layers,
            "sparse_layers": sim_layers,
            "index_groups": len(leaders),
            "sampled": sim_layers < geometry.num_layers,
            "layer_scale": layer_scale,
            "resident_groups": resident_groups,
            "device": str(runtime.device),
            "backend": s.backend,
            "workload": "trace" if trace is not None else s.workload,
            "trace": s.trace,
            "recorded": s.record,
            "requests": sum(1 for f in schedule.first if f >= 0),
            "max_running": running,
            "prompt_len": longest_prompt,
            "output_len": max(schedule.output_len),
            "prefill_chunk": chunk,
            "block_size": B,
            "top_k": s.top_k,
            "device_buffer_size": buffer,
            "locality": s.locality if s.workload == "locality" and trace is None else None,
            "offload_threshold_pages": runtime.offload_threshold_pages,
            "active_tail_pages": ACTIVE_TAIL_PAGES,
            "device_pool_blocks": kvc.num_blocks,
            "host_pool_blocks": kvc.hisparse_host_num_blocks,
            "decode_steps": decode_steps,
            "resolves": resolves,
            "resolved_rows": resolved_rows,
            "hits": stats.hits,
            "misses": stats.misses,
            "masked": stats.masked,
            "hit_rate": stats.hit_rate,
            "miss_rate": 1.0 - stats.hit_rate,
            "h2d_bytes": stats.h2d_bytes,
            "d2h_bytes": stats.d2h_bytes,
            "link_gbps": s.link_gbps,
            "h2d_seconds": stats.h2d_bytes / link,
            "d2h_seconds": stats.d2h_bytes / link,
            "h2d_bytes_per_step_model": h2d_step,
            "h2d_seconds_per_step_model": h2d_step / link,
            "d2h_bytes_model": d2h_total,
            "all_gpu_peak_bytes": all_gpu_peak,
            "device_peak_bytes": device_peak,
            "device_peak_bytes_with_prefill": stats.peak_device_blocks * kvc.bytes_per_block,
            "host_peak_bytes": host_peak,
            "device_pool_bytes": kvc.num_blocks * kvc.bytes_per_block,
            "host_pool_bytes": kvc.hisparse_host_num_blocks * host_block_bytes,
            "gpu_bytes_saved": all_gpu_peak - device_peak,
            "gpu_saved_fraction": (all_gpu_peak - device_peak) / all_gpu_peak
            if all_gpu_peak else 0.0,
            "unpinned_pages": stats.unpinned_pages,
            "lost_pages": stats.lost_pages,
            "verified": bool(verify),
            "rows_checked": oracle.rows_checked if oracle is not None else 0,
            "warnings": warnings,
            "wall_seconds": wall,
        }
        if s.policies:
            compared = compare_policies(streams, buffer, s.policies)
            report["buffer_lookups"] = sum(step.size for stream in streams.values()
                                           for step in stream)
            report["policies"] = compared
            if "lru" in compared:
                report["lru_matches_runtime"] = compared["lru"]["misses"] == stats.misses
        if trace is None and s.workload == "calibrated":
            history = max(s.top_k + 1, s.prompt_len)
            rates = calibration_rates(topk=s.top_k, history=history)
            report["calibration"] = {
                "history": history, "top_k": s.top_k,
                "buffer_factors": list(PUBLISHED_MISS_RATES),
                "lru_miss_rates": [rates[f] for f in PUBLISHED_MISS_RATES],
                "published_miss_rates": list(PUBLISHED_MISS_RATES.values()),
                "calibrated_history": CALIBRATION_HISTORY,
            }
        return report
    finally:
        runtime.close()


__all__ = ["DEFAULT_OUTPUT_LEN", "DEFAULT_PREFILL_CHUNK", "Schedule", "SimSettings",
           "VERIFY_AUTO_MAX_BYTES", "cannot_miss_warnings", "default_layers", "run_simulation",
           "synthetic_schedule", "trace_schedule", "with_defaults"]
