"""A failing call changes nothing, counters included: faults injected at every line point of
``apply``, ``mirror`` and ``resolve_rows`` (and of the facade's ``commit``) leave the whole
snapshot (tables, hot state, device counters, ``d2h_bytes``, plans applied, the mirror due)
exactly as before; the call then succeeds and counts once."""

from __future__ import annotations

import pytest
import torch

from tests.fault_points import sweep

#: The worker's own modules that the facade's calls run through.
FACADE_CALLS = tuple(f"/hisparse_triton/worker/{name}.py"
                     for name in ("worker", "tables", "mirror"))
from tests.worker_helpers import L0, TOPK, make_pair, prefill, write_rows


def worker_state(worker):
    return worker._debug_snapshot(), worker.stats()


@pytest.fixture(params=["torch", "triton"])
def warm(request):
    scheduler, worker = make_pair(max_num_seqs=2, backend=request.param)
    gen = torch.Generator().manual_seed(0)
    prefill(scheduler, worker, "a", 20, gen)
    prefill(scheduler, worker, "b", 13, gen)
    yield scheduler, worker, gen
    worker.close()


def test_faults_in_apply_and_mirror_change_nothing(warm):
    scheduler, worker, gen = warm
    scheduler.free_request("b")
    scheduler.add_request("c", 6, 4)
    rows = scheduler.append_slots("c", 6)
    scheduler.append_slots("a", 1)
    plan = scheduler.step()
    assert plan.num_resets and plan.num_mirror
    points = sweep(lambda: worker.apply(plan), lambda: worker_state(worker))
    assert points > 20 and worker._tables.applied == plan.step
    write_rows(worker, rows, gen)
    before = worker.stats().d2h_bytes
    points = sweep(lambda: worker.mirror(plan), lambda: worker_state(worker))
    assert points > 5
    expected = plan.num_mirror * sum(len(s.layers) * s.row_bytes for s in worker._mirror.sets)
    assert worker.stats().d2h_bytes - before == expected      # counted once
    assert worker._tables.mirror_due is None


def test_faults_in_resolve_rows_change_nothing(warm):
    scheduler, worker, _ = warm
    row = scheduler.state_row("a")
    state_rows = torch.tensor([row, -1], dtype=torch.int32)
    topk = torch.arange(0, 2 * TOPK, 2, dtype=torch.int32).repeat(2, 1)
    before = worker.stats()
    points = sweep(lambda: worker.resolve_rows(L0, state_rows, topk),
                   lambda: worker_state(worker))
    assert points > 5
    after = worker.stats()      # counted once, by the run that completed
    assert (after.hits + after.misses) - (before.hits + before.misses) == TOPK
    assert after.masked == before.masked          # the padding row counts nothing


def test_a_reverted_plan_takes_its_mirrored_bytes_back(warm):
    scheduler, worker, gen = warm
    scheduler.append_slots("a", 1)
    plan = scheduler.step()
    before = worker_state(worker)
    worker.apply(plan)
    worker.mirror(plan)
    assert worker.stats().d2h_bytes > before[1].d2h_bytes
    worker.revert(plan)
    assert worker_state(worker) == before
    worker.apply(plan)                              # the retry counts the rows once
    worker.mirror()
    assert worker.stats().d2h_bytes - before[1].d2h_bytes == plan.num_mirror * sum(
        len(s.layers) * s.row_bytes for s in worker._mirror.sets)


def test_faults_in_the_facades_commit_change_nothing():
    """The in-process facade's ``commit()`` (the step's plan handed over, the tokens made
    durable, the mirror) under a fault at every line point of the worker's apply, mirror and
    revert (their inner points are swept above), through the facade's public API only."""
    from hisparse_triton.runtime import HiSparseRuntime
    from tests.worker_helpers import make_plan

    plan = make_plan(max_num_seqs=2)
    gen = torch.Generator().manual_seed(2)
    with HiSparseRuntime(plan.kv_cache_config, plan.config, max_num_seqs=2, device="cpu",
                         backend="torch", free_block_watermark=1.0) as rt:
        rt.add_request("a", 20, 8)
        rt.add_request("b", 9, 8)
        for rid, n in (("a", 20), ("b", 9)):
            rows = rt.append_slots(rid, n)
            write_rows(rt.worker, {k: v.numpy() for k, v in rows.items()}, gen)
        # (nothing resolved: commit hands the appends over in the step's one plan)

        def state():
            return rt._debug_snapshot(), rt.stats()

        points = sweep(rt.commit, state, where=FACADE_CALLS)
        assert points > 50
        assert rt.stats().d2h_bytes > 0 and rt.stats().plans == 1
