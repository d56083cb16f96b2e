"""The scheduler's memoised and packed decode paths against the general code (no torch).

``tracking_in_order`` keeps which ``in_order`` requests track ids; ``PlanBuilder`` packs a
plan's data in one go (``_packed``) instead of ``StepPlan.build``; the coordinator gathers a
batch's rows with one flat ``take``. Random workloads that repeat one batch (the same id
objects, the way a serving loop decodes) must give the same results, errors, plans (byte
for byte) and state as the one-by-one reference, also across failed and rolled-back calls;
a fault at any line inside a transaction changes nothing.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from tests.fault_points import sweep
from hisparse_triton.scheduler.coordinator import _consecutive_rows
from hisparse_triton.scheduler.journal import Journal
from hisparse_triton.scheduler.plan_builder import PlanBuilder
from hisparse_triton.step_plan import StepPlan, TableLayout
from test_scheduler_batch_paths import (
    BATCH_PATHS,
    CONFIGS,
    call,
    columns_state,
    in_transaction,
    make,
    reference,
    three_running,
)


# -- PlanBuilder._packed against StepPlan.build -------------------------------------------
LAYOUT = TableLayout(max_num_seqs=4, width=12, host_col=1, host_width=4, group_cols=(5, 8),
                     group_widths=(3, 4))


def _queue(builder: PlanBuilder, rng: random.Random) -> None:
    for _ in range(rng.randint(0, 12)):
        row, x = rng.randrange(4), rng.random()
        if x < 0.3:
            builder.write_seq_len(row, rng.randint(0, 40))
        elif x < 0.5:
            rows = np.array(rng.sample(range(4), rng.randint(1, 4)), dtype=np.int64)
            builder.write_seq_lens(rows, rows * 3 + rng.randint(0, 9))
        elif x < 0.7:
            builder.write_blocks(row, rng.randrange(2), 0, [rng.randint(1, 50)])
        elif x < 0.8:
            builder.reset_row(row)
        elif x < 0.9:
            builder.lose(row, 1, rng.randrange(4))
        else:
            builder.invalidate(row, [(rng.randint(0, 9), rng.randint(9, 20))])


def _general(builder: PlanBuilder, host, device, commit: bool, released: int) -> StepPlan:
    """What ``build`` made of the same queue before: ``StepPlan.build`` of its sections."""
    return StepPlan.build(
        step=builder.step + 1, layout=LAYOUT.fingerprint, commit=commit,
        reset_rows=np.fromiter(builder._resets, dtype=np.int32, count=len(builder._resets)),
        write_index=np.fromiter(builder._writes.keys(), dtype=np.int32,
                                count=len(builder._writes)),
        write_value=np.fromiter(builder._writes.values(), dtype=np.int32,
                                count=len(builder._writes)),
        mirror_host_rows=host, mirror_device_rows=device,
        lost=np.asarray(builder._lost, dtype=np.int32).reshape(-1, 3),
        released_pages=released,
        invalidate=np.asarray(builder._invalidate, dtype=np.int32).reshape(-1, 3))


@pytest.mark.parametrize("seed", range(40))
def test_a_packed_plan_is_the_plan_step_plan_build_makes(seed):
    rng = random.Random(seed)
    builder = PlanBuilder(LAYOUT, Journal())
    for _ in range(4):
        _queue(builder, rng)
        m, g = rng.randint(0, 5), rng.randint(0, 3)
        dtype = rng.choice([np.int32, np.int64])
        big = 2**33 if rng.random() < 0.2 else 0     # past int32: converted the same way
        host = np.array([rng.randint(0, 99) + big for _ in range(m)], dtype=np.int64
                        ).astype(dtype)
        device = np.array([[rng.randint(0, 99) for _ in range(m)] for _ in range(g)],
                          dtype=np.int64).reshape(g, m).astype(dtype)
        commit, released = rng.random() < 0.5, rng.randint(0, 3)
        before = builder.snapshot()
        expected = _outcome(lambda: _general(builder, host, device, commit, released))
        got = _outcome(lambda: builder.build(commit=commit, mirror_host_rows=host,
                                             mirror_device_rows=device,
                                             released_pages=released))
        assert got == expected
        if isinstance(got, bytes):
            assert not builder.has_pending_changes and builder.step == before[-1] + 1
        else:   # refused (mirror rows without resident groups): nothing changed
            assert builder.snapshot() == before


def _outcome(build) -> object:
    """The plan's bytes (its int fields plain ints), or the error."""
    try:
        plan = build()
    except (ValueError, TypeError) as exc:
        return (type(exc), str(exc))
    assert all(type(getattr(plan, f)) is int for f in ("num_mirror", "num_resident", "step"))
    return plan.to_bytes()


@pytest.mark.parametrize("host, device", [
    (np.zeros(2, np.int32), np.zeros((1, 3), np.int32)),     # m disagrees
    (np.zeros(2, np.int32), np.zeros(2, np.int32)),          # device rows not 2-D
    ([1, 2], np.zeros((1, 2), np.int32)),                    # not arrays
    (np.zeros(2, np.float64), np.zeros((1, 2), np.int32)),   # not integers
])
def test_anything_but_integer_sections_takes_step_plan_build(host, device):
    builder = PlanBuilder(LAYOUT, Journal())
    builder.write_seq_len(1, 5)
    expected = _outcome(lambda: _general(builder, host, device, False, 0))
    assert _outcome(lambda: builder.build(commit=False, mirror_host_rows=host,
                                          mirror_device_rows=device,
                                          released_pages=0)) == expected


# -- the coordinator's gathers -------------------------------------------------------------
def test_consecutive_rows_are_a_view_and_others_are_not():
    flat = np.arange(24, dtype=np.int32).reshape(4, 6)
    view = _consecutive_rows(flat, np.array([1, 2, 3]))
    assert view is not None and np.shares_memory(view, flat) and view.shape == (3, 6)
    assert _consecutive_rows(flat, np.array([0, 2])) is None
    assert _consecutive_rows(flat, np.zeros(0, np.int64)) is None
    assert _consecutive_rows(None, np.array([0])) is None


@pytest.mark.parametrize("config", [dict(full=True), dict(full=True, window=True), dict()])
def test_resident_rows_by_view_by_gather_and_one_manager_at_a_time_agree(config):
    s = make(max_num_seqs=3, **config)
    for rid, n in (("a", 9), ("b", 14), ("c", 3)):
        s.add_request(rid, n, 4)
        s.append_slots(rid, n)
    d = s.devices
    rows = np.array([s._requests[r].row for r in "cab"], dtype=np.int64)
    positions = np.array([s._requests[r].seq_len - 1 for r in "cab"], dtype=np.int64)
    one_by_one = np.stack([m.decode_rows(rows, positions) for m in d.resident])
    assert d.resident_decode_rows(rows, positions).tolist() == one_by_one.tolist()
    d._flat_resident = None                      # the gather of every group, then a selection
    assert d.resident_decode_rows(rows, positions).tolist() == one_by_one.tolist()
    assert d.decode_rows(rows, positions).tolist() == np.stack(
        [m.decode_rows(rows, positions) for m in d.paged]).tolist()


# -- a repeated batch -------------------------------------------------------------------------
def _repeating_op(rng: random.Random, s, names: list[str], batches: list[list[str]]) -> tuple:
    """Mostly the same batch again (the very list, or a copy: the same id objects), with
    admissions, frees, appends, steps and failing calls in between."""
    live = [r for r in names if s.has_request(r)]
    x = rng.random()
    if x < 0.45 and batches:
        batch = rng.choice(batches)
        return ("append_decode", (batch if rng.random() < 0.5 else list(batch), None))
    if x < 0.52:
        batch = rng.sample(live, rng.randint(0, len(live)))
        if rng.random() < 0.1 and batch:
            batch.append(batch[0])               # a duplicate: the general path's error
        batches.append(batch)
        del batches[:-3]
        return ("append_decode", (batch, None))
    if x < 0.6:
        pick = rng.choice(names)
        return ("add_request", (pick, rng.randint(1, 20), rng.randint(0, 30), None))
    if x < 0.66:
        return ("free_request", (rng.choice(names),))
    if x < 0.72 and live:
        return ("append_slots", (rng.choice(live), rng.randint(1, 9)))
    if x < 0.9:
        return ("step", ())
    return ("flush", ()) if x < 0.95 else ("commit_mirrors", ())


def _in_failed_transaction(s, op: tuple):
    """``op`` inside a transaction that then fails: every change rolled back."""
    try:
        with s.journal.transaction():
            out = call(s, op)
            raise KeyError("roll back")
    except KeyError:
        return out


@pytest.mark.parametrize("config", CONFIGS)
def test_a_repeated_batch_agrees_with_the_one_by_one_path(config):
    names = [f"r{i}" for i in range(6)]
    for seed in range(5):
        fast, slow = make(**config), reference(make(**config))
        rng, batches = random.Random(seed), []
        for _ in range(150):
            op = _repeating_op(rng, fast, names, batches)
            run = _in_failed_transaction if rng.random() < 0.1 else call
            assert run(fast, op) == run(slow, op), (seed, op)
            assert fast._debug_snapshot() == slow._debug_snapshot(), (seed, op)
            assert columns_state(fast) == columns_state(slow), (seed, op)
        fast.check_invariants()
        assert fast.stats() == slow.stats()


def test_tracking_in_order_follows_admissions_with_token_ids():
    s = make(max_num_seqs=3)
    s.add_request("a", 5, 20)
    assert s._requests.tracking_in_order() is None
    s.add_request("t", 5, 20, token_ids=list(range(5)))
    assert s._requests.tracking_in_order().tolist() == [False, True]
    with pytest.raises(KeyError):
        with s.journal.transaction():
            s.free_request("t")
            assert s._requests.tracking_in_order() is None
            raise KeyError("roll back")
    assert s._requests.tracking_in_order().tolist() == [False, True]


@pytest.mark.parametrize("watermark", [0.1, 1.0])
def test_a_fault_anywhere_in_a_repeated_batch_changes_nothing(watermark):
    s = three_running(watermark)
    batch = ["c", "a", "b"]
    for _ in range(3):                           # the kept batch, page starts, releases
        assert sweep(in_transaction(s, lambda: s.append_decode(batch)),
                     lambda: columns_state(s), where=BATCH_PATHS) > 10
        assert s._requests.batch(batch) is not None
        assert sweep(in_transaction(s, s.step), lambda: columns_state(s),
                     where=BATCH_PATHS) > 10
    s.check_invariants()


# -- append_decode's per-layer dict ------------------------------------------------------------
@pytest.mark.parametrize("groups", [
    None, [["a", "b"], ["c"], ["b", "d"]], [["a"]], [], [["a", "a"], ["a"]]])
def test_the_layer_dict_is_the_dict_comprehension_it_replaced(groups):
    s = make(full=True, window=True)
    names = s.devices.row_names if groups is None else groups
    s._group_layers = [dict.fromkeys(n) for n in names]
    table = np.arange(len(names) * 3).reshape(len(names), 3)
    views = list(table)
    expected = {name: views[i] for i, group in enumerate(names) for name in group}
    got = s._by_layer(table)
    assert list(got) == list(expected)
    assert all(got[k] is not None and got[k].tolist() == expected[k].tolist() for k in got)
