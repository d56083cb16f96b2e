"""``Durability``: the scheduler's residency actions (publishing, unpinning, reclaiming)."""

from scheduler_plans import make_scheduler, tokens


def test_make_durable_publishes_and_reports_what_it_released():
    s = make_scheduler(device_blocks=200, watermark=1.0)
    s.add_request("a", 24, 8, token_ids=tokens(24))
    s.append_slots("a", 24)
    s.step()                                   # mirrors the 24 tokens
    released = s.durability.make_durable()     # they are durable now
    assert released == s.unpinned_pages("a") * len(s.devices.resident) > 0
    assert len(s._prefix) == 6 and s.is_offloaded("a")
    # pure HiSparse: the published pages name no resident GPU copy
    resident = s.devices.resident_positions
    assert all(not b for e in s._prefix._entries.values()
               for p, b in e.blocks.items() if p in resident)
    assert s.step().released_pages == 0        # nothing more to release
    s.check_invariants()


def test_a_model_with_a_sliding_window_publishes_nothing():
    s = make_scheduler(device_blocks=200, window=True)
    assert s.durability.prefix is None and not s.prefix_caching
    s.add_request("a", 24, 8, token_ids=tokens(24))
    s.append_slots("a", 24)
    s.step()
    s.step()
    assert len(s._prefix) == 0 and s.stats().window_released_pages > 0
