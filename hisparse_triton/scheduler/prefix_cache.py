"""The scheduler's prefix cache: published prompt pages, named by chained hashes (no torch).

A full page of a prompt is named by ``sha256(parent page's hash + the page's token ids)``
(``page_hashes``), so two prompts whose pages have equal hashes share every token up to
them. Once a page's host copy is durable the scheduler publishes it: the host block and the
device blocks that hold it (indexer and full-attention blocks, and each resident group's
GPU copy). A later request adopts the longest published prefix (``lookup``).

Entries never own blocks: a published page's blocks may be owned by live requests or sit
free in the pools' free queues, still holding the page. When a free block is handed to a
new owner the page it held is gone: a host block or an indexer / full-attention block
invalidates the whole entry (``on_host_block_reused`` / ``on_device_block_reused``), a
resident group's block only that GPU copy (the host still has it).

Every change goes through the scheduler's ``Journal``, so a failed call undoes it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from hisparse_triton.scheduler.journal import Journal


@dataclass
class PrefixEntry:
    """A published prompt page: its host block and the device blocks holding it (device
    group position -> block; 0 for a resident group = that GPU copy is gone)."""

    host_block: int
    blocks: dict[int, int]


def page_hashes(token_ids: np.ndarray, block_size: int) -> list[bytes]:
    """Chained hashes of every full page of ``token_ids`` (int64): page ``p``'s hash is
    ``sha256(hash(p - 1) + its token ids)``, so equal hashes mean equal prefixes."""
    out: list[bytes] = []
    parent = b""
    for page in range(token_ids.size // block_size):
        chunk = token_ids[page * block_size:(page + 1) * block_size]
        parent = hashlib.sha256(parent + chunk.astype("<i8").tobytes()).digest()
        out.append(parent)
    return out


class PrefixCache:
    """Published pages by hash, with the reverse maps that find them from a block.

    ``is_resident(position)`` says whether a device group position is a resident group
    (losing its block keeps the entry); ``on_uncached(block)`` is called when a device block
    stops holding any published page (the scheduler's count of readable free blocks).
    """

    def __init__(self, journal: Journal, is_resident: Callable[[int], bool],
                 on_uncached: Callable[[int], None]) -> None:
        self._journal = journal
        self._is_resident = is_resident
        self._on_uncached = on_uncached
        self._entries: dict[bytes, PrefixEntry] = {}
        self._by_device: dict[int, tuple[bytes, int]] = {}
        self._by_host: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, h: bytes) -> bool:
        return h in self._entries

    def holds_device_block(self, block: int) -> bool:
        """Whether ``block`` holds a published page."""
        return block in self._by_device

    def lookup(self, hashes: list[bytes], max_pages: int) -> list[PrefixEntry]:
        """Entries of the longest published prefix among the first ``max_pages`` pages."""
        hits = []
        for h in hashes[:max_pages]:
            entry = self._entries.get(h)
            if entry is None:
                break
            hits.append(entry)
        return hits

    def publish(self, h: bytes, host_block: int, blocks: dict[int, int]) -> list[int]:
        """Publish a page (a no-op when its hash is already published); returns the device
        blocks it now names (the caller marks the free ones as holding a readable page)."""
        if h in self._entries:
            return []
        j = self._journal
        entry = PrefixEntry(host_block=host_block, blocks=blocks)
        j.setitem(self._entries, h, entry)
        j.setitem(self._by_host, host_block, h)
        named = [block for block in blocks.values() if block]
        for position, block in blocks.items():
            if block:
                j.setitem(self._by_device, block, (h, position))
        return named

    def drop(self, h: bytes) -> None:
        """Forget one published page."""
        j = self._journal
        entry = j.delitem(self._entries, h)
        j.delitem(self._by_host, entry.host_block)
        for block in entry.blocks.values():
            if block and self._by_device.get(block, (None,))[0] == h:
                j.delitem(self._by_device, block)
                self._on_uncached(block)

    def clear(self) -> int:
        """Forget every published page; returns how many there were."""
        hashes = list(self._entries)
        for h in hashes:
            self.drop(h)
        return len(hashes)

    def on_host_block_reused(self, block: int) -> None:
        """A free host block was handed out: the page it held is gone from the host."""
        h = self._by_host.get(block)
        if h is not None:
            self.drop(h)

    def on_device_block_reused(self, block: int) -> None:
        """A free device block was handed out: the published page it held is gone."""
        cached: Optional[tuple[bytes, int]] = self._by_device.get(block)
        if cached is None:
            return
        h, position = cached
        if self._is_resident(position):   # a GPU copy of a page the host still has
            self._journal.delitem(self._by_device, block)
            self._journal.setitem(self._entries[h].blocks, position, 0)
        else:
            self.drop(h)

    def snapshot(self) -> tuple:
        """Comparable state (tests)."""
        return (sorted((h, e.host_block, sorted(e.blocks.items()))
                       for h, e in self._entries.items()),
                sorted(self._by_device.items()), sorted(self._by_host.items()))


__all__ = ["PrefixCache", "PrefixEntry", "page_hashes"]
