"""One manager per device group: the group's block tables and its blocks' lifecycle (no torch).

Every device group of a plan gets the manager its kind calls for (``MANAGER_BY_GROUP``, by
the ``groups.py`` class the group's spec chose). A manager owns its group's per-request
block table (``[max_num_seqs, width] int32`` by state row, 0 = no block), counts the blocks
an operation needs before anything changes (``count_new_blocks``), then ``allocate``\\ s and
``free``\\ s them in the shared device ``BlockPool``; every table entry it changes also goes
to the ``PlanBuilder`` (the workers' copy). State changes go through the journal.

| manager | groups | what it does |
| --- | --- | --- |
| ``PagedManager`` | indexer, regular | a block per page, kept until the request ends |
| ``SlidingWindowManager`` | sliding window | also releases pages out of every future window |
| ``ResidentManager`` | resident | also unpins durable pages (readable until reused), loses them |
| ``HotManager`` | hot | reserves a fixed region at admission, takes it at offload |
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from hisparse_triton.groups import (
    DeviceGroup,
    HotGroup,
    IndexerGroup,
    RegularGroup,
    ResidentGroup,
    SlidingWindowGroup,
)
from hisparse_triton.scheduler.block_pool import BlockPool
from hisparse_triton.scheduler.journal import Journal
from hisparse_triton.scheduler.plan_builder import PlanBuilder
from hisparse_triton.scheduler.requests import Request
from hisparse_triton.scheduler.stats import Counters


class GroupManager:
    """Base of every manager: one device group, the shared pool, the pending plan."""

    def __init__(self, group: DeviceGroup, pool: BlockPool, plan_builder: PlanBuilder,
                 journal: Journal, counters: Counters, max_num_seqs: int) -> None:
        self.group = group
        self.position = group.position
        self.block_size = group.block_size
        self.pool = pool
        self.plan_builder = plan_builder
        self.journal = journal
        self.counters = counters
        self.num_blocks = 0   # block references the group's requests hold

    def _add_blocks(self, amount: int) -> None:
        if amount:
            self.journal.setattr(self, "num_blocks", self.num_blocks + amount)

    def count_new_blocks(self, req: Request, new_len: int) -> int:
        """Blocks growing ``req`` to ``new_len`` tokens takes from the pool."""
        return 0

    def add_request(self, req: Request) -> None:
        """A request was admitted (its row's table is empty)."""

    def allocate(self, req: Request, new_len: int, count: int) -> None:
        """Take the ``count`` (``count_new_blocks``) blocks growing ``req`` to ``new_len``."""

    def free(self, req: Request) -> None:
        """Return every block ``req`` holds in this group."""

    def truncate(self, req: Request, new_len: int,
                 keep: Optional[Callable[[list[int]], None]] = None) -> None:
        """``req`` keeps its first ``new_len`` tokens (a rollback): return the blocks of its
        pages past the new end (``req.seq_len`` is still the old length); ``keep``, when
        given, takes those block references over instead of the pool."""

    def owned_blocks(self, requests: Sequence[Request]) -> list[int]:
        """Every block reference the group's live requests hold (``check_invariants``)."""
        return []

    def check_invariants(self, requests: Sequence[Request]) -> list[str]:
        """Broken rules, as messages."""
        owned = self.owned_blocks(requests)
        if len(owned) != self.num_blocks:
            return [f"group {self.position} ({self.group.kind}): counts {self.num_blocks} "
                    f"blocks, its requests hold {len(owned)}"]
        return []

    def snapshot(self) -> tuple:
        return (self.num_blocks,)


class PagedManager(GroupManager):
    """A group holding one block per page of the request (indexer, full attention)."""

    def __init__(self, group: DeviceGroup, pool: BlockPool, plan_builder: PlanBuilder,
                 journal: Journal, counters: Counters, max_num_seqs: int) -> None:
        super().__init__(group, pool, plan_builder, journal, counters, max_num_seqs)
        self.blocks = np.zeros((max_num_seqs, group.width), dtype=np.int32)

    def use_table(self, table: np.ndarray) -> None:
        """Keep the block table in ``table`` from now on (a view into the coordinator's
        stacked tables, of the same shape and dtype), its entries copied over."""
        if table.shape != self.blocks.shape or table.dtype != self.blocks.dtype:
            raise ValueError(f"group {self.position}: a block table of shape "
                             f"{self.blocks.shape} cannot live in {table.shape} {table.dtype}.")
        table[...] = self.blocks
        self.blocks = table

    def count_new_blocks(self, req: Request, new_len: int) -> int:
        return self.group.new_pages(req.seq_len, new_len)

    def allocate(self, req: Request, new_len: int, count: int) -> None:
        self.allocate_pages(req, self.group.pages(req.seq_len), count)

    def allocate_pages(self, req: Request, first: int, count: int) -> None:
        """Take ``count`` blocks as the request's pages ``first, first + 1, ...``."""
        if not count:
            return
        blocks = self.pool.allocate(count, request_id=req.request_id)
        self.journal.write(self.blocks[req.row], slice(first, first + count), blocks)
        self.plan_builder.write_blocks(req.row, self.position, first, blocks)
        self._add_blocks(count)

    def adopt(self, req: Request, page: int, block: int) -> None:
        """Share a cached prefix page's block as the request's ``page``."""
        self.pool.share(block)
        self.journal.write(self.blocks[req.row], page, block)
        self.plan_builder.write_blocks(req.row, self.position, page, (block,))
        self._add_blocks(1)

    def _first_held_page(self, req: Request) -> int:
        """Pages before this one left the request's ownership."""
        return 0

    def free(self, req: Request) -> None:
        """Tail first: the newest page enters the free queue first (is reused first)."""
        row = self.blocks[req.row]
        held = row[self._first_held_page(req):self.group.pages(req.seq_len)].tolist()
        blocks = [b for b in reversed(held) if b]
        self.pool.free(blocks)
        self._add_blocks(-len(blocks))
        self.journal.write(self.blocks, req.row, 0)

    def truncate(self, req: Request, new_len: int,
                 keep: Optional[Callable[[list[int]], None]] = None) -> None:
        """Tail first, like ``free``: pages ``[pages(new_len), pages(seq_len))`` the request
        still holds go back to the pool (or to ``keep``); their entries become the null
        block."""
        first = max(self._first_held_page(req), self.group.pages(new_len))
        end = self.group.pages(req.seq_len)
        if end <= first:
            return
        row = self.blocks[req.row]
        blocks = [b for b in reversed(row[first:end].tolist()) if b]
        if keep is None:
            self.pool.free(blocks)
        else:
            keep(blocks)
        self._add_blocks(-len(blocks))
        self.journal.write(row, slice(first, end), 0)
        self.plan_builder.clear_pages(req.row, self.position, range(first, end))

    def rows(self, req: Request, start: int, end: int) -> np.ndarray:
        """``[end - start] int64`` device rows of positions ``[start, end)``."""
        B = self.block_size
        if end - start == 1:  # the decode step: no vector arithmetic
            return np.array([int(self.blocks[req.row, start // B]) * B + start % B],
                            dtype=np.int64)
        positions = np.arange(start, end, dtype=np.int64)
        return self.blocks[req.row, positions // B].astype(np.int64) * B + positions % B

    def decode_rows(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """``[R] int64`` device rows of one position per state row (a decode batch)."""
        B = self.block_size
        return self.blocks[rows, positions // B].astype(np.int64) * B + positions % B

    def table(self, req: Request) -> list[int]:
        """The request's block of every page it has (0 = not on the GPU)."""
        return self.blocks[req.row, :self.group.pages(req.seq_len)].tolist()

    def owned_blocks(self, requests: Sequence[Request]) -> list[int]:
        out: list[int] = []
        for req in requests:
            held = self.blocks[req.row, self._first_held_page(req):]
            out.extend(b for b in held.tolist() if b)
        return out

    def check_invariants(self, requests: Sequence[Request]) -> list[str]:
        problems = super().check_invariants(requests)
        live = np.zeros(self.blocks.shape[0], dtype=bool)
        for req in requests:
            live[req.row] = True
            if self.blocks[req.row, self.group.pages(req.seq_len):].any():
                problems.append(f"group {self.position} ({self.group.kind}): request "
                                f"{req.request_id!r} has blocks past its {req.seq_len} tokens")
        if self.blocks[~live].any():
            problems.append(f"group {self.position} ({self.group.kind}): a free state row "
                            f"holds blocks")
        return problems

    def snapshot(self) -> tuple:
        return (self.num_blocks, self.blocks.tolist())


class SlidingWindowManager(PagedManager):
    """A sliding-window group: pages out of every future query's window are released."""

    def __init__(self, group: DeviceGroup, pool: BlockPool, plan_builder: PlanBuilder,
                 journal: Journal, counters: Counters, max_num_seqs: int) -> None:
        super().__init__(group, pool, plan_builder, journal, counters, max_num_seqs)
        self._released: dict[int, int] = {}   # state row -> leading pages released

    def _first_held_page(self, req: Request) -> int:
        return self._released.get(req.row, 0)

    def release(self, req: Request) -> None:
        """Free the durable pages no future query of ``req`` reads."""
        limit = self.group.releasable_pages(req.committed_len)
        first = self._released.get(req.row, 0)
        if limit <= first:
            return
        j = self.journal
        row = self.blocks[req.row]
        blocks = [b for b in row[first:limit].tolist() if b]
        self.pool.free(blocks)
        self._add_blocks(-len(blocks))
        j.write(row, slice(first, limit), 0)
        self.plan_builder.clear_pages(req.row, self.position, range(first, limit))
        j.setitem(self._released, req.row, limit)
        self.counters.add("window_released_pages", limit - first)

    def free(self, req: Request) -> None:
        super().free(req)
        if req.row in self._released:
            self.journal.delitem(self._released, req.row)

    def snapshot(self) -> tuple:
        return (*super().snapshot(), sorted(self._released.items()))


class ResidentManager(PagedManager):
    """GPU pages of sparse layers: where new KV is written, a cache of the host pool.

    ``unpin`` returns a durable page's block to the pool while the page stays readable: the
    request becomes a reader of the block (its table keeps the block) until the pool hands
    the block to a new owner, when ``on_reuse`` marks the page lost (table entry 0, a lost
    entry in the plan). With ``drop=True`` the page leaves the GPU at once instead.
    """

    def __init__(self, group: DeviceGroup, pool: BlockPool, plan_builder: PlanBuilder,
                 journal: Journal, counters: Counters, max_num_seqs: int) -> None:
        super().__init__(group, pool, plan_builder, journal, counters, max_num_seqs)
        # Unpinned pages still readable in their (free or shared) block:
        # block -> [(state row, page)] of the requests reading it.
        self._readers: dict[int, list[tuple[int, int]]] = {}

    def _first_held_page(self, req: Request) -> int:
        return req.released_pages

    def unpin(self, req: Request, page: int, *, drop: bool) -> None:
        """Release the request's (durable) ``page``; see the class docstring."""
        block = int(self.blocks[req.row, page])
        if not block:
            return
        j = self.journal
        if drop:
            j.write(self.blocks[req.row], page, 0)
            self.plan_builder.clear_pages(req.row, self.position, (page,))
        else:
            readers = self._readers.get(block)
            if readers is None:
                j.setitem(self._readers, block, [(req.row, page)])
            else:
                j.append(readers, (req.row, page))
            self.pool.add_reader(block)
        self.pool.free([block])
        self._add_blocks(-1)
        self.counters.add("unpinned_pages", 1)

    def on_reuse(self, block: int) -> bool:
        """``block`` went to a new owner: the unpinned pages it held are lost. Returns
        whether this group read it."""
        readers = self._readers.get(block)
        if readers is None:
            return False
        j = self.journal
        j.delitem(self._readers, block)
        for row, page in readers:
            j.write(self.blocks[row], page, 0)
            self.plan_builder.lose(row, self.position, page)
            self.counters.add("lost_pages", 1)
            self.pool.drop_reader(block)
        return True

    def free(self, req: Request) -> None:
        """Stop reading the request's unpinned pages, then return the pages it owns."""
        row = self.blocks[req.row]
        for page in range(req.released_pages):
            block = int(row[page])
            if block:
                self._stop_reading(block, req.row)
        super().free(req)

    def _stop_reading(self, block: int, row: int) -> None:
        readers = self._readers.get(block)
        if readers is None:
            return
        kept = [r for r in readers if r[0] != row]
        for _ in range(len(readers) - len(kept)):
            self.pool.drop_reader(block)
        if kept:
            self.journal.setitem(self._readers, block, kept)
        else:
            self.journal.delitem(self._readers, block)

    def reader_rows(self, block: int) -> list[int]:
        """The state rows whose unpinned pages ``block`` holds (none: not read here)."""
        return [row for row, _ in self._readers.get(block, ())]

    def reader_counts(self) -> dict[int, int]:
        """Block -> how many unpinned pages read it (``check_invariants``)."""
        return {block: len(readers) for block, readers in self._readers.items()}

    def check_invariants(self, requests: Sequence[Request]) -> list[str]:
        problems = super().check_invariants(requests)
        by_row = {req.row: req for req in requests}
        for block, readers in self._readers.items():
            for row, page in readers:
                req = by_row.get(row)
                if req is None or page >= req.released_pages \
                        or int(self.blocks[row, page]) != block:
                    problems.append(f"group {self.position} (resident): block {block} is "
                                    f"read as page {page} of state row {row}, which does "
                                    f"not hold it unpinned")
        return problems

    def snapshot(self) -> tuple:
        return (*super().snapshot(),
                sorted((b, sorted(readers)) for b, readers in self._readers.items()))


class HotManager(GroupManager):
    """Per-request hot regions of a resident group's layers (``group.width`` blocks each).

    Admission reserves a region (counted, not taken: ``reserved``); an offload takes it
    from the pool (never failing: the reservation kept the blocks available); the request's
    end frees it (or drops the reservation).
    """

    def __init__(self, group: DeviceGroup, pool: BlockPool, plan_builder: PlanBuilder,
                 journal: Journal, counters: Counters, max_num_seqs: int) -> None:
        super().__init__(group, pool, plan_builder, journal, counters, max_num_seqs)
        self.width = group.width
        self.reserved = 0   # blocks reserved for requests that have not offloaded

    def add_request(self, req: Request) -> None:
        self.journal.setattr(self, "reserved", self.reserved + self.width)

    def take_region(self, req: Request) -> None:
        """Give ``req`` its reserved region (``req.hot[position]``, a dict the caller set)."""
        j = self.journal
        j.setattr(self, "reserved", self.reserved - self.width)
        blocks = self.pool.allocate(self.width, request_id=req.request_id)
        j.setitem(req.hot, self.position, blocks)
        self.plan_builder.write_blocks(req.row, self.position, 0, blocks)
        self._add_blocks(self.width)

    def free(self, req: Request) -> None:
        if req.hot is None:
            self.journal.setattr(self, "reserved", self.reserved - self.width)
            return
        blocks = req.hot[self.position]
        self.pool.free(blocks)
        self._add_blocks(-len(blocks))

    def table(self, req: Request) -> list[int]:
        return list(req.hot[self.position]) if req.hot else []

    def owned_blocks(self, requests: Sequence[Request]) -> list[int]:
        return [b for req in requests if req.hot is not None for b in req.hot[self.position]]

    def check_invariants(self, requests: Sequence[Request]) -> list[str]:
        problems = super().check_invariants(requests)
        waiting = sum(req.hot is None for req in requests)
        if self.reserved != waiting * self.width:
            problems.append(f"group {self.position} (hot): reserves {self.reserved} blocks "
                            f"for {waiting} requests without a region of {self.width}")
        return problems

    def snapshot(self) -> tuple:
        return (self.num_blocks, self.reserved)


#: Manager class by device group class (subclasses of a listed class use its manager
#: unless listed themselves).
MANAGER_BY_GROUP: dict[type[DeviceGroup], type[GroupManager]] = {
    IndexerGroup: PagedManager,
    SlidingWindowGroup: SlidingWindowManager,
    RegularGroup: PagedManager,
    ResidentGroup: ResidentManager,
    HotGroup: HotManager,
}


def manager_class(group: DeviceGroup) -> type[GroupManager]:
    """The manager class for ``group`` (``ValueError`` for a group class none handles)."""
    for klass in type(group).__mro__:
        if klass in MANAGER_BY_GROUP:
            return MANAGER_BY_GROUP[klass]
    raise ValueError(f"no group manager handles {type(group).__name__} (group "
                     f"{group.position}).")


__all__ = [
    "MANAGER_BY_GROUP",
    "GroupManager",
    "HotManager",
    "PagedManager",
    "ResidentManager",
    "SlidingWindowManager",
    "manager_class",
]
