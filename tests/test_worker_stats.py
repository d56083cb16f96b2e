"""``CounterReader``, ``WorkerStats`` and ``StatsSnapshot`` over hand-made counters."""

from __future__ import annotations

import pytest
import torch

from hisparse_triton.worker.stats import CounterReader, GroupCounts, StatsSnapshot, WorkerStats


def _reader(counts, bytes_per_miss=(100, 300), d2h=7, plans=2):
    counters = torch.tensor(counts, dtype=torch.int64)
    host = {"d2h": d2h, "plans": plans}
    reader = CounterReader(counters, bytes_per_miss, d2h_bytes=lambda: host["d2h"],
                           plans=lambda: host["plans"])
    return reader, counters, host


def test_read_sums_the_groups_and_turns_misses_into_bytes():
    reader, _, _ = _reader([[5, 2, 1], [3, 4, 0]])
    assert reader.read() == WorkerStats(hits=8, misses=6, masked=1,
                                        h2d_bytes=2 * 100 + 4 * 300, d2h_bytes=7, plans=2)


def test_a_snapshot_holds_the_counters_as_of_its_call():
    reader, counters, host = _reader([[1, 1, 0], [0, 2, 0]])
    snapshot = reader.read_async()
    assert isinstance(snapshot, StatsSnapshot) and snapshot.ready()
    counters += 10
    host["d2h"], host["plans"] = 99, 5
    first = snapshot.result()
    assert (first.hits, first.misses, first.d2h_bytes, first.plans) == (1, 3, 7, 2)
    assert reader.read().misses == 23 and reader.read().plans == 5


def test_zero_clears_the_device_counters():
    reader, counters, _ = _reader([[5, 2, 1], [3, 4, 9]])
    reader.zero()
    assert counters.eq(0).all() and reader.read().h2d_bytes == 0


def test_hit_rate():
    assert WorkerStats(0, 0, 0, 0, 0, 0).hit_rate == 1.0
    assert WorkerStats(3, 1, 5, 0, 0, 0).hit_rate == 0.75


@pytest.mark.parametrize("counters, per_miss, match", [
    (torch.zeros(2, 3, dtype=torch.int32), (1, 1), "int64"),
    (torch.zeros(2, 4, dtype=torch.int64), (1, 1), r"\[groups, 3\]"),
    (torch.zeros(2, 3, dtype=torch.int64), (1,), "1 bytes_per_miss values for 2 index groups"),
])
def test_bad_counters_are_refused(counters, per_miss, match):
    with pytest.raises(ValueError, match=match):
        CounterReader(counters, per_miss, d2h_bytes=lambda: 0, plans=lambda: 0)


def test_a_snapshot_names_each_index_group_s_share():
    counters = torch.tensor([[5, 2, 1], [3, 4, 0]], dtype=torch.int64)
    reader = CounterReader(counters, (100, 300), d2h_bytes=lambda: 0, plans=lambda: 0,
                           leaders=("a", "b"))
    snapshot = reader.read_async()
    counters += 1                                # after the call: not in the snapshot
    assert snapshot.groups() == (GroupCounts("a", 5, 2, 1, 200), GroupCounts("b", 3, 4, 0, 1200))
    assert snapshot.groups()[1].miss_rate == 4 / 7 and GroupCounts("c", 0, 0, 0, 0).miss_rate == 0
    unnamed = CounterReader(counters, (1, 1), d2h_bytes=lambda: 0, plans=lambda: 0)
    assert [g.leader for g in unnamed.read_async().groups()] == ["group0", "group1"]
    with pytest.raises(ValueError, match="1 leaders for 2 index groups"):
        CounterReader(counters, (1, 1), d2h_bytes=lambda: 0, plans=lambda: 0, leaders=("a",))
