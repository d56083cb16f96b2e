"""The prefix cache reads the blocks it names: published pages keep free blocks cached, a
reused indexer or host block drops the page, a reused resident block only its GPU copy."""

import numpy as np
import pytest

from hisparse_triton.scheduler.block_pool import BlockPool
from hisparse_triton.scheduler.journal import Journal
from hisparse_triton.scheduler.prefix_cache import PrefixCache, page_hashes, prompt_page_hashes


def cache():
    journal = Journal()
    host = BlockPool(8, "host", journal)
    device = BlockPool(8, "device", journal)
    prefix = PrefixCache(journal, host, device, is_resident=lambda position: position == 1)
    host.on_reuse, device.on_reuse = prefix.on_host_block_reused, prefix.on_device_block_reused
    return journal, host, device, prefix


def one_published_page():
    """A cache with one page published: host block, indexer (group 0) and resident (group
    1) device blocks, all still owned."""
    journal, host, device, prefix = cache()
    (h,) = page_hashes(np.arange(4), 4)
    (hb,) = host.allocate(1)
    indexer, resident = device.allocate(2)
    prefix.publish(h, hb, {0: indexer, 1: resident})
    return journal, host, device, prefix, h, hb, indexer, resident


def test_chained_hashes_name_prefixes():
    a = page_hashes(np.arange(12), 4)
    b = page_hashes(np.r_[np.arange(8), [9, 9, 9, 9]], 4)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert prompt_page_hashes("r", 8, None, 4) == []
    with pytest.raises(ValueError, match="token_ids must be 8 ints"):
        prompt_page_hashes("r", 8, [1.5] * 8, 4)


def test_published_pages_are_read_and_their_free_blocks_cached():
    journal, host, device, prefix, h, hb, indexer, resident = one_published_page()
    assert host.readers(hb) == device.readers(indexer) == device.readers(resident) == 1
    device.free([indexer, resident])
    host.free([hb])
    assert device.num_cached == 2 and host.num_cached == 1
    assert [e.host_block for e in prefix.lookup([h], 1)] == [hb]
    assert prefix.check_invariants() == []


def test_reuse_of_a_resident_block_keeps_the_page_reuse_of_an_indexer_block_drops_it():
    journal, host, device, prefix, h, hb, indexer, resident = one_published_page()
    device.free([resident, indexer])         # resident first in the queue
    device.allocate(device.num_free - 1)     # every free block but the indexer's
    assert h in prefix and prefix.lookup([h], 1)[0].blocks == {0: indexer, 1: 0}
    before = prefix.snapshot()
    with pytest.raises(RuntimeError):
        with journal.transaction():
            device.allocate(1)               # the indexer's block: the page is gone
            assert h not in prefix and host.readers(hb) == 0
            raise RuntimeError("roll back")
    assert prefix.snapshot() == before and host.readers(hb) == 1
    host.free([hb])
    host.allocate(host.num_free)             # the host block is reused last
    assert h not in prefix and len(prefix) == 0 and device.readers(indexer) == 0


def test_clear_forgets_every_page():
    journal, host, device, prefix = cache()
    for h in page_hashes(np.arange(8), 4):
        prefix.publish(h, host.allocate(1)[0], {0: device.allocate(1)[0]})
    assert prefix.clear() == 2 and len(prefix) == 0
    assert not host._readers_array.any() and not device._readers_array.any()
