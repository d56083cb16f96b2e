"""The scheduler -> worker protocol as untrusted input: every plan a worker is given is
checked where it is received, and a refused plan changes nothing (tables, hot state,
counters, both pools).

A fuzz of the wire forms (truncated and bit-flipped bytes, hostile header fields, unpickled
plans with changed attributes) and of every section's values (each out of range, repeated,
into the null blocks); ``mirror`` copies exactly the rows of the plan that was applied.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from hisparse_triton.presets import build_kv_cache_spec
from hisparse_triton.scheduler import HiSparseScheduler
from hisparse_triton.step_plan import StepPlan
from hisparse_triton.worker import HiSparseWorker
from hisparse_triton.workload import plan_for_workload
from tests.worker_helpers import B, TOPK, BUFFER, L0, make_pair, prefill, write_rows

FIELDS = ("step", "layout", "commit", "num_resets", "num_writes", "num_mirror",
          "num_resident", "num_lost", "released_pages", "num_invalidate")


def full_state(worker: HiSparseWorker) -> tuple:
    """Everything a plan could change: tables, hot state, counters, both pools' bytes."""
    return (worker._debug_snapshot(), worker.stats(),
            worker.host_pool.tensor.clone(), worker.device_pool.tensor.clone())


def assert_same(before: tuple, after: tuple) -> None:
    assert before[0] == after[0] and before[1] == after[1]
    assert torch.equal(before[2], after[2]) and torch.equal(before[3], after[3])


def rebuild(plan: StepPlan, **sections) -> StepPlan:
    """``plan`` with some sections (or header fields) replaced."""
    parts = dict(step=plan.step, layout=plan.layout, commit=plan.commit,
                 reset_rows=plan.reset_rows, write_index=plan.write_index,
                 write_value=plan.write_value, mirror_host_rows=plan.mirror_host_rows,
                 mirror_device_rows=plan.mirror_device_rows, lost=plan.lost,
                 released_pages=plan.released_pages, invalidate=plan.invalidate)
    parts.update(sections)
    return StepPlan.build(**parts)


def forged(plan: StepPlan, **fields) -> StepPlan:
    """An unpickled copy of ``plan`` whose attributes were changed afterwards (what a
    hostile or buggy sender can ship: unpickling runs no constructor check)."""
    copy = pickle.loads(pickle.dumps(plan))
    for name, value in fields.items():
        if value is _DELETE:
            del copy.__dict__[name]
        else:
            object.__setattr__(copy, name, value)
    return copy


_DELETE = object()


@pytest.fixture
def setup():
    """A worker with a warm hot buffer and the scheduler's next plan (a decode step with
    mirror rows, a reset of a freed request, seq_len / host / device writes)."""
    scheduler, worker = make_pair(max_num_seqs=2)
    gen = torch.Generator().manual_seed(0)
    prefill(scheduler, worker, "a", 20, gen)
    prefill(scheduler, worker, "b", 9, gen)
    row = scheduler.state_row("a")
    topk = torch.arange(0, 16, 2, dtype=torch.int32).view(1, TOPK)
    for leader in scheduler.leaders:
        worker.resolve_rows(leader, torch.tensor([row], dtype=torch.int32), topk)
    scheduler.free_request("b")
    scheduler.add_request("c", 6, 4)
    rows = scheduler.append_slots("c", 6)
    scheduler.append_slots("a", 1)
    plan = scheduler.step()
    assert plan.num_resets and plan.num_writes and plan.num_mirror
    yield scheduler, worker, plan, rows
    worker.close()


def refused(worker: HiSparseWorker, plan: object, match: str) -> None:
    before = full_state(worker)
    with pytest.raises(ValueError, match=match):
        worker.apply(plan)
    assert_same(before, full_state(worker))


def test_every_truncation_of_the_bytes_is_refused(setup):
    _, worker, plan, _ = setup
    payload = plan.to_bytes()
    before = full_state(worker)
    for cut in range(len(payload)):
        with pytest.raises(ValueError, match="truncated|data holds"):
            worker.apply(StepPlan.from_bytes(payload[:cut]))
    assert_same(before, full_state(worker))
    worker.apply(StepPlan.from_bytes(payload))           # the whole payload still applies


def test_bit_flips_are_refused_or_stay_inside_the_pools(setup):
    """Every flipped bit either is refused (a ValueError naming a field: nothing changes)
    or makes another well-formed plan whose values all fit the worker (then reverted)."""
    _, worker, plan, _ = setup
    payload = bytearray(plan.to_bytes())
    rng = np.random.default_rng(7)
    bits = [*range(8 * 96), *rng.choice(8 * len(payload), 600, replace=False).tolist()]
    before = full_state(worker)
    accepted = 0
    limits = worker.plan_limits
    for bit in bits:
        flipped = bytearray(payload)
        flipped[bit // 8] ^= 1 << (bit % 8)
        try:
            candidate = StepPlan.from_bytes(bytes(flipped))
            worker.apply(candidate)
        except ValueError as exc:
            assert "StepPlan" in str(exc) or "payload" in str(exc)
            assert_same(before, full_state(worker))
            continue
        accepted += 1
        arena = worker._tables.arena
        bounds = torch.from_numpy(limits.column_bounds)
        assert bool((arena >= 0).all()) and bool((arena < bounds).all())
        worker.revert(candidate)
        assert_same(before, full_state(worker))
    assert 0 < accepted < len(bits)


@pytest.mark.parametrize("offset, value, match", [
    (0, b"XXXX", "not a StepPlan payload"),
    (4, (9).to_bytes(4, "little"), "format version 9"),
    (8, (0).to_bytes(8, "little"), r"StepPlan.step is 0, outside \[1"),
    (24, (2).to_bytes(8, "little"), "commit field holds 2, not 0 or 1"),
    (32, (-1).to_bytes(8, "little", signed=True), r"num_resets is -1, outside \[0"),
    (40, (2**62).to_bytes(8, "little"), "data holds"),
    (48, (-5).to_bytes(8, "little", signed=True), r"num_mirror is -5"),
    (56, (0).to_bytes(8, "little"), "mirror rows but num_resident is 0"),
    (64, (1).to_bytes(8, "little"), "data holds"),
    (72, (-3).to_bytes(8, "little", signed=True), r"released_pages is -3"),
    (80, (1).to_bytes(8, "little"), "data holds"),
])
def test_hostile_header_fields_are_refused(setup, offset, value, match):
    _, worker, plan, _ = setup
    payload = bytearray(plan.to_bytes())
    payload[offset:offset + len(value)] = value
    before = full_state(worker)
    with pytest.raises(ValueError, match=match):
        worker.apply(StepPlan.from_bytes(bytes(payload)))
    assert_same(before, full_state(worker))


def test_an_unpickled_plan_is_checked_like_any_other(setup):
    _, worker, plan, _ = setup
    shifted = forged(plan, num_resets=plan.num_resets - 1, num_writes=plan.num_writes + 1)
    cases = [
        (forged(plan, data=plan.data.astype(np.float64)), "1-D int32 numpy array, got float64"),
        (forged(plan, data=plan.data.astype(np.int64)), "1-D int32 numpy array, got int64"),
        (forged(plan, data=plan.data.reshape(1, -1)), r"got int32 array of shape \(1, "),
        (forged(plan, data=plan.data.tolist()), "1-D int32 numpy array, got list"),
        (forged(plan, data=None), "got NoneType"),
        (forged(plan, num_writes=plan.num_writes + 1), "data holds"),
        (shifted, "data holds"),
        (forged(plan, num_lost=-1), r"num_lost is -1"),
        (forged(plan, step="1"), "StepPlan.step must be an int, got '1'"),
        (forged(plan, step=True), "StepPlan.step must be an int, got True"),
        (forged(plan, commit=2), "commit must be True or False, got 2"),
        (forged(plan, layout=None), "StepPlan.layout must be an int"),
        (forged(plan, data=_DELETE), "has no 'data' field"),
        (forged(plan, layout=plan.layout ^ 1), "different plans"),
    ]
    for bad, match in cases:
        refused(worker, bad, match)
    worker.apply(pickle.loads(pickle.dumps(plan)))


def test_a_shifted_count_that_keeps_the_size_is_caught_by_the_values(setup):
    """Moving one entry from the writes' count to the resets' (same data size) shifts every
    section: the values then do not fit, which the checks find."""
    _, worker, plan, _ = setup
    bad = forged(plan, num_resets=plan.num_resets + 2, num_writes=plan.num_writes - 1)
    refused(worker, bad, rf"StepPlan {plan.step}: (reset_rows|write_index|write_value)")


def _write_at(worker, plan, column_of, value):
    """``plan`` with its first write whose column ``column_of`` selects set to ``value``."""
    width = worker.layout.width
    index, values = plan.write_index.copy(), plan.write_value.copy()
    hits = np.flatnonzero(column_of(index % width))
    assert hits.size
    values[hits[0]] = value
    return rebuild(plan, write_value=values)


def test_every_section_value_is_checked_against_the_worker(setup):
    _, worker, plan, _ = setup
    L, limits = worker.layout, worker.plan_limits
    S, nd, nh = L.max_num_seqs, worker.num_device_blocks, worker.num_host_blocks
    seq = lambda c: c == 0                                           # noqa: E731
    host = lambda c: (c >= L.host_col) & (c < L.host_col + L.host_width)  # noqa: E731
    device = lambda c: c >= L.group_cols[0]                          # noqa: E731
    resident = limits.resident[0]
    other_group = next(p for p in range(len(L.group_cols)) if p not in limits.resident)
    cases = [
        (_write_at(worker, plan, seq, -1), r"write_value\[\d+\] = -1 for state row \d+, "
                                           r"seq_len, is outside \[0, 65\)"),
        (_write_at(worker, plan, seq, 65), "= 65 .*seq_len"),
        (_write_at(worker, plan, host, -1), "host block of page"),
        (_write_at(worker, plan, host, nh), rf"= {nh} .*host block of page \d+, is outside"),
        (_write_at(worker, plan, device, -1), "device group"),
        (_write_at(worker, plan, device, nd), rf"= {nd} .*device group \d+ entry"),
        (_write_at(worker, plan, device, 2**31 - 1), "= 2147483647"),
        (_write_at(worker, plan, device, -2**31), "= -2147483648"),
        (rebuild(plan, write_index=np.r_[plan.write_index[:-1], plan.write_index[0]]),
         r"write_index holds \d+ twice"),
        (rebuild(plan, write_index=np.r_[plan.write_index[:-1], L.num_entries]),
         "write_index holds"),
        (rebuild(plan, reset_rows=[S]), rf"reset_rows holds {S}, outside \[0, {S}\)"),
        (rebuild(plan, reset_rows=[0, 0]), "reset_rows holds 0 twice"),
        (rebuild(plan, mirror_host_rows=np.r_[plan.mirror_host_rows[:-1], 1]),
         r"mirror_host_rows holds 1, outside \[4, .*null block"),
        (rebuild(plan, mirror_host_rows=np.r_[plan.mirror_host_rows[:-1],
                                              plan.mirror_host_rows[0]]),
         "mirror_host_rows holds .* twice"),
        (rebuild(plan, mirror_host_rows=np.r_[plan.mirror_host_rows[:-1], nh * B]),
         "mirror_host_rows holds"),
        (rebuild(plan, mirror_device_rows=np.where(
            np.arange(plan.num_mirror) == 0, 2, plan.mirror_device_rows)),
         r"mirror_device_rows holds 2, outside \[4, "),
        (rebuild(plan, mirror_device_rows=np.where(
            np.arange(plan.num_mirror) == 0, nd * B, plan.mirror_device_rows)),
         "mirror_device_rows holds"),
        (rebuild(plan, lost=[[S, resident, 0]]), r"lost state rows \(column 0\) holds"),
        (rebuild(plan, lost=[[0, other_group, 0]]), r"\(column 1\), not a resident"),
        (rebuild(plan, lost=[[0, resident, -1]]), r"page -1 \(column 2\)"),
        (rebuild(plan, lost=[[0, resident, L.group_widths[resident]]]), r"\(column 2\)"),
        (forged(plan, released_pages=-1), r"released_pages is -1"),
        (rebuild(plan, invalidate=[[S, 0, 4]]), r"invalidate state rows \(column 0\)"),
        (rebuild(plan, invalidate=[[0, 8, 4]]), r"invalidate\[0\] is host rows \[8, 4\)"),
        (rebuild(plan, invalidate=[[0, -1, 4]]), r"invalidate\[0\] is host rows \[-1, 4\)"),
        (rebuild(plan, invalidate=[[0, 0, nh * B + 1]]), "not a range inside"),
        (rebuild(plan, step=plan.step + 1), r"out of order \(skipped ahead\)"),
        (b"bytes", "apply takes a StepPlan, got bytes"),
        (None, "apply takes a StepPlan, got NoneType"),
    ]
    for bad, match in cases:
        refused(worker, bad, match)
    worker.apply(plan)


def test_a_worker_refuses_a_plan_made_for_pools_of_another_size():
    spec = build_kv_cache_spec("tiny", num_layers=4, block_size=B)
    small, big = (plan_for_workload(spec, max_model_len=64, num_requests=2, topk=TOPK,
                                    device_buffer_size=BUFFER, device_blocks=n)
                  for n in (64, 200))
    assert small.kv_cache_config.num_blocks != big.kv_cache_config.num_blocks
    scheduler = HiSparseScheduler(big.kv_cache_config, big.config, max_num_seqs=2)
    with HiSparseWorker(small.kv_cache_config, small.config, max_num_seqs=2, device="cpu",
                        backend="torch") as worker:
        scheduler.add_request("a", 4, 4)
        with pytest.raises(ValueError, match="covers the tables and the pool sizes"):
            worker.apply(scheduler.step())


def test_mirror_copies_the_applied_rows_and_refuses_another_plan(setup):
    scheduler, worker, plan, rows = setup
    gen = torch.Generator().manual_seed(1)
    worker.apply(plan)
    write_rows(worker, rows, gen)
    other = rebuild(plan, mirror_host_rows=plan.mirror_host_rows[::-1].copy())
    before = full_state(worker)
    with pytest.raises(ValueError, match="is not the plan applied as step"):
        worker.mirror(other)
    with pytest.raises(ValueError, match="takes the last plan applied"):
        worker.mirror(rebuild(plan, step=plan.step + 1))
    assert_same(before, full_state(worker))
    expected = plan.mirror_host_rows.copy()
    plan.data[:] = 0                       # the caller's array changes after apply ...
    worker.mirror()                        # ... the worker mirrors what it applied
    host = worker.host_cache(L0).reshape(-1, worker.host_cache(L0).shape[2])
    device = worker.device_cache(L0).reshape(-1, worker.device_cache(L0).shape[2])
    for r in torch.as_tensor(rows[L0], dtype=torch.int64).tolist():   # request c's rows
        assert any(torch.equal(device[r], host[h]) for h in expected.tolist())
    worker.mirror()                        # already mirrored: nothing to do
    assert worker.stats().d2h_bytes > 0
