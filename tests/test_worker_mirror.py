"""``HostMirror``: a plan's new rows device -> host, one copy per row size.

The mirror sets are built from a real plan's groups and pools; the copy is either recorded
(what is asked of it) or the reference copy (what lands in the host pool).
"""

from __future__ import annotations

import torch

from hisparse_triton.worker import hot_cache
from hisparse_triton.worker.mirror import HostMirror
from worker_helpers import make_pair, write_rows

GEN = torch.Generator().manual_seed(4)


def _planned(n: int = 10):
    """A pair whose first plan (request ``a``, ``n`` prompt tokens) is applied and whose KV
    is written; returns ``(scheduler, worker, plan, rows)``."""
    scheduler, worker = make_pair()
    scheduler.add_request("a", n, 4)
    rows = scheduler.append_slots("a", n)
    plan = scheduler.step()
    worker.apply(plan)
    write_rows(worker, rows, GEN)
    return scheduler, worker, plan, rows


def test_one_set_per_row_size_covers_every_source_layer_once():
    scheduler, worker, _, _ = _planned()
    with worker:
        mirror = worker._mirror
        layers = [layer for s in mirror.sets for layer in s.layers]
        assert sorted(layers) == sorted(scheduler.source_layers)
        assert len({s.row_bytes for s in mirror.sets}) == len(mirror.sets)
        resident = [g.position for g in worker.groups.resident]
        for mset in mirror.sets:
            positions = [resident[i] for i in mset.resident_of_layer.tolist()]
            assert positions == [worker.groups.resident_of_layer[x] for x in mset.layers]
        assert len(mirror.tables) == 2 * len(mirror.sets)


def test_the_copy_is_asked_for_the_planned_rows_of_every_layer():
    _, worker, plan, _ = _planned()
    with worker:
        calls = []
        mirror = HostMirror.build(worker.groups, worker._layers,
                                  lambda *args, **kwargs: calls.append((args, kwargs)),
                                  backend="auto")
        moved = mirror.copy(plan, worker._tables.packed())
        assert len(calls) == len(mirror.sets)
        for (args, kwargs), mset in zip(calls, mirror.sets):
            dst_table, src_table, src, dst = args
            assert (dst_table, src_table) == (mset.host_table, mset.device_table)
            assert kwargs == {"backend": "auto"}
            L, n = len(mset.layers), plan.num_mirror
            assert src.shape == dst.shape == (L, 1, n)
            device_rows = torch.from_numpy(plan.mirror_device_rows)
            for i, g in enumerate(mset.resident_of_layer.tolist()):
                assert src[i, 0].tolist() == device_rows[g].tolist()
                assert dst[i, 0].tolist() == plan.mirror_host_rows.tolist()
        expected = sum(plan.num_mirror * len(s.layers) * s.row_bytes for s in mirror.sets)
        assert moved == expected > 0 and mirror.d2h_bytes == 0   # the caller counts it
        assert mirror.counted(plan.step, moved) == (expected, (plan.step, expected))


def test_mirrored_rows_land_in_the_host_pool():
    scheduler, worker, plan, rows = _planned(13)
    with worker:
        mirror = HostMirror.build(worker.groups, worker._layers, hot_cache.copy_rows,
                                  backend="torch")
        mirror.copy(plan, worker._tables.packed())
        host_rows = plan.mirror_host_rows.tolist()
        for layer in scheduler.source_layers:
            device = worker.device_cache(layer)
            ids = torch.as_tensor(rows[layer], dtype=torch.int64)
            written = device[ids // device.shape[1], ids % device.shape[1]]
            host = worker.host_cache(layer).reshape(-1, device.shape[2])
            assert torch.equal(host[host_rows], written), layer


def test_a_plan_without_mirror_rows_copies_nothing():
    scheduler, worker, plan, _ = _planned()
    with worker:
        worker.mirror(plan)
        empty = scheduler.step()
        assert empty.num_mirror == 0
        worker.apply(empty)
        calls = []
        mirror = HostMirror.build(worker.groups, worker._layers,
                                  lambda *args, **kwargs: calls.append(args), backend=None)
        mirror.copy(empty, worker._tables.packed())
        assert calls == [] and mirror.d2h_bytes == 0
