"""``HiSparseScheduler.truncate``: rolling back rejected speculative tokens (no torch).

Checked on the bookkeeping alone (the worker side of ``invalidate`` is
``tests/test_worker_invalidate.py``; exactness against a dense oracle is in
``tests/test_serving.py``).
"""

import random

import numpy as np
import pytest

from scheduler_plans import B, FULL, SWA, make_scheduler, tokens


def prefill(s, rid, n, max_new=24, token_ids=None):
    s.add_request(rid, n, max_new, token_ids=token_ids)
    s.append_slots(rid, n)
    s.step()


def test_truncate_returns_the_pages_past_the_new_end_in_every_group():
    s = make_scheduler(device_blocks=200, full=True, window=True)
    prefill(s, "a", 10)
    free = s.device_block_pool.num_free
    s.append_slots("a", 9)                 # 19 tokens: pages 3 and 4 in every paged group
    paged = len(s.devices.paged)
    assert s.device_block_pool.num_free == free - 2 * paged
    s.truncate("a", 12)                   # keeps pages 0..2
    assert s.seq_len("a") == 12
    assert s.device_block_pool.num_free == free
    for layer in ("model.layers.0.self_attn.attn", FULL, SWA):
        assert len(s.block_table("a", layer)) == 3
    plan = s.step()
    assert plan.num_invalidate == 0        # not offloaded: no hot slot can hold its rows
    s.check_invariants()
    s.append_slots("a", 8)                # the positions are appended again
    s.step()
    s.check_invariants()


def test_truncate_to_the_same_length_changes_nothing():
    s = make_scheduler()
    prefill(s, "a", 9)
    before = s._debug_snapshot()
    s.truncate("a", 9)
    assert s._debug_snapshot() == before


@pytest.mark.parametrize("bad, match", [
    (13, r"cannot truncate to 13 tokens, it has 12"),
    (8, r"cannot truncate to 8 tokens: its first 9 are durable"),
    (-1, r"new_len must be an int >= 0, got -1"),
    (2.5, r"new_len must be an int >= 0, got 2.5"),
])
def test_bad_truncations_are_refused_and_change_nothing(bad, match):
    s = make_scheduler()
    prefill(s, "a", 9)
    s.step()                               # the 9 prompt tokens are durable
    s.append_slots("a", 3)
    before = s._debug_snapshot()
    with pytest.raises(ValueError, match=match):
        s.truncate("a", bad)
    assert s._debug_snapshot() == before
    with pytest.raises(Exception, match="truncate"):
        s.truncate("nobody", 1)


def test_numpy_lengths_are_accepted():
    s = make_scheduler()
    prefill(s, "a", 9)
    s.append_slots("a", 3)
    s.truncate("a", np.int64(10))
    assert s.seq_len("a") == 10


def test_an_offloaded_request_invalidates_the_host_rows_of_the_dropped_tokens():
    s = make_scheduler(device_blocks=200, watermark=1.0)
    prefill(s, "a", 20)
    s.step()                               # durable: a offloads (pure HiSparse)
    assert s.is_offloaded("a")
    s.append_slots("a", 7)                # positions 20..26
    s.step()                               # in a plan's mirror rows, not durable yet
    s.truncate("a", 22)
    plan = s.step()
    host = s.host_block_table("a")
    expected = [(s.state_row("a"), host[5] * B + 2, host[5] * B + 4),
                (s.state_row("a"), host[6] * B, host[6] * B + 3)]
    assert [tuple(e) for e in plan.invalidate.tolist()] == expected
    s.check_invariants()


def test_a_mirror_already_planned_for_dropped_tokens_only_writes_the_requests_own_rows():
    """The plan that mirrors positions 20..26 was emitted before the rollback: its host rows
    are the request's own (its reservation stays), which nothing else reads."""
    s = make_scheduler(device_blocks=200)
    prefill(s, "a", 20, max_new=12)
    s.append_slots("a", 7)
    plan = s.step()
    s.truncate("a", 21)
    own = {h * B + o for h in s.host_block_table("a") for o in range(B)}
    assert set(plan.mirror_host_rows.tolist()) <= own
    assert len(s.host_block_table("a")) == 8          # cdiv(20 + 12, 4): still reserved
    s.free_request("a")
    s.check_invariants()


def test_dropped_generated_pages_are_never_published():
    s = make_scheduler(device_blocks=200)
    prompt = tokens(8)
    prefill(s, "a", 8, token_ids=prompt)
    s.append_slots("a", 8, token_ids=[1] * 8)      # two generated pages, not durable
    s.truncate("a", 9)
    s.append_slots("a", 7, token_ids=[2] * 7)
    s.step()
    s.step()                                        # durable: pages 0..3 published
    s.free_request("a")
    # the rejected continuation was never published, the accepted one was
    assert s.add_request("x", 17, 0, token_ids=prompt + [1] * 9) == 8
    assert s.add_request("y", 17, 0, token_ids=prompt + [1] + [2] * 7 + [5]) == 16
    s.check_invariants()


def test_a_reset_row_drops_its_pending_invalidations():
    s = make_scheduler(device_blocks=200, watermark=1.0)
    prefill(s, "a", 20)
    s.step()
    s.append_slots("a", 3)
    s.truncate("a", 21)
    s.free_request("a")
    plan = s.step()
    assert plan.num_invalidate == 0


def test_random_rollbacks_keep_the_bookkeeping_consistent():
    rng = random.Random(5)
    for watermark in (0.1, 1.0):
        s = make_scheduler(device_blocks=90, watermark=watermark, window=True)
        initial = s.device_block_pool.num_free
        for rid in ("a", "b"):
            prefill(s, rid, rng.randint(4, 20), max_new=40)
        for _ in range(30):
            for rid in ("a", "b"):
                q = rng.randint(1, 3)
                if s.seq_len(rid) + q > s._requests[rid].reserved_tokens:
                    continue
                s.append_slots(rid, q)
                s.truncate(rid, s.seq_len(rid) - rng.randint(0, q - 1))
            s.step()
            s.check_invariants()
        for rid in ("a", "b"):
            s.free_request(rid)
        s.reset_prefix_cache()
        assert s.device_block_pool.num_free == initial


def test_append_decode_hashes_generated_pages_on_both_paths():
    """The decode batch takes one token id per request; full generated pages are published
    once durable (the one-by-one path, taken for a reclaim or a repeated id, does too)."""
    s = make_scheduler(device_blocks=200)
    prompt = tokens(6)
    for rid in ("a", "b"):
        prefill(s, rid, 6, token_ids=prompt)
    before = s._debug_snapshot()
    with pytest.raises(ValueError, match=r"one id per request \(2\)"):
        s.append_decode(["a", "b"], token_ids=[1])
    assert s._debug_snapshot() == before
    for step in range(6):
        s.append_decode(["a", "b"], token_ids=[10 + step, 20 + step])
        s.step()
    s.append_decode(["a", "a"], token_ids=[16, 17])        # one id twice: one by one
    s.step()
    s.step()
    s.free_request("a")
    s.free_request("b")
    assert s.add_request("x", 13, 0, token_ids=prompt + list(range(10, 17))) == 12
    assert s.add_request("y", 13, 0, token_ids=prompt + list(range(20, 27))) == 12
    assert s.add_request("z", 13, 0, token_ids=prompt + [20, 21, 99, 23, 24, 25, 26]) == 8
    s.check_invariants()
