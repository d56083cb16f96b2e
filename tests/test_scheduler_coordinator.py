"""The coordinator orders the managers: paged groups in config order, hot regions after,
resident pages tail first across groups, reuse told to the group that reads the block."""

import numpy as np

from hisparse_triton.config import ACTIVE_TAIL_PAGES
from scheduler_plans import B, make_scheduler


def test_roles_and_costs_follow_the_plan():
    s = make_scheduler(full=True, window=True)
    d = s.devices
    assert sorted(m.position for m in d.paged + d.hot) == list(range(len(d.managers)))
    assert {m.position for m in d.resident} == d.resident_positions
    assert d.hot_cost == sum(g.width for g in s.groups.hot)
    assert [set(names) for names in d.row_names] == [
        set(m.group.model_layer_names) for m in d.paged]
    assert d.starts_no_page(5) and not d.starts_no_page(8)


def test_decode_rows_equal_one_row_at_a_time():
    s = make_scheduler(max_num_seqs=3, full=True)
    reqs = []
    for rid, n in (("a", 9), ("b", 14), ("c", 3)):
        s.add_request(rid, n, 4)
        s.append_slots(rid, n)
        reqs.append(s._requests[rid])
    rows = np.array([r.row for r in reqs])
    positions = np.array([r.seq_len - 1 for r in reqs])
    table = s.devices.decode_rows(rows, positions)
    assert table.shape == (len(s.devices.paged), 3) and table.dtype == np.int64
    for i, req in enumerate(reqs):
        assert table[:, i].tolist() == s.devices.row_at(req, req.seq_len - 1)
    assert s.devices.decode_rows(rows[:0], positions[:0]).shape == (len(s.devices.paged), 0)


def test_unpin_goes_tail_first_across_resident_groups():
    s = make_scheduler(max_num_seqs=2, device_blocks=47, watermark=10**6)
    s.add_request("a", 40, 8)
    s.append_slots("a", 40)
    req = s._requests["a"]
    owned = [s.devices.page_blocks(req, page) for page in range(10)]
    s.step()
    s.step()
    limit = 40 // B - ACTIVE_TAIL_PAGES
    expected = [owned[page][m.position] for page in range(limit - 1, -1, -1)
                for m in s.devices.resident]
    queue = list(s.device_block_pool._free)
    assert queue[-len(expected):] == expected and req.released_pages == limit
