"""Counting before changing: ``can_admit`` / ``can_append`` answer without raising and agree
with the calls; a refused call changes nothing; appends that fit run without the journal."""

import pytest

from hisparse_triton.errors import CapacityError, ReservationExceededError
from scheduler_plans import make_scheduler, tokens


def test_can_admit_agrees_with_add_request():
    s = make_scheduler(max_num_seqs=2, host_blocks=20)
    assert s.can_admit(30, 10)                         # 10 host pages of 19
    assert not s.can_admit(70, 10)                     # past max_model_len: False, no error
    assert not s.can_admit(0, 4) and not s.can_admit("x", 4)
    assert not s.can_admit(4, 4, token_ids=[1, 2])     # wrong token count
    s.add_request("a", 30, 10)
    assert not s.can_admit(30, 10)                     # 9 host blocks left
    with pytest.raises(CapacityError, match="host blocks"):
        s.add_request("b", 30, 10)
    assert s.can_admit(20, 4)
    s.add_request("b", 20, 4)
    assert not s.can_admit(4, 0)                       # no state row left
    with pytest.raises(CapacityError, match="state rows"):
        s.add_request("c", 4, 0)


def test_can_append_agrees_with_append_slots_and_counts_the_reclaim():
    # 59 blocks; 3 paged groups (indexer + 2 resident) and 8 hot blocks per request
    s = make_scheduler(max_num_seqs=2, device_blocks=60, watermark=0.0)
    s.add_request("a", 24, 8)
    assert s.can_append("a", 24) and not s.can_append("a", 33)
    assert not s.can_append("nope", 1) and not s.can_append("a", -1)
    s.append_slots("a", 24)                  # 18 blocks
    s.step()
    s.step()                                 # durable: 4 pages x 2 resident groups reclaimable
    s.add_request("b", 48, 0)
    assert s.available_device_blocks == 59 - 18 - 16
    assert not s.can_append("b", 48)         # 36 blocks: even a reclaim leaves 33
    before = s._debug_snapshot()
    with pytest.raises(CapacityError, match="needs 36 device blocks, 33 of 59"):
        s.append_slots("b", 48)
    assert s._debug_snapshot() == before and not s.is_offloaded("a")
    assert s.can_append("b", 36)             # 27 blocks: fits after offloading a
    s.append_slots("b", 36)
    assert s.is_offloaded("a") and s.unpinned_pages("a") == 4
    with pytest.raises(ReservationExceededError):
        s.append_slots("a", 9)
    s.check_invariants()


def test_admission_counts_its_reclaim_and_a_refusal_changes_nothing():
    s = make_scheduler(max_num_seqs=5, device_blocks=48, watermark=0.0)
    s.add_request("a", 36, 4, token_ids=tokens(36))
    s.append_slots("a", 36)                  # 27 blocks + a's 8 reserved: 12 left
    s.step()
    s.step()
    s.add_request("b", 8, 4)
    assert s.available_device_blocks == 4 and not s.is_offloaded("a")
    assert s.can_admit(8, 4)                 # only after offloading a
    s.add_request("c", 8, 4)
    assert s.is_offloaded("a") and s.unpinned_pages("a") == 7
    s.add_request("d", 8, 4)
    assert s.available_device_blocks == 2 and not s.can_admit(8, 4)
    before = s._debug_snapshot()
    with pytest.raises(CapacityError, match="hot region needs 8 device blocks, 2 of 47"):
        s.add_request("e", 8, 4)
    assert s._debug_snapshot() == before
    s.check_invariants()


def test_decode_appends_that_fit_record_no_undo():
    s = make_scheduler(max_num_seqs=2)
    for rid in ("a", "b"):
        s.add_request(rid, 9, 20)
        s.append_slots(rid, 9)
    s.step()
    recorded = []
    s.journal.record = lambda inverse: recorded.append(inverse)   # would see any undo
    for _ in range(8):                                            # pages start, too
        s.append_decode(["a", "b"])
        s.step()
    assert recorded == [] and not s.journal.active
    s.check_invariants()
