"""The scheduler's prefix cache: published pages, named by chained hashes (no torch).

A full page of a prompt (or of generated tokens appended with their ids) is named by ``sha256(parent page's hash + the page's token ids)``
(``page_hashes``), so two prompts whose pages have equal hashes share every token up to
them. Once a page's host copy is durable the scheduler publishes it: the host block and the
device blocks that hold it (indexer and full-attention blocks, and each resident group's
GPU copy). A later request adopts the longest published prefix (``lookup``).

Entries never own blocks: a published page's blocks may be owned by live requests or sit
free in the pools' free queues, still holding the page. The cache is a *reader* of every
block it names (``BlockPool.add_reader``), so those free blocks count as cached, and the
pools tell it when one is handed to a new owner (their ``on_reuse`` hooks): the page it held
is gone. A host block or an indexer / full-attention block invalidates the whole entry
(``on_host_block_reused`` / ``on_device_block_reused``), a resident group's block only that
GPU copy (the host still has it).

Every change goes through the scheduler's ``Journal``, so a failed compound call undoes it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Hashable, Iterable, Optional, Sequence

import numpy as np

from hisparse_triton.scheduler.block_pool import BlockPool
from hisparse_triton.scheduler.journal import Journal

if TYPE_CHECKING:  # pragma: no cover
    from hisparse_triton.scheduler.requests import Request


@dataclass
class PrefixEntry:
    """A published page (of a prompt, or generated with ``token_ids``): its host block and the device blocks holding it (device
    group position -> block; 0 for a resident group = that GPU copy is gone)."""

    host_block: int
    blocks: dict[int, int]


def page_hashes(token_ids: np.ndarray, block_size: int,
                first_page: int = 0, parent: bytes = b"") -> list[bytes]:
    """Chained hashes of every full page of ``token_ids`` (int64): page ``p``'s hash is
    ``sha256(hash(p - 1) + its token ids)``, so equal hashes mean equal prefixes. With
    ``first_page`` and ``parent`` (the hash of page ``first_page - 1``), only the pages from
    ``first_page`` on (a chain that grows with a request's generated tokens)."""
    out: list[bytes] = []
    for page in range(first_page, token_ids.size // block_size):
        chunk = token_ids[page * block_size:(page + 1) * block_size]
        parent = hashlib.sha256(parent + chunk.astype("<i8").tobytes()).digest()
        out.append(parent)
    return out


def prompt_page_hashes(request_id: Hashable, prompt_len: int,
                       token_ids: Optional[Sequence[int]], block_size: int) -> list[bytes]:
    """``page_hashes`` of a prompt given as ``prompt_len`` ints (``[]`` without token ids);
    ``ValueError`` naming the request for anything else."""
    if token_ids is None:
        return []
    try:
        tokens = np.asarray(token_ids)
    except (TypeError, ValueError):
        tokens = np.asarray([], dtype=object)
    if tokens.ndim != 1 or tokens.size != prompt_len \
            or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"request {request_id!r}: token_ids must be {prompt_len} ints "
                         f"(one per prompt token), got "
                         f"{getattr(tokens, 'size', '?')} of {tokens.dtype}.")
    return page_hashes(tokens.astype(np.int64), block_size)


class PrefixCache:
    """Published pages by hash, with the reverse maps that find them from a block.

    ``host_pool`` / ``device_pool``: the pools whose blocks entries name (the cache reads
    them); ``is_resident(position)`` says whether a device group position is a resident
    group (losing its block keeps the entry).
    """

    def __init__(self, journal: Journal, host_pool: BlockPool, device_pool: BlockPool,
                 is_resident: Callable[[int], bool]) -> None:
        self._journal = journal
        self._host_pool = host_pool
        self._device_pool = device_pool
        self._is_resident = is_resident
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

    def publish(self, h: bytes, host_block: int, blocks: dict[int, int]) -> None:
        """Publish a page (a no-op when its hash is already published): the cache reads its
        host block and every device block in ``blocks`` (0 = no GPU copy)."""
        if h in self._entries:
            return
        j = self._journal
        entry = PrefixEntry(host_block=host_block, blocks=blocks)
        j.setitem(self._entries, h, entry)
        j.setitem(self._by_host, host_block, h)
        self._host_pool.add_reader(host_block)
        for position, block in blocks.items():
            if block:
                j.setitem(self._by_device, block, (h, position))
                self._device_pool.add_reader(block)

    def publish_durable(self, req: "Request", page_blocks: Callable[[int], dict[int, int]],
                        required: Iterable[int], block_size: int) -> None:
        """Publish ``req``'s full pages (prompt, and generated ones whose ids it knows) that
        became durable since the last call.
        ``page_blocks(page)``: the page's device block per group position; a page missing
        a block of a ``required`` position (indexer, full attention) is skipped."""
        end = min(len(req.page_hashes), req.committed_len // block_size)
        for page in range(req.published_pages, end):
            h = req.page_hashes[page]
            if h in self._entries:
                continue
            blocks = page_blocks(page)
            if all(blocks[position] for position in required):
                self.publish(h, req.host_blocks[page], blocks)
        if end > req.published_pages:
            self._journal.setattr(req, "published_pages", end)

    def drop(self, h: bytes) -> None:
        """Forget one published page."""
        j = self._journal
        entry = j.delitem(self._entries, h)
        j.delitem(self._by_host, entry.host_block)
        self._host_pool.drop_reader(entry.host_block)
        for block in entry.blocks.values():
            if block and self._by_device.get(block, (None,))[0] == h:
                j.delitem(self._by_device, block)
                self._device_pool.drop_reader(block)

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
            self._device_pool.drop_reader(block)
        else:
            self.drop(h)

    def check_invariants(self) -> list[str]:
        """Broken rules, as messages: the reverse maps name exactly the entries' blocks."""
        problems = []
        by_host = {e.host_block: h for h, e in self._entries.items()}
        if by_host != self._by_host:
            problems.append("prefix cache: the host reverse map disagrees with its entries")
        by_device = {b: (h, p) for h, e in self._entries.items()
                     for p, b in e.blocks.items() if b}
        if by_device != self._by_device:
            problems.append("prefix cache: the device reverse map disagrees with its entries")
        return problems

    def device_blocks(self) -> list[int]:
        """Every device block a published page names (each is read by the cache)."""
        return list(self._by_device)

    def host_blocks(self) -> list[int]:
        """Every host block a published page names (each is read by the cache)."""
        return list(self._by_host)

    def snapshot(self) -> tuple:
        """Comparable state (tests)."""
        return (sorted((h, e.host_block, sorted(e.blocks.items()))
                       for h, e in self._entries.items()),
                sorted(self._by_device.items()), sorted(self._by_host.items()))


__all__ = ["PrefixCache", "PrefixEntry", "page_hashes", "prompt_page_hashes"]
