"""``PlanTables``: the int32 arena, plan checks, apply in plan order, revert, staging.

Driven with hand-built ``StepPlan``s over a small ``TableLayout`` and a recording
``RowState`` (no pools, no kernels).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hisparse_triton.step_plan import PlanLimits, StepPlan, TableLayout
from hisparse_triton.worker.tables import STAGING_SLOTS, PlanTables, StagingRing

S = 3
LAYOUT = TableLayout(max_num_seqs=S, width=8, host_col=1, host_width=3, group_cols=(4, 6),
                     group_widths=(2, 2))
LIMITS = PlanLimits(layout=LAYOUT, max_model_len=12, block_size=4, num_device_blocks=10,
                    num_host_blocks=10, resident=(0,))


class RecordingRowState:
    """One int32 value per state row (7 = "held"; a reset writes 0)."""

    def __init__(self) -> None:
        self.values = torch.full((S,), 7, dtype=torch.int32)
        self.fail_reset = False

    def save_rows(self, rows):
        return (self.values[rows].clone(),)

    def reset_rows(self, rows):
        if self.fail_reset:
            raise RuntimeError("injected reset failure")
        self.values[rows] = 0

    def restore_rows(self, rows, saved):
        self.values[rows] = saved[0]


def make_tables(row_state=None) -> PlanTables:
    return PlanTables(LIMITS, torch.device("cpu"), row_state or RecordingRowState())


def plan(step: int, *, resets=(), writes=(), mirror=(), layout: int = LAYOUT.fingerprint,
         commit=None):
    """A plan of ``writes`` ``[(row, column, value)]`` and ``mirror`` ``[(host, device)]``
    (a commit plan when it mirrors, unless ``commit`` says otherwise)."""
    index = [r * LAYOUT.width + c for r, c, _ in writes]
    commit = bool(mirror) if commit is None else commit
    return StepPlan.build(step=step, layout=layout, commit=commit, reset_rows=list(resets),
                          write_index=index, write_value=[v for *_, v in writes],
                          mirror_host_rows=[h for h, _ in mirror],
                          mirror_device_rows=np.array([[d for _, d in mirror]]).reshape(1, -1),
                          lost=np.zeros((0, 3)))


def state(tables: PlanTables, row_state) -> tuple:
    return (tables.arena.tolist(), row_state.values.tolist(), tables.next_step,
            tables.mirror_due)


def test_views_are_columns_of_one_arena():
    tables = make_tables()
    assert tables.arena.shape == (S, LAYOUT.width) and tables.arena.dtype == torch.int32
    assert tables.seq_lens.shape == (S,) and tables.host_blocks.shape == (S, 3)
    assert [t.shape for t in tables.group_tables] == [(S, 2), (S, 2)]
    tables.apply(plan(1, writes=[(1, 0, 5), (1, 2, 9), (2, 6, 4)]))
    assert tables.seq_lens.tolist() == [0, 5, 0]
    assert tables.host_blocks[1].tolist() == [0, 9, 0]
    assert tables.group_tables[1][2].tolist() == [4, 0]
    assert PlanTables.nbytes(LAYOUT) == 4 * S * LAYOUT.width


def test_resets_come_before_the_writes():
    row_state = RecordingRowState()
    tables = make_tables(row_state)
    tables.apply(plan(1, writes=[(0, 0, 3), (0, 5, 8), (2, 0, 1)]))
    tables.apply(plan(2, resets=[0], writes=[(0, 1, 6)]))
    assert tables.arena[0].tolist() == [0, 6, 0, 0, 0, 0, 0, 0]  # emptied, then written
    assert tables.arena[2, 0] == 1                                # other rows untouched
    assert row_state.values.tolist() == [0, 7, 7]
    assert tables.applied == 2 and tables.next_step == 3


def test_revert_restores_everything_the_last_plan_changed():
    row_state = RecordingRowState()
    tables = make_tables(row_state)
    tables.apply(plan(1, writes=[(0, 0, 3), (1, 4, 2)]))
    before = state(tables, row_state)
    second = plan(2, resets=[1], writes=[(0, 0, 4), (2, 7, 9)], mirror=[(5, 6)])
    tables.apply(second)
    assert tables.mirror_due == second and tables.mirror_due is not second  # its own copy
    tables.revert(second)
    assert state(tables, row_state) == before
    with pytest.raises(ValueError, match="StepPlan 2 is not the last plan applied"):
        tables.revert(second)                   # only once
    tables.apply(second)                        # and the plan applies again
    assert tables.arena[2, 7] == 9


def test_revert_takes_only_the_last_plan():
    tables = make_tables()
    first = plan(1, writes=[(0, 0, 1)])
    tables.apply(first)
    tables.apply(plan(2, writes=[(0, 0, 2)]))
    with pytest.raises(ValueError, match="StepPlan 1 is not the last plan applied"):
        tables.revert(first)
    with pytest.raises(ValueError, match="is not the last plan applied"):
        tables.revert("plan")


@pytest.mark.parametrize("bad, match", [
    (plan(2), r"out of order \(skipped ahead\)"),
    (plan(1, layout=LAYOUT.fingerprint ^ 1), "different plans"),
    (plan(1, resets=[S]), r"reset_rows holds 3, outside \[0, 3\)"),
    (plan(1, writes=[(S, 0, 1)]), r"write_index holds 24, outside \[0, 24\)"),
    (plan(1, mirror=[(40, 4)]), r"mirror_host_rows holds 40, outside \[4, 40\)"),
    (b"bytes", "apply takes a StepPlan"),
])
def test_a_refused_plan_changes_nothing(bad, match):
    row_state = RecordingRowState()
    tables = make_tables(row_state)
    before = state(tables, row_state)
    with pytest.raises(ValueError, match=match):
        tables.apply(bad)
    assert state(tables, row_state) == before


def test_a_commit_plan_after_unmirrored_rows_is_refused_until_mirrored():
    tables = make_tables()
    first = plan(1, mirror=[(4, 8)])
    tables.apply(first)
    with pytest.raises(ValueError, match="StepPlan 1 has mirror rows that were never mirrored"):
        tables.apply(plan(2, commit=True))
    with pytest.raises(ValueError, match=r"takes the last plan applied \(step 1\), got step 2"):
        tables.check_last(plan(2))
    assert tables.check_last(first) == first and tables.check_last() == first
    assert tables.packed().tolist() == first.data.tolist()
    tables.mark_mirrored()
    tables.apply(plan(2, commit=True))


def test_plans_without_commit_may_come_while_mirrors_are_due():
    """A plan that declares nothing durable (``commit`` False) is applied while an earlier
    plan's mirror is due; every due plan keeps its own data and is mirrored in plan order;
    a commit plan waits until all are mirrored; revert drops the reverted plan's mirror."""
    tables = make_tables()
    first = plan(1, mirror=[(4, 8)], commit=False)
    second = plan(2, writes=[(0, 0, 7)], mirror=[(5, 9), (6, 10)], commit=False)
    tables.apply(first)
    tables.apply(second)
    assert tables.due_plans == [first, second] and tables.mirror_due == first
    assert [tables.packed(d).tolist() for d in tables.due] == [first.data.tolist(),
                                                               second.data.tolist()]
    with pytest.raises(ValueError, match="StepPlan 1 has mirror rows that were never mirrored"):
        tables.apply(plan(3, commit=True))
    third = plan(3, writes=[(1, 0, 2)])
    tables.apply(third)                      # no mirror rows: not due
    tables.revert(third)
    assert tables.due_plans == [first, second]
    tables.apply(third)
    tables.mark_mirrored()
    assert tables.due_plans == [] and tables.mirror_due is None
    tables.apply(plan(4, commit=True))


def test_a_mirror_with_another_resident_group_count_is_refused():
    tables = make_tables()
    two = StepPlan.build(step=1, layout=LAYOUT.fingerprint, commit=True, reset_rows=[],
                         write_index=[], write_value=[], mirror_host_rows=[1],
                         mirror_device_rows=[[1], [2]], lost=np.zeros((0, 3)))
    with pytest.raises(ValueError, match="mirrors 2 resident groups; this plan has 1"):
        tables.apply(two)


def test_a_failure_part_way_restores_the_touched_entries():
    row_state = RecordingRowState()
    tables = make_tables(row_state)
    tables.apply(plan(1, writes=[(0, 0, 3), (0, 4, 2)]))
    before = state(tables, row_state)
    row_state.fail_reset = True     # the arena row is emptied, then the row state fails
    with pytest.raises(RuntimeError, match="injected reset failure"):
        tables.apply(plan(2, resets=[0], writes=[(1, 0, 5)]))
    assert state(tables, row_state) == before


def test_the_staging_ring_on_the_cpu_hands_the_array_itself():
    ring = StagingRing(torch.device("cpu"))
    values = np.arange(5, dtype=np.int32)
    data = ring.upload(values)
    assert data.tolist() == [0, 1, 2, 3, 4]
    values[0] = 9                                   # no copy is made on the CPU
    assert int(data[0]) == 9 and ring.last(values).tolist() == values.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_staging_ring_reuses_its_pinned_slots_in_turn():
    ring = StagingRing(torch.device("cuda"))
    for step in range(2 * STAGING_SLOTS + 1):
        values = np.arange(step, step + 100 * (step + 1), dtype=np.int32)
        data = ring.upload(values)
        assert data.device.type == "cuda" and torch.equal(data.cpu(), torch.from_numpy(values))
        assert torch.equal(ring.last(values).cpu(), torch.from_numpy(values))
