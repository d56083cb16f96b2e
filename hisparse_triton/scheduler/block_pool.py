"""``BlockPool``: a block allocator whose free blocks stay readable until they are reused.

Used for both pools of the scheduler: the host pool (source-layer pages) and the shared
device pool (indexer, resident, hot and regular groups all draw from one id space). Block 0
is the null block: it means "no page" in every block table and is never handed out.

A free block can still hold a page someone reads: an unpinned resident page, a published
prefix page. Those parties register as *readers* of the block (``add_reader`` /
``drop_reader``). A free block with readers is *cached* (``num_cached``); the others are
*truly free* (``num_truly_free``). The free blocks wait in two FIFO queues: ``allocate``
takes truly free blocks first (oldest first), and cached ones only when none is left, the
longest cached first; so a page that stays readable in a free block is reused last, and
only when nothing else is free. A block moves between the queues when its readers come
and go (to the back). When ``allocate`` hands a cached block to a new owner, the pool calls
``on_reuse(block)`` before returning: the readers learn that the page is gone (the
scheduler marks it lost) and drop their registrations. ``take`` instead adopts a named free
block with its bytes (a prefix hit), so its readers stay. A cached block for which the
``keep(block)`` hook answers True is skipped (it stays where it is in its queue): its page
must stay as it is for now (the scheduler's read holds: a resolve served it in place).

Bookkeeping is six int32 numpy arrays of ``num_blocks`` entries (reference count, reader
count, next and previous in each free queue): 24 B per block, allocated once, whatever
happens later; scalar access goes through memoryviews (plain Python ints, list speed).

All operations are pure CPU bookkeeping (no tensors) and all-or-nothing: a call that raises
changes no count and no queue entry. With a ``Journal`` attached (``journal=``), every change
also records its inverse while a transaction is open, so a caller's transaction can undo it.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Hashable, Iterable, Iterator, Optional

import numpy as np

from hisparse_triton.errors import BlockPoolError, CapacityError, SchedulerStateError
from hisparse_triton.scheduler.journal import Journal

NULL_BLOCK = 0


class FreeQueue:
    """Free block ids in reuse order: a doubly linked list over ``[1, num_blocks)`` held in
    two int32 arrays (id 0, the null block, is the list's sentinel). ``popleft``,
    ``append``, ``remove`` and re-insertion (``insert_after``) are O(1), so a block can leave
    the queue from anywhere and an undo puts it back exactly where it was. Membership is
    the pool's business (a block is free when its reference count is 0)."""

    def __init__(self, num_blocks: int, *, empty: bool = False) -> None:
        n = num_blocks
        self._next_array = np.arange(1, n + 1, dtype=np.int32)
        self._next_array[-1] = 0
        self._prev_array = np.arange(-1, n - 1, dtype=np.int32)
        self._prev_array[0] = n - 1
        self._len = n - 1
        if empty:   # only the sentinel
            self._next_array[0] = self._prev_array[0] = 0
            self._len = 0
        self._next = memoryview(self._next_array)
        self._prev = memoryview(self._prev_array)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        node = self._next[0]
        while node:
            yield node
            node = self._next[node]

    def walk(self, limit: int) -> list[int]:
        """The queue front to back, at most ``limit`` ids (a corrupt, cyclic list ends)."""
        out: list[int] = []
        node = self._next[0]
        while node and len(out) < limit:
            out.append(node)
            node = self._next[node]
        return out

    def insert_after(self, prev: int, block: int) -> None:
        """Put ``block`` right after ``prev`` (0 = at the front)."""
        nxt = self._next[prev]
        self._next[prev] = block
        self._prev[block] = prev
        self._next[block] = nxt
        self._prev[nxt] = block
        self._len += 1

    def append(self, block: int) -> None:
        self.insert_after(self._prev[0], block)

    def remove(self, block: int) -> int:
        """Take ``block`` out; returns the block before it (0 = it was first)."""
        prev, nxt = self._prev[block], self._next[block]
        self._next[prev] = nxt
        self._prev[nxt] = prev
        self._len -= 1
        return prev

    def popleft(self) -> int:
        block = self._next[0]
        self.remove(block)
        return block


class BlockPool:
    """``num_blocks`` blocks, ids ``[0, num_blocks)``; ids ``1..num_blocks-1`` are allocatable.

    ``on_reuse(block)``: called by ``allocate`` for every handed-out block that had readers,
    after its reference count is set; it must drop every reader of the block
    (``drop_reader``). ``keep(block) -> bool``: asked by ``allocate`` (and ``peek``) about
    cached blocks; True keeps that one from reuse for now. See the module docstring for
    readers and cached blocks.
    """

    def __init__(self, num_blocks: int, name: str = "pool",
                 journal: Optional[Journal] = None,
                 on_reuse: Optional[Callable[[int], None]] = None,
                 keep: Optional[Callable[[int], bool]] = None) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"{name} BlockPool needs num_blocks >= 1 (block 0 is the null "
                             f"block), got {num_blocks!r}.")
        self.name = name
        self.num_blocks = num_blocks
        self._ref_array = np.zeros(num_blocks, dtype=np.int32)
        self._readers_array = np.zeros(num_blocks, dtype=np.int32)
        self._ref = memoryview(self._ref_array)
        self._readers = memoryview(self._readers_array)
        self._truly = FreeQueue(num_blocks)               # free, nobody reads them
        self._cached = FreeQueue(num_blocks, empty=True)  # free, still read
        self.journal = journal if journal is not None else Journal()
        self.on_reuse = on_reuse
        self.keep = keep

    # -- queries -------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Allocatable blocks (all but the null block)."""
        return self.num_blocks - 1

    @property
    def _free(self) -> Iterator[int]:
        """Every free block in reuse order (truly free ones, then cached ones)."""
        yield from self._truly
        yield from self._cached

    def _queue(self, block: int) -> FreeQueue:
        """The queue a free ``block`` waits in (by its readers now)."""
        return self._cached if self._readers[block] else self._truly

    @property
    def num_free(self) -> int:
        return len(self._truly) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    @property
    def num_cached(self) -> int:
        """Free blocks that still hold a page someone reads."""
        return len(self._cached)

    @property
    def num_truly_free(self) -> int:
        """Free blocks that hold nothing anyone reads."""
        return len(self._truly)

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks in use (0.0 for a pool with only the null block)."""
        return self.num_used / self.capacity if self.capacity else 0.0

    def ref_count(self, block: int) -> int:
        self._check_id(block)
        return self._ref[block]

    def readers(self, block: int) -> int:
        """How many parties read ``block``'s page (owned or free)."""
        self._check_id(block)
        return self._readers[block]

    def is_free(self, block: int) -> bool:
        """Whether ``block`` sits in the free queue."""
        return isinstance(block, int) and 0 < block < self.num_blocks and not self._ref[block]

    def is_cached(self, block: int) -> bool:
        """Whether ``block`` is free and still holds a page someone reads."""
        return self.is_free(block) and self._readers[block] > 0

    def count_free(self, blocks: np.ndarray) -> int:
        """How many of ``blocks`` (distinct valid ids, an integer array) are free."""
        return int(np.count_nonzero(self._ref_array[blocks] == 0))

    def peek(self, n: int) -> list[int]:
        """The ``n`` blocks ``allocate(n)`` would return next (fewer if fewer can be)."""
        out = self._truly.walk(n)
        if len(out) < n:
            out += self._reusable(n - len(out))
        return out

    def _reusable(self, n: int) -> list[int]:
        """The first ``n`` cached blocks ``keep`` lets go, front first (fewer if fewer)."""
        keep = self.keep
        if keep is None:
            return self._cached.walk(n)
        out: list[int] = []
        for block in self._cached:
            if len(out) == n:
                break
            if not keep(block):
                out.append(block)
        return out

    # -- state changes --------------------------------------------------------------------
    def _set_readers(self, block: int, value: int) -> Optional[tuple[FreeQueue, int]]:
        """Set the reader count; a free block whose cached-ness changes moves to the back of
        its new queue. Returns ``(old queue, block before it)`` of such a move (undo)."""
        moved = None
        if self._ref[block] == 0 and (value > 0) != (self._readers[block] > 0):
            old = self._queue(block)
            moved = (old, old.remove(block))
            self._readers[block] = value
            self._queue(block).append(block)
        self._readers[block] = value
        return moved

    def _reset_readers(self, block: int, value: int,
                       moved: Optional[tuple[FreeQueue, int]]) -> None:
        """Undo ``_set_readers``: the old count, and the block back where it was."""
        if moved is not None:
            self._queue(block).remove(block)
            moved[0].insert_after(moved[1], block)
        self._readers[block] = value

    # -- mutations -----------------------------------------------------------------------
    def allocate(self, n: int, *, request_id: Optional[Hashable] = None) -> list[int]:
        """Take ``n`` free blocks (reference count 1 each): truly free ones first, then
        cached ones ``keep`` lets go, each queue front first; ``CapacityError`` if fewer can
        be taken (nothing changed). Calls ``on_reuse`` for each cached one."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n!r} blocks.")
        free = self.num_free
        truly = min(n, len(self._truly))
        reused = self._reusable(n - truly) if n > truly else []
        if truly + len(reused) < n:
            who = f" for request {request_id!r}" if request_id is not None else ""
            kept = "" if n > free else (
                f", {free - truly - len(reused)} of them kept from reuse until the step ends "
                f"(pages a resolve read in place)")
            raise CapacityError(
                f"{self.name} pool cannot allocate {n} blocks{who}: {free} of "
                f"{self.capacity} are free{kept}.", resource=f"{self.name} blocks", needed=n,
                available=truly + len(reused), request_id=request_id)
        pop = self._truly.popleft
        blocks = [pop() for _ in range(truly)]
        remove = self._cached.remove
        places = [remove(block) for block in reused]   # the block before each (undo)
        blocks += reused
        for block in blocks:
            self._ref[block] = 1
        if self.journal.active:
            self.journal.record(lambda: self._unallocate(blocks, truly, places))
        for block in reused:
            self._notify_reuse(block)
        return blocks

    def _notify_reuse(self, block: int) -> None:
        if self.on_reuse is not None:
            self.on_reuse(block)
        if self._readers[block]:
            raise SchedulerStateError(
                f"{self.name}: block {block} was handed to a new owner but "
                f"{self._readers[block]} reader(s) still read its old page.")

    def _unallocate(self, blocks: list[int], truly: int, places: list[int]) -> None:
        """Undo ``allocate``: the cached blocks back after the block each followed, the
        truly free ones back at the front, in reverse order."""
        for block, prev in zip(reversed(blocks[truly:]), reversed(places)):
            self._ref[block] = 0
            self._queue(block).insert_after(prev, block)
        for block in reversed(blocks[:truly]):
            self._ref[block] = 0
            self._queue(block).insert_after(0, block)

    def take(self, block: int) -> None:
        """Allocate one named free block (reference count 1) from anywhere in the queue,
        keeping its page and readers; ``BlockPoolError`` if it is not free."""
        self._check_id(block)
        if self._ref[block]:
            raise BlockPoolError(f"{self.name}: cannot take block {block}: it is not free.")
        prev = self._queue(block).remove(block)
        self._ref[block] = 1
        if self.journal.active:
            self.journal.record(lambda: self._untake(prev, block))

    def _untake(self, prev: int, block: int) -> None:
        self._ref[block] = 0
        self._queue(block).insert_after(prev, block)

    def share(self, block: int) -> None:
        """One more reference to ``block`` whether it is owned (``touch``) or free (``take``)."""
        if self.ref_count(block):
            self.touch([block])
        else:
            self.take(block)

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
        """Drop one reference per occurrence; a block whose count reaches 0 becomes free
        (at the back of the queue, in the caller's order; cached if it has readers).

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
        appended = []
        for block, times in counts.items():
            left = self._ref[block] - times
            self._ref[block] = left
            if left == 0:
                self._queue(block).append(block)
                appended.append(block)
        if self.journal.active:
            self.journal.record(lambda: self._unfree(counts, appended))

    def _unfree(self, counts: Counter, appended: list[int]) -> None:
        for block in reversed(appended):
            self._queue(block).remove(block)
        for block, times in counts.items():
            self._ref[block] += times

    def add_reader(self, block: int) -> None:
        """Register one more reader of ``block``'s page (it stays readable while free)."""
        self._check_id(block)
        old = self._readers[block]
        moved = self._set_readers(block, old + 1)
        if self.journal.active:
            self.journal.record(lambda: self._reset_readers(block, old, moved))

    def drop_reader(self, block: int) -> None:
        """One reader stopped reading ``block``'s page (``BlockPoolError`` if it had none)."""
        self._check_id(block)
        old = self._readers[block]
        if not old:
            raise BlockPoolError(f"{self.name}: block {block} has no reader to drop.")
        moved = self._set_readers(block, old - 1)
        if self.journal.active:
            self.journal.record(lambda: self._reset_readers(block, old, moved))

    # -- checks ----------------------------------------------------------------------------
    def _check_id(self, block: int) -> None:
        if not isinstance(block, int) or isinstance(block, bool):
            raise BlockPoolError(f"{self.name}: block id must be an int, got {block!r}.")
        if block == NULL_BLOCK:
            raise BlockPoolError(f"{self.name}: block 0 is the null block; it is never "
                                 f"allocated, touched or freed.")
        if not 0 < block < self.num_blocks:
            raise BlockPoolError(f"{self.name}: block {block} is outside the pool "
                                 f"[1, {self.num_blocks}).")

    def check_invariants(self) -> None:
        """``SchedulerStateError`` naming the first broken rule: the two free queues hold
        exactly the blocks with reference count 0 (each once, linked both ways; the cached
        one those with readers), counts are never negative, the null block is untouched."""
        ref, readers = self._ref_array, self._readers_array
        problems = []
        if ref[0] or readers[0]:
            problems.append("the null block has references or readers")
        if (ref < 0).any() or (readers < 0).any():
            problems.append(f"negative counts at blocks "
                            f"{np.flatnonzero((ref < 0) | (readers < 0)).tolist()[:5]}")
        free = ref[1:] == 0
        for queue, name, expected in (
                (self._truly, "truly free", np.flatnonzero(free & (readers[1:] == 0)) + 1),
                (self._cached, "cached", np.flatnonzero(free & (readers[1:] > 0)) + 1)):
            blocks = queue.walk(limit=self.num_blocks)
            if len(blocks) != len(queue) or sorted(blocks) != expected.tolist():
                problems.append(f"the {name} queue ({len(queue)} blocks) is not the set of "
                                f"free blocks {'with' if name == 'cached' else 'without'} "
                                f"readers ({expected.size})")
            nodes = np.asarray([0, *blocks], dtype=np.int64)
            if (queue._prev_array[queue._next_array[nodes]] != nodes).any():
                problems.append(f"the {name} queue's links disagree")
        if problems:
            raise SchedulerStateError(f"{self.name} pool: " + "; ".join(problems) + ".")

    def snapshot(self) -> tuple:
        """Comparable state (tests): queue order, reference and reader counts."""
        return (list(self._truly), list(self._cached), self._ref_array.tolist(),
                self._readers_array.tolist())

    def __repr__(self) -> str:
        return (f"BlockPool(name={self.name!r}, num_blocks={self.num_blocks}, "
                f"free={self.num_free}, cached={self.num_cached})")


__all__ = ["NULL_BLOCK", "BlockPool", "FreeQueue"]
