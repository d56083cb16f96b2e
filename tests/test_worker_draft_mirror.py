"""Draft layers (a drafter's attention layers, written after the main forward) are mirrored
by their own call, once their KV is there; the next plan waits for both parts."""

from __future__ import annotations

import pytest
import torch

from tests.worker_helpers import make_pair, write_rows

#: The last sparse layer stands in for an MTP block's attention.
DRAFT = "model.layers.3.self_attn.attn"


def planned(draft_layers=()):
    scheduler, worker = make_pair(max_num_seqs=2, draft_layers=draft_layers)
    scheduler.add_request("a", 10, 4)
    rows = scheduler.append_slots("a", 10)
    plan = scheduler.step()
    worker.apply(plan)
    return scheduler, worker, plan, rows


def host_rows_of(worker, plan, layer):
    host = worker.host_cache(layer)
    return host.reshape(-1, host.shape[2])[torch.from_numpy(plan.mirror_host_rows).long()]


def device_rows_of(worker, rows, layer):
    cache = worker.device_cache(layer)
    ids = torch.as_tensor(rows[layer], dtype=torch.int64)
    return cache[ids // cache.shape[1], ids % cache.shape[1]]


def test_draft_layers_are_mirrored_after_the_drafter_and_the_next_plan_waits():
    scheduler, worker, plan, rows = planned(draft_layers=[DRAFT])
    draft = DRAFT
    assert worker.draft_layers == {DRAFT} and DRAFT == worker.groups.source_layers[-1]
    gen = torch.Generator().manual_seed(0)
    with worker:
        main = {k: v for k, v in rows.items() if k != draft}
        write_rows(worker, main, gen)                 # the main forward
        worker.mirror()
        for layer in main:
            if layer in worker.groups.source_layers:
                assert torch.equal(host_rows_of(worker, plan, layer),
                                   device_rows_of(worker, rows, layer))
        scheduler.append_slots("a", 1)
        following = scheduler.step()
        with pytest.raises(ValueError, match=r"StepPlan 1 has draft-layer mirror rows that "
                                             r"were never mirrored: call mirror\(draft=True\)"):
            worker.apply(following)
        write_rows(worker, {draft: rows[draft]}, gen)  # the drafter writes its KV
        worker.mirror(draft=True)
        assert torch.equal(host_rows_of(worker, plan, draft),
                           device_rows_of(worker, rows, draft))
        per_row = sum(len(s.layers) * s.row_bytes for s in worker._mirror.sets)
        assert worker.stats().d2h_bytes == plan.num_mirror * per_row
        worker.mirror(draft=True)                     # done: nothing more
        worker.mirror()
        worker.apply(following)


def test_one_mirror_before_the_drafter_would_leave_stale_draft_rows():
    """Why the split exists: without it, the draft layer's host rows are copied before the
    drafter wrote them."""
    scheduler, worker, plan, rows = planned()
    draft = DRAFT
    gen = torch.Generator().manual_seed(0)
    with worker:
        write_rows(worker, {k: v for k, v in rows.items() if k != draft}, gen)
        worker.mirror()
        write_rows(worker, {draft: rows[draft]}, gen)
        assert not torch.equal(host_rows_of(worker, plan, draft),
                               device_rows_of(worker, rows, draft))


def test_a_reverted_plan_takes_back_both_parts():
    scheduler, worker, plan, rows = planned(draft_layers=[DRAFT])
    with worker:
        before = worker.stats().d2h_bytes
        worker.mirror()
        worker.mirror(draft=True)
        assert worker.stats().d2h_bytes > before
        worker.revert(plan)
        assert worker.stats().d2h_bytes == before and worker._tables.parts_due == frozenset()


def test_draft_layer_arguments_are_checked():
    _, worker, _, _ = planned()
    with worker:
        with pytest.raises(ValueError, match="this worker has no draft layers"):
            worker.mirror(draft=True)
    with pytest.raises(ValueError, match="'nope' is not a sparse"):
        make_pair(draft_layers=["nope"])
    with pytest.raises(ValueError, match="a sequence of layer names"):
        make_pair(draft_layers=DRAFT)


def test_faults_in_either_mirror_part_change_nothing():
    from tests.fault_points import sweep

    scheduler, worker, plan, rows = planned(draft_layers=[DRAFT])
    with worker:
        def state():
            return worker._debug_snapshot(), worker.stats()

        assert sweep(worker.mirror, state) > 3
        assert worker._tables.parts_due == {True}
        assert sweep(lambda: worker.mirror(draft=True), state) > 3
        assert worker._tables.mirror_due is None
