"""Residency decisions are pure: pressure, which pages leave, whom a reclaim offloads (and
its prediction of what becomes available is what carrying it out gives)."""

import numpy as np
import pytest

from hisparse_triton.config import ACTIVE_TAIL_PAGES
from hisparse_triton.scheduler.journal import Journal
from hisparse_triton.scheduler.requests import RequestTable
from hisparse_triton.scheduler.residency import ResidencyPolicy, watermark_blocks
from scheduler_plans import B, make_scheduler


def policy(**kwargs):
    args = dict(block_size=B, watermark=2, always_offload=False, offload_threshold_pages=1,
                window_pages=None)
    args.update(kwargs)
    return ResidencyPolicy(**args)


def request(seq_len, committed_len, released=0, reserved=64, request_id="r"):
    req = RequestTable(1, Journal()).add(request_id, reserved, 0, [1] * (reserved // B), [])
    req.seq_len, req.scheduled_len, req.committed_len = seq_len, committed_len, committed_len
    req.released_pages = released
    return req


def test_watermark_fractions_and_counts():
    assert watermark_blocks(0.1, 100) == 10 and watermark_blocks(7, 100) == 7
    for bad in (1.5, -1, "0.1", True):
        with pytest.raises(ValueError, match="free_block_watermark"):
            watermark_blocks(bad, 100)


def test_pressure_and_release_ranges():
    p = policy()
    assert p.under_pressure(2) and not p.under_pressure(3)
    assert policy(always_offload=True).under_pressure(10**6)
    req = request(seq_len=40, committed_len=40)
    limit = 40 // B - ACTIVE_TAIL_PAGES
    assert p.release_range(req, pressure=False) is None          # roomy: stays pinned
    span = p.release_range(req, pressure=True)
    assert (span.first, span.limit, span.offload) == (0, limit, True)
    assert policy(offload_threshold_pages=limit + 1).release_range(req, True) is None
    req.hot = {}                                                  # offloaded: no threshold
    assert policy(offload_threshold_pages=limit + 1).release_range(req, True).limit == limit
    req.released_pages = limit
    assert p.release_range(req, pressure=True) is None


def test_a_request_past_its_admission_window_offloads_without_pressure():
    req = request(seq_len=40, committed_len=40, reserved=64)
    assert policy(window_pages=8).release_range(req, pressure=False).offload
    assert policy(window_pages=16).release_range(req, pressure=False) is None


def test_reclaim_plan_counts_shared_blocks_once_and_changes_nothing():
    p = policy()
    a, b = request(40, 40, request_id="a"), request(24, 24, request_id="b")
    a.row, b.row = 0, 1
    blocks = {0: [5, 6, 7, 8, 9, 10, 11, 12], 1: [5, 6, 13, 14]}  # 5 and 6 are shared
    refs = {5: 2, 6: 2}
    plan = p.plan_reclaim([b, a], needed=20, available=10,
                          resident_blocks=lambda r, first, limit: blocks[r.row][first:limit],
                          ref_count=lambda blk: refs.get(blk, 1))
    assert [r.request_id for r in plan.requests] == ["a", "b"]   # most pinned pages first
    # a frees 7..12 (6 blocks), b frees 13..14 and, with a, the shared 5 and 6
    assert plan.available == 10 + 6 + 4 and plan.fits and plan.freed == set(range(5, 15))
    early = p.plan_reclaim([b, a], needed=12, available=10,
                           resident_blocks=lambda r, first, limit: blocks[r.row][first:limit],
                           ref_count=lambda blk: refs.get(blk, 1))
    assert early.requests == (a,) and early.available == 16


def test_the_scheduler_reclaim_prediction_matches_what_it_does():
    s = make_scheduler(max_num_seqs=3, device_blocks=80, watermark=0.0)
    for rid, n in (("a", 36), ("b", 28)):
        s.add_request(rid, n, 8)
        s.append_slots(rid, n)
        s.step()
    s.step()                                 # both durable, pinned: no pressure
    needed = s.available_device_blocks + 5
    before = s._debug_snapshot()
    reclaim, available = s.capacity.fit(needed)
    assert s._debug_snapshot() == before and reclaim is not None and reclaim.fits
    s.durability.run_reclaim(reclaim)
    assert s.available_device_blocks == available >= needed
    s.check_invariants()


def test_numpy_watermarks_are_accepted_like_python_numbers():
    """#22: ``free_block_watermark=np.int64(3)`` was refused."""
    assert make_scheduler(watermark=np.int64(3)).policy.watermark == 3
    s = make_scheduler(watermark=np.float64(1.0))
    assert s.policy.always_offload and s.free_block_watermark == 1.0
    assert make_scheduler(watermark=np.float32(0.5)).policy.watermark == \
        make_scheduler(watermark=0.5).policy.watermark
    for bad in (np.True_, True, float("nan"), "0.1", 1.5, -1):
        with pytest.raises(ValueError, match="free_block_watermark"):
            make_scheduler(watermark=bad)
