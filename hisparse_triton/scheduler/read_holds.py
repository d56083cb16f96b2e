"""``ReadHolds``: device blocks a resolve read in place stay as they are until the step ends.

A resolve serves a page in place while the page has a device block: a dirty or pinned page
(the request owns the block), and also an unpinned one (its block is free but still holds
the page: *cached*, readable until the pool hands it to a new owner). The rows it returns
are valid until the step ends (``commit_mirrors()`` / ``step()``; the facade's
``commit()``). So once a request's rows were read in place, none of the blocks they point
at may get a new owner (another request, a new one, the request itself) before then:

- its unpinned pages' blocks are *held*: the pool skips them when it reuses cached blocks
  (``BlockPool.keep`` is ``keeps``) and every capacity count leaves them out
  (``held_free``), so a call that would need them raises ``CapacityError`` instead;
- a block of its pages that a call returns to the pool before the step ends (``truncate``
  dropping pages a resolve read) is *kept*: its reference passes to this object, which
  frees it at ``release``;
- the reclaim of an allocation never unpins its pages (``is_held``): they would free
  nothing usable before the step ends.

Who was read: ``hold(rows)`` (the state rows of a resolve's batch) or ``hold_all()`` (a
resolve whose rows the scheduler does not see: every live request). The blocks lent for
``resolve_prefill``'s staging rows (``lend``) are kept here for the step too. ``release()``
at the step's end lets everything go; ``forget(row)`` when a request is freed (its rows end
with it). Every change is journaled; no torch.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from hisparse_triton.scheduler.block_pool import BlockPool
from hisparse_triton.scheduler.coordinator import GroupCoordinator
from hisparse_triton.scheduler.journal import Journal
from hisparse_triton.scheduler.requests import RequestColumns


class ReadHolds:
    """The read holds of one scheduler (see the module docstring): ``pool`` the device
    ``BlockPool``, ``devices`` its group coordinator, ``columns`` the request columns
    (``released_pages`` by state row)."""

    def __init__(self, max_num_seqs: int, *, pool: BlockPool, devices: GroupCoordinator,
                 columns: RequestColumns, journal: Journal) -> None:
        self.pool, self.devices, self.columns, self.journal = pool, devices, columns, journal
        self._held = np.zeros(max_num_seqs, dtype=bool)   # by state row
        self._any = False       # some entry of _held is set
        self._all = False       # every live request is held
        self._kept: list[int] = []   # block references this object holds until release
        self._lent: list[int] = []   # blocks lent for prefill staging rows, until release
        self._last: Optional[bytes] = None   # the rows of the last ``hold`` (a decode
        #                                      batch repeats them for every index group)

    # -- queries ---------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether any request's rows are held now."""
        return self._any or self._all

    def is_held(self, row: int) -> bool:
        """Whether the request in state row ``row`` was read since the step began."""
        return self._all or bool(self._held[row])

    def keeps(self, block: int) -> bool:
        """Whether free ``block`` holds an unpinned page of a held request (the pool's
        ``keep`` hook)."""
        if not self.active:
            return False
        return any(self._all or self._held[row] for row in self.devices.reader_rows(block))

    def held_free(self) -> int:
        """Free device blocks kept from reuse: the unpinned pages of held requests."""
        if not self.active or not self.devices.resident:
            return 0
        rows = (np.arange(self._held.size) if self._all else np.flatnonzero(self._held))
        released = self.columns.released_pages[rows]
        width = int(released.max()) if rows.size else 0
        if not width:
            return 0
        within = np.arange(width) < released[:, None]
        blocks = np.concatenate([m.blocks[rows, :width][within] for m in self.devices.resident])
        blocks = np.unique(blocks[blocks != 0])
        return self.pool.count_free(blocks) if blocks.size else 0

    def kept_blocks(self) -> list[int]:
        """The block references kept until ``release`` (``check_invariants``): dropped pages
        a resolve read, and the blocks lent for staging rows."""
        return self._kept + self._lent

    def lent_blocks(self) -> list[int]:
        """The blocks lent for prefill staging rows this step, in lending order."""
        return list(self._lent)

    def total(self) -> int:
        """Device blocks held, kept or lent until the step ends."""
        return self.held_free() + len(self._kept) + len(self._lent)

    # -- changes ---------------------------------------------------------------------------
    def hold(self, rows: np.ndarray) -> None:
        """The requests in state ``rows`` (an integer array; -1 = padding) were read."""
        key = rows.tobytes()
        if key == self._last:     # held by the previous call, nothing released since
            return
        live = rows[rows >= 0]
        held = self._held
        if live.size and not held[live].all():
            self.journal.write(held, live, True)
            if not self._any:
                self.journal.setattr(self, "_any", True)
        self.journal.setattr(self, "_last", key)

    def hold_all(self) -> None:
        """Every live request may have been read (a resolve by device state rows)."""
        if not self._all:
            self.journal.setattr(self, "_all", True)

    def keep(self, blocks: Sequence[int]) -> None:
        """Take over one reference of each of ``blocks`` (a call returned them to the pool
        while a held request's rows point at them); ``release`` frees them."""
        for block in blocks:
            self.journal.append(self._kept, block)

    def lend(self, blocks: Sequence[int]) -> None:
        """Keep ``blocks`` (just allocated) for staging rows until ``release``."""
        for block in blocks:
            self.journal.append(self._lent, block)

    def forget(self, row: int) -> None:
        """The request in state ``row`` was freed: its rows are no longer valid."""
        if self._held[row]:
            self.journal.write(self._held, row, False)
            self.journal.setattr(self, "_last", None)

    def release(self) -> None:
        """The step ended: nothing is held any more, the kept blocks go back to the pool."""
        for blocks in (self._kept, self._lent):
            if blocks:
                self.pool.free(blocks)
                self.journal.replace_list(blocks, [])
        if self._any:
            self.journal.write(self._held, slice(None), False)
            self.journal.setattr(self, "_any", False)
        self.journal.setattr(self, "_last", None)
        if self._all:
            self.journal.setattr(self, "_all", False)

    def snapshot(self) -> tuple:
        return (np.flatnonzero(self._held).tolist(), self._any, self._all, list(self._kept),
                list(self._lent))


__all__ = ["ReadHolds"]
