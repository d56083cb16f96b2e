"""The side-stream mode of ``resolve_rows(..., stream=)`` and the gather grid budget.

On CPU the side-stream mode runs the same work in order (its events are ``HostEvent``
no-ops): rows, hot rows of every layer and counters must equal those of the plain call,
step by step, with both backends. A gather grid budget of any size (1 program per SM
included) must copy exactly what the default grid copies. Timing the overlap needs a GPU
(``bench --decode-step``, ``bench/gpu_check.py``).
"""

from __future__ import annotations

import pytest
import torch

from hisparse_triton.worker.hot_cache import HostEvent, StreamRows
from worker_helpers import TOPK, make_pair, prefill, write_rows

HAS_CUDA = torch.cuda.is_available()


def _run(backend: str, *, stream: bool, steps: int = 6, **worker_kwargs) -> list:
    """Prefill two requests, then decode ``steps`` steps resolving every index group;
    returns every step's rows, hot rows of every layer and counters."""
    scheduler, worker = make_pair(backend=backend, **worker_kwargs)
    gen = torch.Generator().manual_seed(3)
    for rid, n in (("a", 13), ("b", 9)):
        prefill(scheduler, worker, rid, n, gen)
    side = torch.cpu.Stream() if stream else None
    topk_gen = torch.Generator().manual_seed(7)
    trace = []
    try:
        for _ in range(steps):
            rows_w = {}
            for rid in ("a", "b"):
                rows_w.update(scheduler.append_slots(rid, 1))
            plan = scheduler.step()
            worker.apply(plan)
            write_rows(worker, rows_w, gen)
            state_rows = torch.from_numpy(scheduler.state_rows(["a", "b"]))
            lens = [scheduler.seq_len(r) for r in ("a", "b")]
            for leader in scheduler.leaders:
                topk = torch.stack([torch.randint(-1, n + 2, (TOPK,), generator=topk_gen)
                                    for n in lens]).to(torch.int32)
                got = worker.resolve_rows(leader, state_rows, topk, stream=side)
                if stream:
                    assert isinstance(got, StreamRows)
                    layers = worker.index_group(leader)
                    assert list(got.events) == list(layers)
                    for layer in layers:
                        got.wait(layer)
                        assert got.events[layer].query()
                    got = got.rows
                trace.append(got.clone())
                for layer in worker.index_group(leader):
                    trace.append(worker.device_cache(layer).clone())
            worker.mirror(plan)
            trace.append(worker._hot.counters.clone())
    finally:
        worker.close()
    return trace


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_side_stream_mode_is_exact_on_cpu(backend):
    _same(_run(backend, stream=False), _run(backend, stream=True))


def test_gather_grid_budget_is_exact_for_any_budget():
    base = _run("triton", stream=False, steps=3, gather_programs_per_sm=0)
    for budget in (1, 4):
        _same(base, _run("triton", stream=False, steps=3, gather_programs_per_sm=budget))
    _same(base, _run("triton", stream=True, steps=3, gather_programs_per_sm=1))


def test_launch_shape_respects_the_budget():
    from hisparse_triton.kernels import gather
    from test_copy_reference import make_table

    src = make_table(6, 656, 6, layout="host", seed=1, device="cpu")
    dst = make_table(6, 656, 4, layout="device", seed=2, device="cpu")
    for per_sm in (1, 2, 4):
        shape = gather.launch_shape(dst, src, 64, 2048, pages=False, kernel="gather",
                                    programs_per_sm=per_sm)
        assert shape.grid[0] * shape.grid[1] <= per_sm * gather.DEFAULT_SM_COUNT
    free = gather.launch_shape(dst, src, 64, 2048, pages=False, kernel="gather")
    assert free.grid[0] * free.grid[1] > 4 * gather.DEFAULT_SM_COUNT


def test_bad_stream_and_budget_are_refused():
    scheduler, worker = make_pair(backend="torch")
    try:
        topk = torch.zeros(1, TOPK, dtype=torch.int32)
        rows = torch.tensor([-1], dtype=torch.int32)
        with pytest.raises(ValueError, match="stream must be"):
            worker.resolve_rows(scheduler.leaders[0], rows, topk, stream="side")
    finally:
        worker.close()
    with pytest.raises(ValueError, match="gather_programs_per_sm"):
        make_pair(backend="torch", gather_programs_per_sm=-1)


def test_host_event_has_the_cuda_event_api():
    event = HostEvent()
    event.record()
    event.wait()
    event.synchronize()
    assert event.query()
    for name in ("record", "wait", "query", "synchronize"):
        assert hasattr(torch.cuda.Event, name)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device: the side stream's overlap and "
                                         "graph capture")
def test_side_stream_mode_captures_in_a_cuda_graph():
    from hisparse_triton.scheduler import HiSparseScheduler
    from hisparse_triton.worker import HiSparseWorker
    from worker_helpers import make_plan

    plan = make_plan(2)
    scheduler = HiSparseScheduler(plan.kv_cache_config, plan.config, max_num_seqs=2,
                                  free_block_watermark=1.0)
    worker = HiSparseWorker(plan.kv_cache_config, plan.config, max_num_seqs=2,
                            device="cuda", backend="triton")
    try:
        gen = torch.Generator().manual_seed(3)
        prefill(scheduler, worker, "a", 13, gen)
        side = torch.cuda.Stream(worker.device)
        state_rows = torch.from_numpy(scheduler.state_rows(["a"])).to(worker.device)
        topk = torch.arange(TOPK, dtype=torch.int32, device=worker.device)[None]
        leader = scheduler.leaders[0]
        plain = worker.resolve_rows(leader, state_rows, topk).clone()
        worker.resolve_rows(leader, state_rows, topk, stream=side)  # warm: events
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = worker.resolve_rows(leader, state_rows, topk, stream=side)
            for layer in got.events:
                got.wait(layer)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got.rows, plain)
    finally:
        worker.close()


@pytest.mark.parametrize("budget,sms", [(1, 1), (1, 2), (3, 1)])
def test_bound_copy_with_a_tiny_budget_copies_exactly(monkeypatch, budget, sms):
    """A budget below the work items (and below the layer groups): one to a few programs
    walk everything grid-stride, each over several layers."""
    from hisparse_triton.kernels import gather
    from hisparse_triton.tuning import CopyConfig
    from test_copy_reference import make_table, random_plan, run_reference

    monkeypatch.setattr(gather, "sm_count", lambda device: sms)
    src = make_table(3, 132, 6, layout="host", seed=4, device="cpu")
    dst = make_table(3, 132, 8, layout="device", seed=5, device="cpu")
    s, d, c = random_plan(3, 3, 9, src.num_rows, dst.num_rows, mode="per_layer", seed=6,
                          device="cpu")
    expected = run_reference(dst, src, s, d, c, pages=False)
    config = CopyConfig(rows_per_program=2, layers_per_program=1, chunk_bytes=64)
    shape = gather.launch_shape(dst, src, 3, 9, pages=False, kernel="gather", config=config,
                                programs_per_sm=budget)
    assert shape.grid[0] * shape.grid[1] <= budget * sms
    bound = gather.BoundCopy(dst, src, pages=False, kernel="gather", config=config,
                             programs_per_sm=budget)
    bound(s, d, c)
    assert torch.equal(dst.pool, expected)


def test_split_gather_needs_a_process_group():
    with pytest.raises(ValueError, match="process group"):
        make_pair(backend="torch", split_gather=True)
    with pytest.raises(ValueError, match="split_gather must be a bool"):
        make_pair(backend="torch", split_gather="yes")


def test_decode_checks_record_each_sections_error(monkeypatch):
    """``bench/gpu_check.py``'s decode checks: on CPU the GPU sections skip with a reason,
    the overlap step runs a smoke step, and a section that raises is recorded, not fatal."""
    from lab import decode_checks

    def broken(device, quick):
        raise RuntimeError("boom")

    monkeypatch.setitem(decode_checks.SECTIONS, "resolve_variants", broken)
    report = decode_checks.run_checks("cpu", quick=True)
    sections = report["sections"]
    assert set(sections) == set(decode_checks.SECTIONS)
    assert "boom" in sections["resolve_variants"]["error"]
    assert "skipped" in sections["launch_path"] and "skipped" in sections["split_gather"]
    assert sections["overlap_step"]["budget4"]["step_ms_side_stream"] > 0
