"""A whole decode step of a preset on a GPU through the runtime (``bench --decode-step``).

``decode_step_device`` builds a runtime at a preset's real shapes with every running request
offloaded (the host path: every resolve gathers), feeds it top-k selections from a locality
trace, and times, per step:

- the **eager step**: ``append_decode`` + ``step()`` + ``apply`` + one ``resolve_rows`` per
  index group + ``mirror``, on the host clock (what the Python costs) and the device clock;
- the **graph-replayed step**: the same step with the decode forward (every index group's
  ``resolve_rows``, the gathers included) captured once in a CUDA graph and replayed with a
  new plan each step: the eager part is ``append_decode`` + ``step()`` + ``apply`` +
  ``mirror`` and one ``graph.replay()``, on the host clock and the device clock (the way a
  serving stack decodes: docs/runtime.md, "Decode under CUDA graphs");
- the resolves alone replayed from the graph (device time per index group), misses and
  bytes gathered per step.

``overlap_step``: the same step with a stand-in compute kernel per index group, serial vs
the side-stream mode (``resolve_rows(..., stream=)``), with the gather grid uncapped and at
the default budget (``gather_programs_per_sm``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional

import numpy as np
import torch

from hisparse_triton.presets import build_kv_cache_spec

__all__ = ["decode_step_device", "overlap_step"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_step_device(batch: int = 64, prompt_len: int = 4096, steps: int = 12, *,
                       preset: str = "deepseek-v3.2-fp8", layers: Optional[int] = None,
                       locality: float = 0.87, distinct_steps: int = 6,
                       device: str = "cuda") -> dict[str, Any]:
    """A whole decode step of a preset on a device (real rows, real kernels): every running
    request offloaded (``free_block_watermark=1.0``: the host path), top-k from a locality
    trace (``locality`` of each selection repeated from the previous step's).

    Times, per step (medians): the eager step on the host clock and the device clock; on
    CUDA also the graph-replayed step (the decode forward captured once, replayed with a new
    plan each step) on both clocks, and the index groups' resolves alone replayed from the
    graph (see the module docstring). Also misses and bytes gathered per step. On a CPU
    device (the Triton interpreter) only a smoke run of the eager step makes sense.
    """
    from hisparse_triton.presets import get_preset
    from hisparse_triton.runtime import HiSparseRuntime
    from hisparse_triton.workload import TopkTrace, plan_for_workload

    geometry = get_preset(preset)
    spec = build_kv_cache_spec(geometry, num_layers=layers)
    top_k = geometry.index_topk
    max_len = prompt_len + steps * (distinct_steps + 4) + 64
    plan = plan_for_workload(spec, max_model_len=max_len, num_requests=batch, topk=top_k,
                             device_buffer_size=2 * top_k, prompt_len=prompt_len)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    rt = HiSparseRuntime(plan.kv_cache_config, plan.config, max_num_seqs=batch, device=dev,
                         backend="triton", free_block_watermark=1.0)
    try:
        scheduler, worker = rt.scheduler, rt.worker
        ids = [f"r{i}" for i in range(batch)]
        for rid in ids:
            rt.add_request(rid, prompt_len, max_len - prompt_len)
            rt.append_slots(rid, prompt_len)      # the prompt's KV bytes do not matter here
            rt.commit()
        leaders = scheduler.leaders
        trace = TopkTrace(top_k, locality, seed=0)
        selections = [{leader: torch.from_numpy(np.stack([
            trace.next((rid, leader), prompt_len) for rid in ids]).astype(np.int32)).to(dev)
            for leader in leaders} for _ in range(distinct_steps)]
        state_rows = torch.from_numpy(scheduler.state_rows(ids)).to(dev)

        def sync() -> None:
            _sync(dev)

        def eager_step(topk: dict) -> None:
            scheduler.append_decode(ids)
            step_plan = scheduler.step()
            worker.apply(step_plan)
            for leader in leaders:
                worker.resolve_rows(leader, state_rows, topk[leader])
            worker.mirror(step_plan)

        def timed(run_step, n: int) -> tuple[list[float], list[float]]:
            host, device_ms = [], []
            for i in range(n):
                sync()
                start = time.perf_counter()
                if cuda:
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                        enable_timing=True)
                    begin.record()
                run_step(i)
                host.append(time.perf_counter() - start)
                if cuda:
                    end.record()
                    sync()
                    device_ms.append(begin.elapsed_time(end))
            return host, device_ms

        for i in range(2):  # compile and warm
            eager_step(selections[i % distinct_steps])
        sync()
        before = worker.stats()
        host, device_ms = timed(lambda i: eager_step(selections[i % distinct_steps]), steps)
        after = worker.stats()
        median = statistics.median
        result: dict[str, Any] = {
            "preset": preset, "batch": batch, "prompt_len": prompt_len, "top_k": top_k,
            "device_buffer_size": 2 * top_k, "index_groups": len(leaders), "steps": steps,
            "locality": locality,
            "eager_step_host_ms": round(1e3 * median(host), 3),
            "eager_step_device_ms": round(median(device_ms), 3) if cuda else None,
            "misses_per_step": (after.misses - before.misses) / steps,
            "h2d_bytes_per_step": (after.h2d_bytes - before.h2d_bytes) / steps,
        }
        if cuda and device_ms:
            result["h2d_gbps_in_step"] = round(
                result["h2d_bytes_per_step"] / (result["eager_step_device_ms"] * 1e6), 2)
            result.update(_graph_step(worker, scheduler, ids, leaders, state_rows, selections,
                                      steps, timed))
        return result
    finally:
        rt.close()


def _graph_step(worker: Any, scheduler: Any, ids: list, leaders: tuple,
                state_rows: torch.Tensor, selections: list[dict], steps: int,
                timed: Any) -> dict[str, Any]:
    """``decode_step_device``'s CUDA-graph figures: the decode forward (every index group's
    ``resolve_rows``, gathers included) captured once and replayed, with the step's top-k
    picked inside the graph from the trace's selections by a device index (as a model's
    indexer writes them inside its own graph); the eager part around each replay is the
    plan (``append_decode``, ``step``, ``apply``), one small host -> device copy of the index
    and the ``mirror``."""
    stacked = {leader: torch.stack([sel[leader] for sel in selections])
               for leader in leaders}
    pick = torch.zeros(1, dtype=torch.int64, device=state_rows.device)
    pick_host = torch.zeros(1, dtype=torch.int64).pin_memory()

    def forward() -> None:
        for leader in leaders:
            topk = stacked[leader].index_select(0, pick)[0]
            worker.resolve_rows(leader, state_rows, topk)

    stream = torch.cuda.Stream(state_rows.device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):   # warm the captured shapes off the capture stream
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize(state_rows.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    distinct = len(selections)

    def graph_step(i: int) -> None:
        scheduler.append_decode(ids)
        step_plan = scheduler.step()
        worker.apply(step_plan)
        pick_host[0] = (i + 1) % distinct
        pick.copy_(pick_host, non_blocking=True)
        graph.replay()
        worker.mirror(step_plan)

    graph_step(0)   # warm
    host, device_ms = timed(graph_step, steps)
    replay: list[float] = []
    for i in range(steps):   # the resolves alone, replayed
        pick_host[0] = i % distinct
        pick.copy_(pick_host, non_blocking=True)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize(state_rows.device)
        replay.append(begin.elapsed_time(end))
    median = statistics.median
    return {"graph_step_host_ms": round(1e3 * median(host), 3),
            "graph_step_device_ms": round(median(device_ms), 3),
            "graph_resolves_ms": round(median(replay), 3),
            "graph_resolve_us_per_group": round(1e3 * median(replay) / len(leaders), 2)}


def overlap_step(device: torch.device, quick: bool, *, batch: int = 64,
                 prompt_len: int = 4096, layers: Optional[int] = None,
                 compute_n: int = 2048) -> dict[str, Any]:
    """A decode step with a stand-in compute kernel per index group, with and without the
    side-stream mode, with and without a gather grid budget (module docstring). On CPU a
    small smoke run (exactness of the modes is tested in tests/test_side_stream.py)."""
    from hisparse_triton.presets import build_kv_cache_spec, get_preset
    from hisparse_triton.runtime import HiSparseRuntime
    from hisparse_triton.workload import TopkTrace, plan_for_workload

    cuda = device.type == "cuda"
    if not cuda:
        batch, prompt_len, layers, compute_n = 2, 256, layers or 2, 64
    geometry = get_preset("deepseek-v3.2-fp8")
    spec = build_kv_cache_spec(geometry, num_layers=layers)
    top_k = geometry.index_topk if cuda else 64
    steps = 3 if quick else 6
    max_len = prompt_len + 2 * (2 * steps + 2) + 64
    plan = plan_for_workload(spec, max_model_len=max_len, num_requests=batch, topk=top_k,
                             device_buffer_size=2 * top_k, prompt_len=prompt_len)
    a = torch.randn(compute_n, compute_n, device=device,
                    dtype=torch.bfloat16 if cuda else torch.float32)
    results: dict[str, Any] = {"batch": batch, "prompt_len": prompt_len, "top_k": top_k,
                               "compute": f"one {compute_n}^2 matmul per index group"}
    rt = HiSparseRuntime(plan.kv_cache_config, plan.config, max_num_seqs=batch,
                         device=device, backend="triton" if cuda else "torch",
                         free_block_watermark=1.0)
    try:
        ids = [f"r{i}" for i in range(batch)]
        for rid in ids:
            rt.add_request(rid, prompt_len, max_len - prompt_len)
            rt.append_slots(rid, prompt_len)
            rt.commit()
        sched, worker = rt.scheduler, rt.worker
        leaders = sched.leaders
        trace = TopkTrace(top_k, 0.87, seed=0)
        state_rows = torch.from_numpy(sched.state_rows(ids)).to(device)
        side = torch.cuda.Stream(device) if cuda else torch.cpu.Stream()

        def step(overlap: bool) -> float:
            topk = {leader: torch.from_numpy(np.stack([
                trace.next((rid, leader), prompt_len) for rid in ids]).astype(
                    np.int32)).to(device) for leader in leaders}
            sched.append_decode(ids)
            step_plan = sched.step()
            worker.apply(step_plan)
            _sync(device)
            start = time.perf_counter()
            for leader in leaders:
                if overlap:
                    got = worker.resolve_rows(leader, state_rows, topk[leader], stream=side)
                    b = a @ a             # the layer's work that needs no gathered row
                    for layer in got.events:
                        got.wait(layer)   # attention reads the rows after this
                else:
                    worker.resolve_rows(leader, state_rows, topk[leader])
                    b = a @ a
                del b
            worker.mirror(step_plan)
            _sync(device)
            return (time.perf_counter() - start) * 1e3

        for budget in (0, 4):
            worker.set_gather_programs_per_sm(budget)
            for mode in (False, True):
                step(mode)  # warm: binds, compiles
            serial = [step(False) for _ in range(steps)]
            overlapped = [step(True) for _ in range(steps)]
            results[f"budget{budget}"] = {
                "gather_programs_per_sm": budget,
                "step_ms_serial": round(statistics.median(serial), 3),
                "step_ms_side_stream": round(statistics.median(overlapped), 3)}
    finally:
        rt.close()
    results["note"] = ("wall ms per step, synchronised; budget 0 = the copy kernel's own "
                       "grid (32 programs per SM), 4 = the default decode budget")
    return results
