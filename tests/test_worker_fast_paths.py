"""The decode path's fast paths agree with the general code they stand in for.

``StepPlan.check``'s vectorised test (``_tables_fit`` against the entry-by-entry ``_check_tables``), the mirror's
views of the packed plan (a gather per set, a view for a set of one resident group), the
staging ring handing back its last upload and ``mirror(plan)``'s comparison of the data.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from hisparse_triton.step_plan import PlanLimits, StepPlan, TableLayout
from hisparse_triton.worker.mirror import HostMirror, MirrorSet
from hisparse_triton.worker.tables import StagingRing, _same_values
from worker_helpers import make_pair

S, B, ND, NH = 3, 4, 10, 10
LAYOUT = TableLayout(max_num_seqs=S, width=8, host_col=1, host_width=3, group_cols=(4, 6),
                     group_widths=(2, 2))
LIMITS = PlanLimits(layout=LAYOUT, max_model_len=12, block_size=B, num_device_blocks=ND,
                    num_host_blocks=NH, resident=(0, 1))


def _plan(step: int = 1, *, resets=(), index=(), values=(), host=(), device=None,
          lost=None, invalidate=None) -> StepPlan:
    device = np.zeros((2, 0)) if device is None else np.asarray(device).reshape(2, -1)
    return StepPlan.build(step=step, layout=LAYOUT.fingerprint, commit=bool(len(host)),
                          reset_rows=list(resets), write_index=list(index),
                          write_value=list(values), mirror_host_rows=list(host),
                          mirror_device_rows=device,
                          lost=np.zeros((0, 3)) if lost is None else lost,
                          invalidate=invalidate)


def _random_plan(rng: np.random.Generator) -> StepPlan:
    """Sections of random sizes whose values are mostly valid, sometimes out of range or
    repeated, in order or shuffled."""
    def pick(n, lo, hi, slack):
        values = rng.integers(lo - slack, hi + slack, n) if rng.random() < 0.3 else \
            rng.choice(np.arange(lo, hi), min(n, hi - lo), replace=False)
        if rng.random() < 0.5:
            values = np.sort(values)
        if len(values) > 1 and rng.random() < 0.1:
            values[-1] = values[0]
        return values

    resets = pick(int(rng.integers(0, 3)), 0, S, 1)
    index = pick(int(rng.integers(0, 8)), 0, LAYOUT.num_entries, 2)
    bounds = LIMITS.column_bounds[np.clip(index, 0, None) % LAYOUT.width]
    values = rng.integers(0, bounds) if len(index) else np.zeros(0, np.int64)
    if len(index) and rng.random() < 0.3:
        values[rng.integers(len(values))] = rng.choice([-1, -2**31, 2**31 - 1, 13, ND, NH])
    host = pick(int(rng.integers(0, 5)), B, NH * B, 3)
    device = rng.integers(B, ND * B, (2, len(host)))
    if len(host) and rng.random() < 0.2:
        device[rng.integers(2), rng.integers(len(host))] = rng.choice([0, B - 1, ND * B, -1])
    return _plan(resets=resets, index=index, values=values, host=host, device=device)


def test_the_vectorised_check_agrees_with_the_entry_by_entry_one():
    rng = np.random.default_rng(3)
    outcomes = set()
    for _ in range(1500):
        plan = _random_plan(rng)
        try:
            plan._check_tables(LIMITS)
            expected = None
        except ValueError as exc:
            expected = str(exc)
        assert plan._tables_fit(LIMITS) == (expected is None)
        try:
            plan.check(LIMITS)
            got = None
        except ValueError as exc:
            got = str(exc)
        assert got == expected
        outcomes.add(expected is None)
    assert outcomes == {True, False}


def test_lost_and_invalidate_are_checked_after_the_tables():
    lost = _plan(index=[3], values=[99], lost=np.array([[S, 0, 0]]))
    with pytest.raises(ValueError, match=r"write_value\[0\] = 99"):
        lost.check(LIMITS)
    with pytest.raises(ValueError, match=r"lost state rows \(column 0\) holds 3"):
        _plan(index=[3], values=[1], lost=np.array([[S, 0, 0]])).check(LIMITS)
    with pytest.raises(ValueError, match=r"invalidate\[0\] is host rows \[8, 4\)"):
        _plan(invalidate=np.array([[0, 8, 4]])).check(LIMITS)


def test_the_staging_ring_hands_back_its_last_upload():
    ring = StagingRing(torch.device("cpu"))
    first, second = np.arange(5, dtype=np.int32), np.arange(3, 9, dtype=np.int32)
    data = ring.upload(first)
    assert ring.last(first) is data
    ring.upload(second)
    assert ring.last(first).tolist() == first.tolist()      # not the last: its own array
    assert ring.last(second).tolist() == second.tolist()


def test_mirror_plan_data_is_compared_like_array_equal():
    a = np.arange(6, dtype=np.int32)
    cases = [(a, a.copy()), (a, a[::-1].copy()), (a, a.astype(np.int64)),
             (a, a.astype(np.float64)), (a, a.reshape(2, 3)), (a, a[:5].copy()),
             (np.array([0.0]), np.array([-0.0]))]
    for x, y in cases:
        assert _same_values(x, y) == bool(np.array_equal(x, y))


def test_mirror_sets_read_the_packed_plan_by_view_or_by_gather():
    """A set whose layers share one resident group reads its source rows as a view (layer
    stride 0); any other set gathers them. Both hand the copy the planned rows."""
    _, worker = make_pair()
    with worker:
        plan = StepPlan.build(step=1, layout=0, commit=True, reset_rows=[9],
                              write_index=[1, 2], write_value=[3, 4],
                              mirror_host_rows=[40, 41, 42],
                              mirror_device_rows=[[10, 11, 12], [20, 21, 22], [30, 31, 32]],
                              lost=np.zeros((0, 3)))
        packed = torch.from_numpy(np.r_[np.int32(-7), plan.data])[1:]   # storage offset 1
        tables = worker._mirror.sets[0]
        layers = tables.layers[:2]
        sets = [MirrorSet(layers, tables.row_bytes, torch.tensor(rows), tables.device_table,
                          tables.host_table)
                for rows in ([2, 2], [2, 0])]
        assert [s.one_resident for s in sets] == [2, None]
        calls = []
        mirror = HostMirror(sets, lambda *args, **kwargs: calls.append(args), backend=None)
        assert mirror.copy(plan, packed) == 2 * 3 * 2 * tables.row_bytes
        for (_, _, src, dst), rows in zip(calls, ([2, 2], [2, 0])):
            assert src.shape == dst.shape == (2, 1, 3) and dst.stride()[0] == 0
            assert src.tolist() == [[plan.mirror_device_rows[g].tolist()] for g in rows]
            assert dst.tolist() == [[[40, 41, 42]]] * 2
        assert calls[0][2].stride()[0] == 0 and calls[1][2].stride()[0] != 0


def test_a_set_of_one_resident_group_lands_its_rows_in_the_host_pool():
    """The view path with the reference copy: the rows of every layer reach the host."""
    from hisparse_triton.worker import hot_cache
    from tests.worker_helpers import write_rows

    scheduler, worker = make_pair()
    with worker:
        scheduler.add_request("a", 13, 4)
        rows = scheduler.append_slots("a", 13)
        plan = scheduler.step()
        worker.apply(plan)
        write_rows(worker, rows, torch.Generator().manual_seed(5))
        resident = [g.position for g in worker.groups.resident]
        layers = tuple(x for x in scheduler.source_layers
                       if worker.groups.resident_of_layer[x] == resident[0])
        device_table, host_table, row_bytes = worker._layers.row_tables(list(layers))
        mset = MirrorSet(layers, row_bytes, torch.zeros(len(layers), dtype=torch.int64),
                         device_table, host_table)
        assert len(layers) > 1 and mset.one_resident == 0
        HostMirror([mset], hot_cache.copy_rows, backend="torch").copy(
            plan, worker._tables.packed())
        host_rows = plan.mirror_host_rows.tolist()
        for layer in layers:
            device = worker.device_cache(layer)
            ids = torch.as_tensor(rows[layer], dtype=torch.int64)
            written = device[ids // device.shape[1], ids % device.shape[1]]
            host = worker.host_cache(layer).reshape(-1, device.shape[2])
            assert torch.equal(host[host_rows], written), layer
