"""Draft tokens under async scheduling: ``append_slots(..., num_draft_tokens=)`` and
``verify_drafts`` on the scheduler's bookkeeping alone (no torch).

Exactness against a dense oracle in vLLM's async order, on both halves and the facade, is
``tests/test_async_rollback.py``; the plain ``truncate`` is ``tests/test_scheduler_rollback.py``.
"""

import random

import numpy as np
import pytest

from fault_points import sweep
from scheduler_plans import B, make_scheduler, tokens


#: The scheduler's files whose lines are fault points (the block pool's and the journal's
#: own primitives are what the journal undoes, not points between its records).
SCHEDULER_PARTS = tuple(f"/hisparse_triton/scheduler/{name}.py" for name in (
    "scheduler", "capacity", "requests", "durability", "plan_builder", "coordinator",
    "managers", "residency", "read_holds", "prefix_cache", "transfer"))


def prefill(s, rid, n, max_new=20, token_ids=None):
    s.add_request(rid, n, max_new, token_ids=token_ids)
    s.append_slots(rid, n)
    s.step()
    s.step()                       # the prompt is durable


def committed(s, rid):
    return s._requests[rid].committed_len


def scheduled(s, rid):
    return s._requests[rid].scheduled_len


def test_drafts_stay_undurable_until_verified_so_a_later_step_can_still_drop_them():
    """The issue's case: step N+1 is planned before N's drafts are verified; without draft
    marks step() makes them durable and the rollback is refused."""
    s = make_scheduler(device_blocks=200)
    prefill(s, "a", 40)
    s.append_slots("a", 3)                        # the last token + 2 drafts, positions 40..42
    s.step()                                      # plan N
    s.append_slots("a", 1)
    s.step()                                      # plan N+1: N's tokens are durable
    with pytest.raises(ValueError, match="cannot truncate to 41 tokens: its first 43 are "
                                         "durable"):
        s.truncate("a", 41)

    s = make_scheduler(device_blocks=200)
    prefill(s, "a", 40)
    s.append_slots("a", 3, num_draft_tokens=2)    # drafts at 41, 42
    assert s.pending_drafts("a") == [(41, 2)]
    s.step()
    s.append_slots("a", 3, num_draft_tokens=2)    # step N+1, scheduled optimistically
    s.step()
    s.step()
    assert committed(s, "a") == 41                # the first draft stops durability
    s.verify_drafts("a", 0)                       # both of N's drafts rejected
    assert s.seq_len("a") == 44 and s.pending_drafts("a") == [(42, 2)]
    assert scheduled(s, "a") == 41                # from 41 on the bytes changed: mirrored again
    plan = s.step()
    host = s.host_block_table("a")
    assert plan.mirror_host_rows.tolist() == [host[p // B] * B + p % B for p in range(41, 44)]
    assert committed(s, "a") == 41
    s.step()
    assert committed(s, "a") == 42                # up to N+1's first draft
    s.verify_drafts("a", 2)
    assert s.pending_drafts("a") == [] and s.seq_len("a") == 44
    s.step()
    assert committed(s, "a") == 44
    s.check_invariants()


def test_accepting_every_draft_changes_no_table_and_no_mirror():
    s = make_scheduler(device_blocks=200)
    prefill(s, "a", 20)
    s.append_slots("a", 3, num_draft_tokens=2)
    s.step()
    s.verify_drafts("a", 2)
    assert not s.has_pending_changes
    assert scheduled(s, "a") == 23 and s.seq_len("a") == 23
    s.step()
    assert committed(s, "a") == 23
    s.check_invariants()


def test_rejected_tail_pages_are_freed_and_later_tokens_move_down():
    s = make_scheduler(device_blocks=200, full=True)
    prefill(s, "a", 14)                         # pages 0..3 (14 tokens)
    free = s.device_block_pool.num_free
    s.append_slots("a", 4, num_draft_tokens=3)  # 14..17: page 4 starts
    s.append_slots("a", 4, num_draft_tokens=3)  # 18..21: page 5 (async: optimistic)
    paged = len(s.devices.paged)
    assert s.device_block_pool.num_free == free - 2 * paged
    s.verify_drafts("a", 1)                     # keeps 14, 15: the later run moves to 16..19
    assert s.seq_len("a") == 20 and s.pending_drafts("a") == [(17, 3)]
    assert s.device_block_pool.num_free == free - paged    # page 5 is gone
    s.verify_drafts("a", 0)
    assert s.seq_len("a") == 17 and s.pending_drafts("a") == []
    s.check_invariants()


def test_pages_with_drafts_never_leave_the_gpu_before_they_are_verified():
    s = make_scheduler(device_blocks=200, watermark=1.0)
    prefill(s, "a", 8)
    s.append_slots("a", 13, num_draft_tokens=12)  # 8..20: drafts from 9
    for _ in range(3):
        s.step()
    assert committed(s, "a") == 9
    assert s.unpinned_pages("a") == 2             # pages 0, 1 only (durable, outside the tail)
    s.verify_drafts("a", 12)
    s.step()
    s.step()
    assert s.unpinned_pages("a") == cdiv(21, B) - 2
    s.check_invariants()


def cdiv(a, b):
    return -(-a // b)


def test_drafts_are_never_published_and_accepted_tokens_are_spliced_into_the_hash_chain():
    s = make_scheduler(device_blocks=200)
    prompt = tokens(8)
    prefill(s, "a", 8, token_ids=prompt)
    s.append_slots("a", 4, token_ids=[1, 2, 3, 4], num_draft_tokens=3)       # 8..11
    s.append_slots("a", 4, token_ids=[5, 6, 7, 8], num_draft_tokens=3)       # 12..15
    for _ in range(3):
        s.step()
    assert s.add_request("x", 13, 0, token_ids=prompt + [1, 2, 3, 4, 5]) == 8   # page 2 not
    s.free_request("x")                                                       # published
    s.verify_drafts("a", 1)          # 8, 9 stay; 10, 11 rejected; [5, 6, 7, 8] move to 10..13
    assert s._requests["a"].token_ids == prompt + [1, 2, 5, 6, 7, 8]
    s.verify_drafts("a", 3)
    s.append_slots("a", 2, token_ids=[9, 9])                                  # 14, 15
    s.step()
    s.step()
    s.free_request("a")
    assert s.add_request("y", 17, 0, token_ids=prompt + [1, 2, 5, 6, 7, 8, 9, 9, 0]) == 16
    s.check_invariants()


def test_an_offloaded_request_invalidates_the_rows_from_the_first_rejected_position():
    s = make_scheduler(device_blocks=200, watermark=1.0)
    prefill(s, "a", 20)
    assert s.is_offloaded("a")
    s.append_slots("a", 3, num_draft_tokens=2)   # 20..22
    s.append_slots("a", 3, num_draft_tokens=2)   # 23..25
    s.step()
    s.verify_drafts("a", 1)                      # 22 on changes; ends at 25
    plan = s.step()
    host = s.host_block_table("a")
    assert [tuple(e) for e in plan.invalidate.tolist()] == [
        (s.state_row("a"), host[5] * B + 2, host[5] * B + 4),
        (s.state_row("a"), host[6] * B, host[6] * B + 2)]
    s.check_invariants()


def test_blocks_a_resolve_read_stay_held_after_a_rejection_until_the_step_ends():
    """As ``truncate``: a request whose rows a resolve read keeps the dropped pages' blocks
    from any new owner until the step ends."""
    s = make_scheduler(device_blocks=200)
    prefill(s, "a", 14)
    s.append_slots("a", 4, num_draft_tokens=3)    # page 4 starts at 16
    s.append_slots("a", 4, num_draft_tokens=3)    # page 5 starts at 20
    s.step()
    s.hold_reads(["a"])
    free = s.device_block_pool.num_free
    s.verify_drafts("a", 0)              # 15 tokens + 4 moved: ends at 19, page 5 dropped
    resident, others = len(s.devices.resident), len(s.devices.paged) - len(s.devices.resident)
    assert s.device_block_pool.num_free == free + others   # the resident pages' are kept
    assert s.held_device_blocks == resident
    s.check_invariants()
    s.step()                                      # the step ends: they return
    assert s.device_block_pool.num_free == free + resident + others
    s.check_invariants()


def test_truncate_drops_and_clips_pending_runs():
    s = make_scheduler(device_blocks=200)
    prefill(s, "a", 10)
    s.append_slots("a", 4, num_draft_tokens=3)    # 11..13 drafts
    s.append_slots("a", 4, num_draft_tokens=3)    # 15..17 drafts
    s.truncate("a", 16)
    assert s.pending_drafts("a") == [(11, 3), (15, 1)]
    s.truncate("a", 12)
    assert s.pending_drafts("a") == [(11, 1)]
    s.truncate("a", 11)
    assert s.pending_drafts("a") == []
    s.step()
    s.step()
    assert committed(s, "a") == 11
    s.check_invariants()


@pytest.mark.parametrize("call, match", [
    (lambda s: s.verify_drafts("a", 1), "no draft tokens wait for verification"),
    (lambda s: s.append_slots("a", 2, num_draft_tokens=3), "num_draft_tokens 3 exceeds"),
    (lambda s: s.append_slots("a", 2, num_draft_tokens=-1), "num_draft_tokens must be"),
    (lambda s: s.append_slots("b", 3, num_draft_tokens=3), "inside its 6-token prompt"),
])
def test_bad_draft_calls_are_refused_and_change_nothing(call, match):
    s = make_scheduler(device_blocks=200)
    prefill(s, "a", 9)
    s.add_request("b", 6, 4)
    s.append_slots("b", 4)
    before = s._debug_snapshot()
    with pytest.raises(ValueError, match=match):
        call(s)
    assert s._debug_snapshot() == before


def test_accepting_more_drafts_than_appended_is_refused():
    s = make_scheduler(device_blocks=200)
    prefill(s, "a", 9)
    s.append_slots("a", 3, num_draft_tokens=2)
    before = s._debug_snapshot()
    for bad in (3, -1, 1.5):
        with pytest.raises(ValueError, match="num_accepted|drafts accepted"):
            s.verify_drafts("a", bad)
    assert s._debug_snapshot() == before
    with pytest.raises(Exception, match="verify_drafts"):
        s.verify_drafts("ghost", 0)
    s.verify_drafts("a", np.int64(2))


@pytest.mark.parametrize("watermark", [0.1, 1.0])
def test_verify_drafts_is_all_or_nothing_at_every_fault_point(watermark):
    s = make_scheduler(device_blocks=200, watermark=watermark, full=True)
    prefill(s, "a", 18)
    s.append_slots("a", 4, num_draft_tokens=3)
    s.append_slots("a", 4, num_draft_tokens=3)
    s.step()
    s.hold_reads(["a"])
    points = sweep(lambda: s.verify_drafts("a", 1), s._debug_snapshot, where=SCHEDULER_PARTS)
    assert points > 20
    s.check_invariants()
    assert s.seq_len("a") == 24


def test_random_async_steps_keep_the_bookkeeping_consistent():
    """vLLM's async order on the bookkeeping: every step appends the last token and k drafts
    of each request optimistically, steps, then verifies the previous step's drafts."""
    rng = random.Random(3)
    for watermark in (0.1, 1.0):
        s = make_scheduler(device_blocks=90, watermark=watermark, full=True)
        initial = s.device_block_pool.num_free
        runs = {"a": [], "b": []}        # draft counts appended, not verified yet
        for rid in ("a", "b"):
            prefill(s, rid, rng.randint(4, 20), max_new=40)
        for _ in range(25):
            for rid in ("a", "b"):
                k = rng.randint(0, 3)
                if s.seq_len(rid) + 1 + k > s._requests[rid].reserved_tokens:
                    continue
                s.append_slots(rid, 1 + k, num_draft_tokens=k)
                if k:
                    runs[rid].append(k)
            s.step()
            for rid in ("a", "b"):        # the previous step's verification comes now
                while len(runs[rid]) > 1 or (runs[rid] and rng.random() < 0.3):
                    s.verify_drafts(rid, rng.randint(0, runs[rid].pop(0)))
            assert [c for _, c in s.pending_drafts("a")] == runs["a"]
            s.check_invariants()
        for rid in ("a", "b"):
            s.free_request(rid)
        s.step()
        s.reset_prefix_cache()
        assert s.device_block_pool.num_free == initial


def test_the_chunk_limit_counts_only_tokens_appended_since_the_last_plan():
    """Under ``max_num_batched_tokens`` a rejection re-mirrors the moved tokens, which are
    in a plan already: the next step's append is not refused for them."""
    import dataclasses

    from hisparse_triton.errors import UncommittedTokensError
    from hisparse_triton.scheduler import HiSparseScheduler
    from scheduler_plans import make_plan

    plan = make_plan(device_blocks=200)
    config = dataclasses.replace(plan.config, max_num_batched_tokens=4,
                                 max_concurrent_batches=2)
    s = HiSparseScheduler(plan.kv_cache_config, config, max_num_seqs=3)
    s.add_request("a", 8, 30)
    s.append_slots("a", 4)
    s.step()
    s.append_slots("a", 4)
    s.step()
    s.step()
    s.append_slots("a", 4, num_draft_tokens=3)      # step N: 8..11
    s.step()
    s.append_slots("a", 4, num_draft_tokens=3)      # step N+1: 12..15, before N's verdict
    s.step()
    s.verify_drafts("a", 0)                          # 9..11 rejected: N+1 moves to 9..12
    assert s.seq_len("a") == 13
    s.append_slots("a", 4, num_draft_tokens=3)      # step N+2: 4 new tokens since the plan
    assert s.seq_len("a") == 17
    with pytest.raises(UncommittedTokensError):
        s.append_slots("a", 1)                       # a fifth one is past the limit
    s.step()
    s.check_invariants()
    assert s._requests["a"].scheduled_len == 17
