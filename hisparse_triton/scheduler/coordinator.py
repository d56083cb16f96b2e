"""``GroupCoordinator``: every device group's manager, driven as one (no torch).

The scheduler speaks to the device groups through this object; it only orders the work of
the managers (``managers.py``): growing a request in every paged group in config order,
freeing it (paged groups, then hot regions), unpinning its durable pages tail first across
the resident groups, taking its hot regions, adopting a cached prefix, and telling the
resident groups when the pool reuses a block they read.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from hisparse_triton.groups import DEVICE_KINDS, GroupKind, PlanGroups, ResidentGroup
from hisparse_triton.scheduler.block_pool import BlockPool
from hisparse_triton.scheduler.journal import Journal
from hisparse_triton.scheduler.managers import (
    GroupManager,
    HotManager,
    PagedManager,
    ResidentManager,
    SlidingWindowManager,
    manager_class,
)
from hisparse_triton.scheduler.plan_builder import PlanBuilder
from hisparse_triton.scheduler.prefix_cache import PrefixEntry
from hisparse_triton.scheduler.requests import Request
from hisparse_triton.scheduler.stats import Counters


class GroupCoordinator:
    """The managers of a plan's device groups (``managers[position]``), by role:
    ``paged`` (a block per page: indexer, regular, sliding window, resident), ``resident``,
    ``windowed``, ``hot``."""

    def __init__(self, groups: PlanGroups, pool: BlockPool, plan_builder: PlanBuilder,
                 journal: Journal, counters: Counters, max_num_seqs: int) -> None:
        self.journal = journal
        self.managers: list[GroupManager] = [
            manager_class(g)(g, pool, plan_builder, journal, counters, max_num_seqs)
            for g in groups.groups]
        self.paged = [m for m in self.managers if isinstance(m, PagedManager)]
        self.resident = [m for m in self.paged if isinstance(m, ResidentManager)]
        self.windowed = [m for m in self.paged if isinstance(m, SlidingWindowManager)]
        self.hot = [m for m in self.managers if isinstance(m, HotManager)]
        self.resident_positions = frozenset(m.position for m in self.resident)
        #: Device blocks of one request's hot regions (reserved at admission).
        self.hot_cost = sum(m.width for m in self.hot)
        #: The layers of each paged group (sparse layers under their model names).
        self.row_names = [m.group.model_layer_names if isinstance(m.group, ResidentGroup)
                          else m.group.layer_names for m in self.paged]
        self._block_sizes = sorted({m.block_size for m in self.paged})
        #: Every paged group's block table in one ``[paged groups, max_num_seqs, width]``
        #: array (the managers' ``blocks`` are views of it), when they share one block
        #: size and width (None otherwise): a decode batch's rows in one gather.
        self.tables = _stack_tables(self.paged)
        #: The paged groups' one block size when ``tables`` is set (0 otherwise).
        self.uniform_block_size = self.paged[0].block_size if self.tables is not None else 0
        self._resident_index = np.array([i for i, m in enumerate(self.paged)
                                         if isinstance(m, ResidentManager)], dtype=np.int64)
        #: ``tables`` as ``[paged groups, max_num_seqs * width]`` (a view; None unstacked)
        #: and its resident groups' rows as a view when they are consecutive (else None).
        self._flat_tables = (None if self.tables is None
                             else self.tables.reshape(len(self.paged), -1))
        self._flat_resident = _consecutive_rows(self._flat_tables, self._resident_index)

    # -- queries ---------------------------------------------------------------------------
    @property
    def reserved(self) -> int:
        """Device blocks reserved for the hot regions of requests that have not offloaded."""
        return sum(m.reserved for m in self.hot)

    def in_use(self) -> dict[GroupKind, int]:
        """Block references held per group kind."""
        out = dict.fromkeys(DEVICE_KINDS, 0)
        for m in self.managers:
            out[m.group.kind] += m.num_blocks
        return out

    def starts_no_page(self, position: int) -> bool:
        """Whether a token at ``position`` starts no page in any group (the decode step)."""
        return all(position % b for b in self._block_sizes)

    def count_new_blocks(self, req: Request, new_len: int) -> list[int]:
        """Blocks growing ``req`` to ``new_len`` tokens takes, per paged group."""
        return [m.count_new_blocks(req, new_len) for m in self.paged]

    def page_blocks(self, req: Request, page: int, *, resident: bool = True) -> dict[int, int]:
        """Every paged group's block of ``req``'s ``page`` (0 = none), by position; with
        ``resident=False`` the resident groups' entries are 0 (their GPU copies are not
        offered for reuse: pure HiSparse drops them at once)."""
        return {m.position: (int(m.blocks[req.row, page])
                             if resident or m.position not in self.resident_positions else 0)
                for m in self.paged}

    def resident_blocks(self, req: Request, first: int, limit: int) -> list[int]:
        """The resident groups' blocks of ``req``'s pages ``[first, limit)`` (0 = none)."""
        return [int(m.blocks[req.row, page]) for page in range(first, limit)
                for m in self.resident]

    # -- rows ------------------------------------------------------------------------------
    def rows(self, req: Request, start: int, end: int) -> list[np.ndarray]:
        """``[end - start] int64`` device rows of positions ``[start, end)`` per paged group."""
        return [m.rows(req, start, end) for m in self.paged]

    def row_at(self, req: Request, position: int) -> list[int]:
        """The device row of one position in every paged group."""
        return [int(m.blocks[req.row, position // m.block_size]) * m.block_size
                + position % m.block_size for m in self.paged]

    def decode_rows(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """``[paged groups, R] int64`` device rows of one position per state row."""
        if not rows.size or self.tables is None:
            return self._unstacked_rows(self.paged, rows, positions)
        return self._gather_rows(self._flat_tables, rows, positions)

    def resident_decode_rows(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """``[resident groups, R] int64`` device rows of one position per state row."""
        if not rows.size or self.tables is None or not self.resident:
            return self._unstacked_rows(self.resident, rows, positions)
        if self._flat_resident is not None:
            return self._gather_rows(self._flat_resident, rows, positions)
        return self._gather_rows(self._flat_tables, rows, positions)[self._resident_index]

    def _unstacked_rows(self, managers: Sequence[PagedManager], rows: np.ndarray,
                        positions: np.ndarray) -> np.ndarray:
        """``[len(managers), R] int64`` rows, a gather per manager (none for no rows)."""
        if not rows.size or not managers:
            return np.empty((len(managers), rows.size), dtype=np.int64)
        return np.stack([m.decode_rows(rows, positions) for m in managers])

    def _gather_rows(self, flat: np.ndarray, rows: np.ndarray,
                     positions: np.ndarray) -> np.ndarray:
        """``[g, R] int64`` rows of ``flat`` (``[g, max_num_seqs * width] int32``, stacked
        tables' rows): one ``take`` of each (state row, page) entry; ``block * B +
        position % B`` computed as ``(block - page) * B + position``."""
        B = self.uniform_block_size
        page = positions // B
        table = flat.take(rows * self.tables.shape[2] + page, axis=1).astype(np.int64)
        table -= page
        table *= B
        table += positions
        return table

    # -- lifecycle -------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        for m in self.managers:
            m.add_request(req)

    def grow(self, req: Request, new_len: int, counts: Sequence[int]) -> None:
        """Allocate ``counts`` (``count_new_blocks``, known to fit) in every paged group."""
        for m, count in zip(self.paged, counts):
            m.allocate(req, new_len, count)

    def adopt_prefix(self, req: Request, hits: Sequence[PrefixEntry],
                     counters: Counters) -> bool:
        """Share the cached prefix pages' surviving device blocks with ``req``; returns
        whether a resident page survives only on the host (``req`` must offload)."""
        host_only = False
        for page, entry in enumerate(hits):
            for m in self.paged:
                block = entry.blocks.get(m.position, 0)
                if not block:
                    host_only = True
                    continue
                m.adopt(req, page, block)
                if isinstance(m, ResidentManager):
                    counters.add("readopted_pages", 1)
        return host_only

    def offload(self, req: Request) -> None:
        """Give ``req`` its hot regions (reserved at admission)."""
        self.journal.setattr(req, "hot", {})
        for m in self.hot:
            m.take_region(req)

    def unpin(self, req: Request, first: int, limit: int, *, drop: bool) -> None:
        """Unpin resident pages ``[first, limit)`` of ``req``, tail first, so the newest
        page enters the free queue first (is reused first)."""
        for page in range(limit - 1, first - 1, -1):
            for m in self.resident:
                m.unpin(req, page, drop=drop)
        self.journal.setattr(req, "released_pages", limit)

    def release_windows(self, req: Request) -> None:
        for m in self.windowed:
            m.release(req)

    def free(self, req: Request) -> None:
        """Return every device block of ``req``: paged groups in order, then hot regions."""
        for m in self.paged:
            m.free(req)
        for m in self.hot:
            m.free(req)

    def truncate(self, req: Request, new_len: int,
                 keep: Optional[Callable[[list[int]], None]] = None) -> None:
        """Return the blocks of ``req``'s pages past ``new_len`` tokens in every group (hot
        regions stay: they are the request's for its lifetime); ``keep``: takes the resident
        groups' blocks over instead of the pool (a resolve may have read them)."""
        for m in self.managers:
            m.truncate(req, new_len, keep if isinstance(m, ResidentManager) else None)

    def reader_rows(self, block: int) -> list[int]:
        """The state rows whose unpinned resident pages ``block`` holds."""
        for m in self.resident:
            rows = m.reader_rows(block)
            if rows:
                return rows
        return []

    def on_reuse(self, block: int) -> None:
        """The pool handed ``block`` to a new owner: a resident group reading it loses the
        pages it held there."""
        for m in self.resident:
            if m.on_reuse(block):
                return

    # -- checks ----------------------------------------------------------------------------
    def snapshot(self) -> tuple:
        return tuple(m.snapshot() for m in self.managers)


def _consecutive_rows(flat: Optional[np.ndarray], index: np.ndarray) -> Optional[np.ndarray]:
    """``flat[index]`` as a view when ``index`` (``[n] int64``, n >= 1) counts up by one;
    None otherwise (or without ``flat``)."""
    if flat is None or not index.size or (np.diff(index) != 1).any():
        return None
    return flat[int(index[0]):int(index[-1]) + 1]


def _stack_tables(paged: Sequence[PagedManager]) -> Optional[np.ndarray]:
    """One array holding every ``paged`` manager's block table (each keeps a view), when
    they share one block size and one table shape; None otherwise (or none paged)."""
    if not paged or len({(m.block_size, m.blocks.shape) for m in paged}) != 1:
        return None
    tables = np.zeros((len(paged), *paged[0].blocks.shape), dtype=np.int32)
    for m, table in zip(paged, tables):
        m.use_table(table)
    return tables


__all__ = ["GroupCoordinator"]
