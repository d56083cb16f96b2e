"""The plan builder: the one writer of table entries, resets and losses; mirror rows; the
human-readable ``StepPlan.describe``."""

import numpy as np
import pytest

from hisparse_triton.scheduler.journal import Journal
from hisparse_triton.scheduler.plan_builder import PlanBuilder, mirror_rows
from hisparse_triton.step_plan import TableLayout
from scheduler_plans import make_scheduler

LAYOUT = TableLayout(max_num_seqs=2, width=10, host_col=1, host_width=3, group_cols=(4, 7),
                     group_widths=(3, 3))


def build(builder, **kwargs):
    args = dict(commit=False, mirror_host_rows=np.zeros(0, np.int32),
                mirror_device_rows=np.zeros((1, 0), np.int32), released_pages=0)
    args.update(kwargs)
    return builder.build(**args)


def test_writes_resets_and_losses_land_in_the_next_plan_only():
    builder = PlanBuilder(LAYOUT, Journal())
    builder.write_seq_len(1, 5)
    builder.write_host_blocks(1, [3, 4])
    builder.write_blocks(1, 0, 1, [8])
    builder.write_blocks(1, 0, 1, [9])                  # a later write of an entry wins
    builder.lose(1, 1, 2)
    assert builder.has_pending_changes
    plan = build(builder)
    assert plan.step == 1 and plan.layout == LAYOUT.fingerprint
    assert dict(zip(plan.write_index.tolist(), plan.write_value.tolist())) == {
        10: 5, 11: 3, 12: 4, 15: 9, 19: 0}
    assert plan.lost.tolist() == [[1, 1, 2]]
    assert not builder.has_pending_changes and build(builder).num_writes == 0


def test_a_reset_drops_the_rows_earlier_writes():
    builder = PlanBuilder(LAYOUT, Journal())
    builder.write_seq_len(0, 3)
    builder.write_seq_len(1, 4)
    builder.reset_row(0)
    plan = build(builder)
    assert plan.reset_rows.tolist() == [0] and plan.write_index.tolist() == [10]


def test_a_failed_transaction_undoes_pending_changes_and_the_step():
    journal = Journal()
    builder = PlanBuilder(LAYOUT, journal)
    builder.write_seq_len(0, 3)
    before = builder.snapshot()
    with pytest.raises(RuntimeError):
        with journal.transaction():
            builder.reset_row(0)
            builder.lose(0, 0, 1)
            build(builder)
            raise RuntimeError("roll back")
    assert builder.snapshot() == before


def test_mirror_rows_put_one_token_spans_last():
    host = np.array([5, 6, 7], dtype=np.int64)
    resident = [np.array([[0, 0, 0], [2, 3, 0]], dtype=np.int32)]
    h, d = mirror_rows([(host, 1, 4, 5), (host, 1, 0, 2)], resident, block_size=4)
    assert h.tolist() == [5 * 4, 5 * 4 + 1, 6 * 4]
    assert d.tolist() == [[2 * 4, 2 * 4 + 1, 3 * 4]] and d.dtype == np.int32
    h, d = mirror_rows([], resident, block_size=4)
    assert h.shape == (0,) and d.shape == (1, 0)


def test_describe_summarises_a_plan():
    s = make_scheduler(max_num_seqs=2)
    s.add_request("a", 9, 4)
    s.append_slots("a", 9)
    plan = s.step()
    text = plan.describe()
    assert text.splitlines()[0].startswith("StepPlan 1 (commit)")
    assert "1 state row reset: [0]" in text
    assert f"{plan.num_writes} table writes" in text
    detailed = plan.describe(s.layout)
    assert "on state rows [0]: 1 seq lens, 4 host blocks" in detailed
    assert "9 mirror rows" in text and "no lost page" in text
    assert len(text.splitlines()) <= 8
    empty = s.flush()
    assert "(no commit)" in empty.describe() and "nothing to mirror" in empty.describe()
