"""A manager per device group: chosen by group kind; count first, then allocate; the
sliding-window one releases skipped pages, the resident one unpins and loses pages, the hot
one reserves, takes and frees regions."""

import dataclasses

import pytest

from hisparse_triton.config import ACTIVE_TAIL_PAGES
from hisparse_triton.groups import DeviceGroup, GroupKind, IndexerGroup
from hisparse_triton.scheduler.managers import (
    HotManager,
    PagedManager,
    ResidentManager,
    SlidingWindowManager,
    manager_class,
)
from scheduler_plans import B, make_scheduler


def managers_of(s, klass):
    return [m for m in s.devices.managers if type(m) is klass]


def test_every_group_kind_has_its_manager():
    s = make_scheduler(full=True, window=True)
    kinds = {(m.group.kind, type(m.group).__name__, type(m)) for m in s.devices.managers}
    assert kinds == {(GroupKind.INDEXER, "IndexerGroup", PagedManager),
                     (GroupKind.RESIDENT, "ResidentGroup", ResidentManager),
                     (GroupKind.HOT, "HotGroup", HotManager),
                     (GroupKind.REGULAR, "RegularGroup", PagedManager),
                     (GroupKind.REGULAR, "SlidingWindowGroup", SlidingWindowManager)}
    assert [m.position for m in s.devices.managers] == list(range(len(s.groups.groups)))

    @dataclasses.dataclass(frozen=True)
    class Unknown(DeviceGroup):
        kind = GroupKind.REGULAR

    group = s.groups.groups[0]
    with pytest.raises(ValueError, match="no group manager handles Unknown"):
        manager_class(Unknown(position=0, config_index=0, spec=group.spec,
                              block_size=B, width=1))


def test_paged_managers_count_then_allocate_and_free_tail_first():
    s = make_scheduler(full=True)
    s.add_request("a", 10, 10)
    req = s._requests["a"]
    counts = s.devices.count_new_blocks(req, 10)
    assert counts == [3] * len(s.devices.paged)          # 10 tokens: 3 pages everywhere
    before = s.device_block_pool.num_free
    rows = s.append_slots("a", 10)
    assert s.device_block_pool.num_free == before - sum(counts)
    indexer = s.devices.managers[s.groups.groups.index(s.groups.of_kind(IndexerGroup)[0])]
    table = indexer.table(req)
    assert len(table) == 3 and all(table) and indexer.num_blocks == 3
    name = indexer.group.layer_names[0]
    assert rows[name].tolist() == [table[p // B] * B + p % B for p in range(10)]
    assert s.devices.count_new_blocks(req, 12) == [0] * len(s.devices.paged)
    s.free_request("a")
    assert indexer.num_blocks == 0 and not indexer.blocks.any()
    # tail first: the request's last page is the first of its blocks in the free queue
    queue = list(s.device_block_pool._free)
    assert queue.index(table[2]) < queue.index(table[1]) < queue.index(table[0])


def test_the_sliding_window_manager_releases_pages_out_of_every_window():
    s = make_scheduler(window=True)
    s.add_request("a", 24, 8)
    s.append_slots("a", 24)
    s.step()
    s.step()                                  # 24 tokens durable; window 8: pages 0..3 done
    window = managers_of(s, SlidingWindowManager)[0]
    req = s._requests["a"]
    assert window.table(req)[:4] == [0, 0, 0, 0] and all(window.table(req)[4:])
    assert window.num_blocks == 2 and s.stats().window_released_pages == 4
    s.free_request("a")
    assert window.num_blocks == 0 and s.stats().regular_blocks == 0


def test_the_resident_manager_unpins_then_loses_pages_on_reuse():
    # a's 10 pages x 3 paged groups + its hot region + b's reserved one: no other free block
    s = make_scheduler(max_num_seqs=2, device_blocks=47, watermark=10**6)   # always pressure
    s.add_request("a", 40, 8)
    s.append_slots("a", 40)
    s.step()
    s.step()
    req, (resident, *_) = s._requests["a"], managers_of(s, ResidentManager)
    unpinned = 40 // B - ACTIVE_TAIL_PAGES
    assert req.released_pages == unpinned and req.hot is not None
    table = resident.table(req)
    assert all(table)                          # unpinned pages stay readable
    assert s.device_block_pool.num_cached == 2 * unpinned
    assert resident.reader_counts() == {b: 1 for b in table[:unpinned]}
    s.add_request("b", 20, 0)
    s.append_slots("b", 20)                    # takes the cached blocks, newest first
    plan = s.flush()
    lost = [p for p, b in enumerate(resident.table(req)) if b == 0]
    assert lost and max(lost) == unpinned - 1 and plan.num_lost >= len(lost)
    assert [int(row) for row in plan.lost[:, 0]] == [req.row] * plan.num_lost
    s.check_invariants()


def test_the_hot_manager_reserves_takes_and_frees_regions():
    s = make_scheduler(max_num_seqs=2, watermark=1.0)
    hot = s.devices.hot
    s.add_request("a", 20, 4)
    assert all(m.reserved == m.width for m in hot) and s.stats().hot_blocks == 0
    s.append_slots("a", 20)
    s.step()
    s.step()                                  # offloads: the regions are taken
    req = s._requests["a"]
    assert all(m.reserved == 0 and len(m.table(req)) == m.width for m in hot)
    assert s.stats().hot_blocks == sum(m.width for m in hot)
    s.add_request("b", 4, 4)                  # b reserves, a does not any more
    s.free_request("a")
    s.free_request("b")
    assert all(m.reserved == 0 and m.num_blocks == 0 for m in hot)
    assert s.device_block_pool.num_free == s.device_block_pool.capacity


def test_manager_state_changes_are_journaled():
    s = make_scheduler(window=True, watermark=1.0)
    s.add_request("a", 30, 4)
    s.append_slots("a", 30)
    s.step()
    before = s._debug_snapshot()
    with pytest.raises(RuntimeError):
        with s.journal.transaction():
            s.step()                          # offload, unpin, window release, a new plan
            s.free_request("a")
            raise RuntimeError("roll back")
    assert s._debug_snapshot() == before


def test_a_uniform_spec_of_one_sliding_window_type_is_a_sliding_window_group():
    """A ``UniformTypeKVCacheSpecs`` names its kind by its first spec: windows of one size
    are a sliding-window group (they were a regular group: no page was ever released)."""
    from hisparse_triton.groups import RegularGroup, SlidingWindowGroup, group_class
    from hisparse_triton.specs import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    window = dict(block_size=4, num_kv_heads=1, head_size=8, dtype="uint8", sliding_window=8)
    uniform = UniformTypeKVCacheSpecs.from_specs({"a": SlidingWindowSpec(**window),
                                                  "b": SlidingWindowSpec(**window)})
    group = KVCacheGroupSpec(layer_names=("a", "b"), kv_cache_spec=uniform)
    assert group_class(group) is SlidingWindowGroup
    made = SlidingWindowGroup(position=0, config_index=0, spec=group, block_size=4, width=4)
    assert made.window == 8
    full = UniformTypeKVCacheSpecs.from_specs({"c": FullAttentionSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype="uint8")})
    assert group_class(KVCacheGroupSpec(layer_names=("c",), kv_cache_spec=full)) \
        is RegularGroup


@pytest.mark.parametrize("extra, committed, pages", [
    (0, 8, 0), (0, 11, 1), (0, 15, 2), (0, 16, 2), (2, 11, 0), (2, 13, 1), (2, 17, 2)])
def test_window_pages_are_released_by_the_specs_retained_tokens(extra, committed, pages):
    """Queries from ``committed`` on read ``[committed - window + 1, ...]``, and the spec
    keeps ``extra_retained_tokens`` more: ``(committed - window + 1 - extra) // B``."""
    from hisparse_triton.groups import SlidingWindowGroup
    from hisparse_triton.specs import KVCacheGroupSpec, SlidingWindowSpec

    spec = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="uint8",
                             sliding_window=8, extra_retained_tokens=extra)
    group = SlidingWindowGroup(position=0, config_index=0, block_size=4, width=8,
                               spec=KVCacheGroupSpec(layer_names=("w",), kv_cache_spec=spec))
    assert group.releasable_pages(committed) == pages
    assert pages == max(0, committed - 8 + 1 - extra) // 4
