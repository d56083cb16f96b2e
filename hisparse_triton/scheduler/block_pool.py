"""``BlockPool``: a block allocator with a null block, a free queue and reference counts.

Used for both pools of the runtime: the host pool (source-layer pages) and the shared device
pool (indexer, resident, hot and regular groups all draw from one id space). Block 0 is the
null block: it means "no page" in every block table and is never handed out.

All operations are pure CPU bookkeeping (no tensors) and all-or-nothing: a call that raises
changes no reference count and no queue entry. With a ``Journal`` attached (``journal=``),
every change also records its inverse, so a caller's transaction can undo it.
"""

from __future__ import annotations

from collections import Counter
from typing import Hashable, Iterable, Iterator, Optional

from hisparse_triton.errors import BlockPoolError, CapacityError
from hisparse_triton.scheduler.journal import Journal

NULL_BLOCK = 0


class FreeQueue:
    """Free block ids in reuse order: a doubly linked list over the ids ``[1, num_blocks)``
    (id 0, the null block, is the list's sentinel). ``popleft``, ``append``, ``remove`` and
    re-insertion (``insert_after``) are O(1), so a block can leave the queue from anywhere
    and an undo puts it back exactly where it was."""

    def __init__(self, num_blocks: int) -> None:
        n = num_blocks
        self._next = [*range(1, n), 0]
        self._prev = [n - 1, *range(0, n - 1)]
        self._in = [False] + [True] * (n - 1)
        self._len = n - 1

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: object) -> bool:
        return isinstance(block, int) and 0 < block < len(self._in) and self._in[block]

    def __iter__(self) -> Iterator[int]:
        node = self._next[0]
        while node:
            yield node
            node = self._next[node]

    def insert_after(self, prev: int, block: int) -> None:
        """Put ``block`` right after ``prev`` (0 = at the front)."""
        nxt = self._next[prev]
        self._next[prev] = block
        self._prev[block] = prev
        self._next[block] = nxt
        self._prev[nxt] = block
        self._in[block] = True
        self._len += 1

    def append(self, block: int) -> None:
        self.insert_after(self._prev[0], block)

    def remove(self, block: int) -> int:
        """Take ``block`` out; returns the block before it (0 = it was first)."""
        prev, nxt = self._prev[block], self._next[block]
        self._next[prev] = nxt
        self._prev[nxt] = prev
        self._in[block] = False
        self._len -= 1
        return prev

    def popleft(self) -> int:
        block = self._next[0]
        self.remove(block)
        return block


class BlockPool:
    """``num_blocks`` blocks, ids ``[0, num_blocks)``; ids ``1..num_blocks-1`` are allocatable.

    Freed blocks go to the back of the free queue and are reused last (FIFO), which keeps a
    just-freed block's bytes untouched for as long as possible; ``take`` removes one named
    free block from anywhere in the queue (a caller adopting a block whose bytes it still
    wants).
    """

    def __init__(self, num_blocks: int, name: str = "pool",
                 journal: Optional[Journal] = None) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"{name} BlockPool needs num_blocks >= 1 (block 0 is the null "
                             f"block), got {num_blocks!r}.")
        self.name = name
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._free = FreeQueue(num_blocks)
        self.journal = journal if journal is not None else Journal()

    # -- queries -------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Allocatable blocks (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks in use (0.0 for a pool with only the null block)."""
        return self.num_used / self.capacity if self.capacity else 0.0

    def ref_count(self, block: int) -> int:
        self._check_id(block)
        return self._ref[block]

    # -- mutations -----------------------------------------------------------------------
    def allocate(self, n: int, *, request_id: Optional[Hashable] = None) -> list[int]:
        """Take ``n`` free blocks (reference count 1 each); ``CapacityError`` if fewer are free."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n!r} blocks.")
        if n > len(self._free):
            who = f" for request {request_id!r}" if request_id is not None else ""
            raise CapacityError(
                f"{self.name} pool cannot allocate {n} blocks{who}: {len(self._free)} of "
                f"{self.capacity} are free.", resource=f"{self.name} blocks", needed=n,
                available=len(self._free), request_id=request_id)
        pop = self._free.popleft
        blocks = [pop() for _ in range(n)]
        for block in blocks:
            self._ref[block] = 1
        if self.journal.active:
            self.journal.record(lambda: self._unallocate(blocks))
        return blocks

    def _unallocate(self, blocks: list[int]) -> None:
        for block in reversed(blocks):
            self._ref[block] = 0
            self._free.insert_after(0, block)

    def peek(self, n: int) -> list[int]:
        """The ``n`` blocks ``allocate(n)`` would return next (fewer if fewer are free)."""
        out = []
        for block in self._free:
            if len(out) == n:
                break
            out.append(block)
        return out

    def is_free(self, block: int) -> bool:
        """Whether ``block`` sits in the free queue."""
        return block in self._free

    def take(self, block: int) -> None:
        """Allocate one named free block (reference count 1) from anywhere in the queue;
        ``BlockPoolError`` if it is not free."""
        self._check_id(block)
        if block not in self._free:
            raise BlockPoolError(f"{self.name}: cannot take block {block}: it is not free.")
        prev = self._free.remove(block)
        self._ref[block] = 1
        if self.journal.active:
            self.journal.record(lambda: self._untake(prev, block))

    def _untake(self, prev: int, block: int) -> None:
        self._ref[block] = 0
        self._free.insert_after(prev, block)

    def touch(self, blocks: Iterable[int]) -> None:
        """Add one reference to each (allocated) block, e.g. to share a page."""
        blocks = list(blocks)
        for block in blocks:
            self._check_id(block)
            if self._ref[block] == 0:
                raise BlockPoolError(f"{self.name}: cannot touch block {block}: it is free.")
        for block in blocks:
            self._ref[block] += 1
        if self.journal.active:
            self.journal.record(lambda: self._untouch(blocks))

    def _untouch(self, blocks: list[int]) -> None:
        for block in blocks:
            self._ref[block] -= 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference per occurrence; a block whose count reaches 0 becomes free.

        ``BlockPoolError`` (nothing changed) on the null block, an id outside the pool, or a
        block released more times than it is referenced (double free).
        """
        counts = Counter(blocks)
        for block, times in counts.items():
            self._check_id(block)
            if self._ref[block] < times:
                raise BlockPoolError(
                    f"{self.name}: double free of block {block} (reference count "
                    f"{self._ref[block]}, released {times} time(s)).")
        # Release in the caller's order so the free queue order is deterministic.
        appended = []
        for block in counts:
            self._ref[block] -= counts[block]
            if self._ref[block] == 0:
                self._free.append(block)
                appended.append(block)
        if self.journal.active:
            self.journal.record(lambda: self._unfree(counts, appended))

    def _unfree(self, counts: Counter, appended: list[int]) -> None:
        for block in reversed(appended):
            self._free.remove(block)
        for block, times in counts.items():
            self._ref[block] += times

    def _check_id(self, block: int) -> None:
        if not isinstance(block, int) or isinstance(block, bool):
            raise BlockPoolError(f"{self.name}: block id must be an int, got {block!r}.")
        if block == NULL_BLOCK:
            raise BlockPoolError(f"{self.name}: block 0 is the null block; it is never "
                                 f"allocated, touched or freed.")
        if not 0 < block < self.num_blocks:
            raise BlockPoolError(f"{self.name}: block {block} is outside the pool "
                                 f"[1, {self.num_blocks}).")

    def __repr__(self) -> str:
        return (f"BlockPool(name={self.name!r}, num_blocks={self.num_blocks}, "
                f"free={self.num_free})")
