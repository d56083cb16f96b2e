"""``PlanBuilder``: the one place that writes the workers' tables and builds ``StepPlan``s.

Between two plans the scheduler's parts queue what the workers must change through this
object: state rows to reset, table entries to write (seq lens, host blocks, device blocks;
a later write of the same entry wins, a reset drops the row's earlier writes), resident
pages lost. ``build`` packs them with the step's mirror rows into the next ``StepPlan`` and
starts a new, empty one. Every change is journaled (undone with a failed compound call).
No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from hisparse_triton.scheduler.journal import Journal
from hisparse_triton.step_plan import StepPlan, TableLayout


_MISSING = object()


def _restore(mapping: dict, old: Sequence[tuple[int, object]]) -> None:
    """Undo writes whose old values (``_MISSING``: a new key) ``old`` lists, newest first."""
    for key, value in reversed(old):
        if value is _MISSING:
            mapping.pop(key, None)
        else:
            mapping[key] = value


def _triples(entries: list[tuple[int, int, int]]) -> np.ndarray:
    """``[n, 3] int32`` of a plan section's entries."""
    if not entries:
        return np.zeros((0, 3), dtype=np.int32)
    return np.asarray(entries, dtype=np.int32).reshape(-1, 3)


class PlanBuilder:
    """The pending plan of one scheduler (see the module docstring)."""

    def __init__(self, layout: TableLayout, journal: Journal) -> None:
        self.layout = layout
        self._journal = journal
        self._width = layout.width
        #: The seq_len entry of every state row's table (``write_seq_lens``).
        self._seq_len_index = (np.arange(layout.max_num_seqs, dtype=np.int64) * layout.width
                               + TableLayout.SEQ_LEN_COL)
        self._resets: dict[int, None] = {}
        self._writes: dict[int, int] = {}
        self._lost: list[tuple[int, int, int]] = []
        self._invalidate: list[tuple[int, int, int]] = []
        self.step = 0   # plans built so far

    @property
    def has_pending_changes(self) -> bool:
        """Whether table changes wait for the next plan."""
        return bool(self._resets or self._writes or self._invalidate)

    # -- table changes ---------------------------------------------------------------------
    def reset_row(self, row: int) -> None:
        """Queue an empty state row for the workers; drop the row's earlier pending writes."""
        j = self._journal
        j.setitem(self._resets, row, None)
        start, end = row * self._width, (row + 1) * self._width
        for index in [i for i in self._writes if start <= i < end]:
            j.delitem(self._writes, index)
        if any(entry[0] == row for entry in self._invalidate):   # the reset empties them
            j.replace_list(self._invalidate, [e for e in self._invalidate if e[0] != row])

    def write_seq_len(self, row: int, seq_len: int) -> None:
        self._journal.setitem(self._writes, row * self._width + TableLayout.SEQ_LEN_COL,
                              seq_len)

    def write_seq_lens(self, rows: np.ndarray, seq_lens: np.ndarray) -> None:
        """``write_seq_len`` of each pair in order (``[n]`` int arrays), undone as one entry."""
        keys = self._seq_len_index[rows].tolist()
        seq_lens = seq_lens.tolist()
        writes = self._writes
        if self._journal.active:
            old = [(key, writes.get(key, _MISSING)) for key in keys]
            self._journal.record(lambda: _restore(writes, old))
        writes.update(zip(keys, seq_lens))

    def write_host_blocks(self, row: int, blocks: Iterable[int]) -> None:
        """The request's host block of every page, from page 0."""
        col = row * self._width + self.layout.host_col
        setitem, writes = self._journal.setitem, self._writes
        for page, block in enumerate(blocks):
            setitem(writes, col + page, block)

    def write_blocks(self, row: int, position: int, first_page: int,
                     blocks: Iterable[int]) -> None:
        """Device group ``position``'s blocks of pages ``first_page, first_page + 1, ...``
        (``hot`` groups: slots of the hot region)."""
        col = row * self._width + self.layout.group_cols[position] + first_page
        setitem, writes = self._journal.setitem, self._writes
        for i, block in enumerate(blocks):
            setitem(writes, col + i, int(block))

    def clear_pages(self, row: int, position: int, pages: Iterable[int]) -> None:
        """Table entries of those pages become the null block (the page left the GPU)."""
        col = row * self._width + self.layout.group_cols[position]
        setitem, writes = self._journal.setitem, self._writes
        for page in pages:
            setitem(writes, col + page, 0)

    def lose(self, row: int, position: int, page: int) -> None:
        """A resident page's block went to another owner: its entry becomes 0 and the plan
        says it was lost."""
        self.clear_pages(row, position, (page,))
        self._journal.append(self._lost, (row, position, page))

    def invalidate(self, row: int, ranges: Iterable[tuple[int, int]]) -> None:
        """Hot slots of state row ``row`` holding a host row in one of the ``[lo, hi)``
        ``ranges`` must be emptied (a rollback dropped the tokens those rows held)."""
        for lo, hi in ranges:
            if hi > lo:
                self._journal.append(self._invalidate, (row, lo, hi))

    # -- the plan --------------------------------------------------------------------------
    def build(self, *, commit: bool, mirror_host_rows: np.ndarray,
              mirror_device_rows: np.ndarray, released_pages: int) -> StepPlan:
        """The next ``StepPlan`` (every change queued since the last one); starts anew.
        ``mirror_host_rows [m]`` and ``mirror_device_rows [resident groups, m]``: integer
        arrays, converted to int32 like ``StepPlan.build`` does."""
        if (type(mirror_host_rows) is np.ndarray and type(mirror_device_rows) is np.ndarray
                and mirror_host_rows.ndim == 1 and mirror_device_rows.ndim == 2
                and mirror_device_rows.shape[1] == mirror_host_rows.size
                and mirror_host_rows.dtype.kind == mirror_device_rows.dtype.kind == "i"):
            plan = self._packed(commit, mirror_host_rows, mirror_device_rows, released_pages)
        else:   # anything else as StepPlan.build takes it (and refuses it)
            plan = StepPlan.build(
                step=self.step + 1, layout=self.layout.fingerprint, commit=commit,
                reset_rows=np.fromiter(self._resets, dtype=np.int32, count=len(self._resets)),
                write_index=np.fromiter(self._writes.keys(), dtype=np.int32,
                                        count=len(self._writes)),
                write_value=np.fromiter(self._writes.values(), dtype=np.int32,
                                        count=len(self._writes)),
                mirror_host_rows=mirror_host_rows, mirror_device_rows=mirror_device_rows,
                lost=_triples(self._lost), released_pages=released_pages,
                invalidate=_triples(self._invalidate))
        set_attr = self._journal.setattr if self._journal.active else setattr
        set_attr(self, "_resets", {})
        set_attr(self, "_writes", {})
        set_attr(self, "_lost", [])
        set_attr(self, "_invalidate", [])
        set_attr(self, "step", self.step + 1)
        return plan

    def _packed(self, commit: bool, host_rows: np.ndarray, device_rows: np.ndarray,
                released_pages: int) -> StepPlan:
        """``build``'s plan for integer ``host_rows [m]`` and ``device_rows [g, m]``: the
        sections packed into the plan's int32 data at once (the same values, each converted
        to int32 as ``StepPlan.build`` converts it)."""
        resets, writes = self._resets, self._writes
        r, w = len(resets), len(writes)
        parts = [np.fromiter(resets, dtype=np.int32, count=r)] if r else []
        if w:
            parts += [np.fromiter(writes.keys(), dtype=np.int32, count=w),
                      np.fromiter(writes.values(), dtype=np.int32, count=w)]
        parts += [host_rows, device_rows.reshape(-1)]
        lost, invalidate = self._lost, self._invalidate
        if lost:
            parts.append(_triples(lost).reshape(-1))
        if invalidate:
            parts.append(_triples(invalidate).reshape(-1))
        data = np.concatenate(parts, dtype=np.int32, casting="unsafe")
        return StepPlan(
            step=self.step + 1, layout=self.layout.fingerprint, commit=commit,
            num_resets=r, num_writes=w, num_mirror=host_rows.size,
            num_resident=device_rows.shape[0], num_lost=len(lost),
            released_pages=released_pages, num_invalidate=len(invalidate), data=data)

    def snapshot(self) -> tuple:
        """Comparable state (tests)."""
        return (list(self._resets), list(self._writes.items()), list(self._lost),
                list(self._invalidate), self.step)


@dataclass
class MirrorSpans:
    """The tokens a plan mirrors: spans of several tokens ``(host_array, row, start, end)``
    and, as columns, the one-token spans (the decode step): each one's host row, state row
    and position."""

    spans: list[tuple[np.ndarray, int, int, int]] = field(default_factory=list)
    single_host: list[int] | np.ndarray = field(default_factory=list)
    single_rows: list[int] | np.ndarray = field(default_factory=list)
    single_positions: list[int] | np.ndarray = field(default_factory=list)


def mirror_rows(spans: Sequence[tuple[np.ndarray, int, int, int]],
                resident_blocks: Sequence[np.ndarray], block_size: int,
                ) -> tuple[np.ndarray, np.ndarray]:
    """Host rows ``[m] int32`` and per-resident-group device rows ``[g, m] int32`` of the
    tokens ``[start, end)`` of each span ``(host_array, row, start, end)``.

    ``resident_blocks[g]``: resident group ``g``'s ``[max_num_seqs, pages]`` block table.
    Spans of one token (the decode step) come last, computed together.
    """
    B, work = block_size, MirrorSpans()
    for span in spans:
        host_array, row, start, end = span
        if end - start == 1:
            page, offset = divmod(start, B)
            work.single_host.append(int(host_array[page]) * B + offset)
            work.single_rows.append(row)
            work.single_positions.append(start)
        else:
            work.spans.append(span)

    def single_device_rows(rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return np.stack([blocks[rows, positions // B].astype(np.int64) * B + positions % B
                         for blocks in resident_blocks])
    return pack_mirror_rows(work, resident_blocks, B, single_device_rows)


def pack_mirror_rows(work: MirrorSpans, resident_blocks: Sequence[np.ndarray],
                     block_size: int,
                     single_device_rows: Callable[[np.ndarray, np.ndarray], np.ndarray],
                     ) -> tuple[np.ndarray, np.ndarray]:
    """``mirror_rows`` of ``work``: its spans in order, then its one-token spans, whose
    ``[g, n] int64`` device rows ``single_device_rows(state rows, positions)`` gives."""
    host_rows, device_rows = pack_mirror_rows_wide(work, resident_blocks, block_size,
                                                   single_device_rows)
    return host_rows.astype(np.int32), device_rows.astype(np.int32)


def pack_mirror_rows_wide(work: MirrorSpans, resident_blocks: Sequence[np.ndarray],
                          block_size: int,
                          single_device_rows: Callable[[np.ndarray, np.ndarray], np.ndarray],
                          ) -> tuple[np.ndarray, np.ndarray]:
    """``pack_mirror_rows`` before the conversion to int32: host rows ``[m]`` and device
    rows ``[g, m]`` of an integer dtype (``PlanBuilder.build`` converts them as it packs)."""
    B = block_size
    g = len(resident_blocks)
    host_rows: list[np.ndarray] = []
    device_rows: list[np.ndarray] = []
    for host_array, row, start, end in work.spans:
        pos = np.arange(start, end, dtype=np.int64)
        page, offset = pos // B, pos % B
        host_rows.append(host_array[page] * B + offset)
        device_rows.append(np.stack([blocks[row, page].astype(np.int64) * B + offset
                                     for blocks in resident_blocks])
                           if g else np.zeros((0, pos.size), np.int64))
    if len(work.single_host):
        rows = np.asarray(work.single_rows, dtype=np.int64)
        positions = np.asarray(work.single_positions, dtype=np.int64)
        host_rows.append(np.asarray(work.single_host, dtype=np.int64))
        device_rows.append(single_device_rows(rows, positions)
                           if g else np.zeros((0, rows.size), np.int64))
    if not host_rows:
        return np.zeros(0, np.int32), np.zeros((g, 0), np.int32)
    if len(host_rows) == 1:
        return host_rows[0], device_rows[0]
    return np.concatenate(host_rows), np.concatenate(device_rows, axis=1)


__all__ = ["MirrorSpans", "PlanBuilder", "mirror_rows", "pack_mirror_rows",
           "pack_mirror_rows_wide"]
