"""The contract between the scheduler and the workers: ``TableLayout`` and ``StepPlan``.

The scheduler (CPU only, one per engine) decides; the workers (one per GPU rank) hold the
tensors. Everything a worker must change in its per-request tables for one step travels in
one ``StepPlan``: numpy arrays and ints, picklable, a few KiB for a decode step, with no
request ids in it (only state rows and block ids). This module imports no torch.

``TableLayout`` says where each per-request table lives in the worker's ONE int32 table
arena ``[max_num_seqs, width]`` (a state row is one arena row):

| columns | table |
| --- | --- |
| ``0`` | ``seq_len``: tokens appended |
| ``host_col .. + host_width`` | host block of every page (0 = no page) |
| ``group_cols[i] .. + group_widths[i]`` | device group ``i``'s block table (0 = no block) |

A plan's table writes are ``(flat index, value)`` pairs into that arena, so the worker
applies a whole step with one host -> device copy and one scatter, whatever changed.
Both sides build the layout from the same ``KVCacheConfig``; ``fingerprint`` lets the worker
refuse a plan made for another layout.

A worker applies a ``StepPlan`` in this order: (1) ``reset_rows``: every table of those state
rows emptied and their hot state invalidated (every slot empty, LRU in slot order: the hot
state invalidations); (2) ``write_index``/``write_value``; and after the step's forward,
when ``commit`` is set, (3) mirrors device rows ``mirror_device_rows[g, j]`` of resident
group ``g``'s layers to host row ``mirror_host_rows[j]`` for every sparse layer.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from hisparse_triton.groups import PlanGroups

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class TableLayout:
    """Column layout of the worker's per-request table arena (see the module docstring)."""

    max_num_seqs: int
    width: int
    host_col: int
    host_width: int
    group_cols: tuple[int, ...]
    group_widths: tuple[int, ...]

    #: Column of ``seq_len``.
    SEQ_LEN_COL = 0

    @classmethod
    def build(cls, groups: "PlanGroups", max_num_seqs: int) -> "TableLayout":
        """The layout for a plan's groups and ``max_num_seqs`` state rows; ``ValueError`` if
        the arena would need flat indices beyond int32."""
        host_col = 1
        host_width = -(-groups.max_model_len // groups.block_size)
        col = host_col + host_width
        cols, widths = [], []
        for group in groups.groups:
            cols.append(col)
            widths.append(group.width)
            col += group.width
        layout = cls(max_num_seqs=max_num_seqs, width=col, host_col=host_col,
                     host_width=host_width, group_cols=tuple(cols), group_widths=tuple(widths))
        if max_num_seqs * col > _INT32_MAX:
            raise ValueError(f"the per-request tables need {max_num_seqs} x {col} int32 "
                             f"entries, more than int32 indices address; lower max_num_seqs.")
        return layout

    @property
    def fingerprint(self) -> int:
        """A 63-bit hash of the layout (plans carry it; a worker refuses a foreign one)."""
        text = repr((self.max_num_seqs, self.width, self.host_col, self.host_width,
                     self.group_cols, self.group_widths)).encode()
        return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1

    @property
    def num_entries(self) -> int:
        """int32 entries of the arena."""
        return self.max_num_seqs * self.width


_HEADER = struct.Struct("<qqqqqqqqq")  # step, layout, commit, counts x 5, released_pages


@dataclass(frozen=True, eq=False)
class StepPlan:
    """One step's worth of table updates and mirror work for every worker (no torch).

    - ``step``: sequence number (1, 2, ...); a worker applies plans strictly in order.
    - ``layout``: ``TableLayout.fingerprint`` of the scheduler that made it.
    - ``commit``: whether the plan ends a step: its mirror rows are copied device -> host
      after the step's forward (``HiSparseWorker.mirror``), and the scheduler has counted
      them as durable (it may reuse their pages' blocks from the next plan on).
    - ``data``: ``int32`` sections, read through the properties: ``reset_rows [r]``,
      ``write_index [w]``, ``write_value [w]``, ``mirror_host_rows [m]``,
      ``mirror_device_rows [num_resident, m]``, ``lost [l, 3]`` (state row, device group
      position, page) of resident pages whose block went to another owner in this plan
      (already among the writes: their table entry becomes 0).
    - ``released_pages``: device blocks the scheduler released while making this plan
      (informational).
    """

    step: int
    layout: int
    commit: bool
    num_resets: int
    num_writes: int
    num_mirror: int
    num_resident: int
    num_lost: int
    released_pages: int = 0
    data: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32), repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.data, np.ndarray) or self.data.dtype != np.int32 \
                or self.data.ndim != 1:
            raise ValueError("StepPlan.data must be a 1-D int32 numpy array.")
        expected = (self.num_resets + 2 * self.num_writes
                    + self.num_mirror * (1 + self.num_resident) + 3 * self.num_lost)
        if self.data.size != expected:
            raise ValueError(f"StepPlan.data holds {self.data.size} entries; its counts need "
                             f"{expected}.")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepPlan):
            return NotImplemented
        return self.to_bytes() == other.to_bytes()

    __hash__ = None  # type: ignore[assignment]  (holds a mutable array)

    # ------------------------------------------------------------------ sections
    def _section(self, start: int, size: int) -> np.ndarray:
        return self.data[start:start + size]

    @property
    def reset_rows(self) -> np.ndarray:
        """``[r] int32`` state rows whose tables and hot state are emptied first."""
        return self._section(0, self.num_resets)

    @property
    def write_index(self) -> np.ndarray:
        """``[w] int32`` flat arena indices (``row * layout.width + column``), distinct."""
        return self._section(self.num_resets, self.num_writes)

    @property
    def write_value(self) -> np.ndarray:
        """``[w] int32`` the values written at ``write_index``."""
        return self._section(self.num_resets + self.num_writes, self.num_writes)

    @property
    def _mirror_start(self) -> int:
        return self.num_resets + 2 * self.num_writes

    @property
    def mirror_host_rows(self) -> np.ndarray:
        """``[m] int32`` host rows the step's new tokens are mirrored to."""
        return self._section(self._mirror_start, self.num_mirror)

    @property
    def mirror_device_rows(self) -> np.ndarray:
        """``[num_resident, m] int32``: their device rows in each resident group."""
        start = self._mirror_start + self.num_mirror
        return self._section(start, self.num_resident * self.num_mirror).reshape(
            self.num_resident, self.num_mirror)

    @property
    def lost(self) -> np.ndarray:
        """``[l, 3] int32`` (state row, device group position, page) marked lost."""
        start = self._mirror_start + self.num_mirror * (1 + self.num_resident)
        return self._section(start, 3 * self.num_lost).reshape(self.num_lost, 3)

    @property
    def nbytes(self) -> int:
        """Bytes of the plan's arrays plus its header (what a broadcast moves)."""
        return _HEADER.size + self.data.nbytes

    def describe(self, layout: "TableLayout | None" = None) -> str:
        """A short multi-line summary for people (logs, debugging). With the ``layout``
        the plan was made for, table writes are broken down by state row and table."""

        def plural(n: int, word: str) -> str:
            return f"{n} {word}{'' if n == 1 else 's'}"

        def some(values: np.ndarray, limit: int = 8) -> str:
            shown = ", ".join(str(int(v)) for v in values[:limit])
            return f"[{shown}{', ...' if values.size > limit else ''}]"

        lines = [f"StepPlan {self.step} ({'commit' if self.commit else 'no commit'}), "
                 f"layout {self.layout:#x}, {self.nbytes} B"]
        if self.num_resets:
            lines.append(f"  {plural(self.num_resets, 'state row')} reset: "
                         f"{some(self.reset_rows)}")
        writes = f"  {plural(self.num_writes, 'table write')}"
        if self.num_writes and layout is not None:
            rows, cols = np.divmod(self.write_index, layout.width)
            seq = int((cols == TableLayout.SEQ_LEN_COL).sum())
            host = int(((cols >= layout.host_col)
                        & (cols < layout.host_col + layout.host_width)).sum())
            writes += (f" on state rows {some(np.unique(rows))}: {seq} seq lens, {host} host "
                       f"blocks, {self.num_writes - seq - host} device blocks")
        lines.append(writes)
        lines.append(f"  {self.num_mirror} mirror rows x {self.num_resident} resident groups"
                     if self.num_mirror else "  nothing to mirror")
        lost = (f"{plural(self.num_lost, 'lost page')} (state rows "
                f"{some(np.unique(self.lost[:, 0]))})" if self.num_lost else "no lost page")
        lines.append(f"  {lost}, {plural(self.released_pages, 'page')} released")
        return "\n".join(lines)

    # ------------------------------------------------------------------ (de)serialise
    def to_bytes(self) -> bytes:
        """The plan as bytes (a fixed header + the int32 data), for any transport."""
        header = _HEADER.pack(self.step, self.layout, int(self.commit), self.num_resets,
                              self.num_writes, self.num_mirror, self.num_resident,
                              self.num_lost, self.released_pages)
        return header + self.data.astype("<i4", copy=False).tobytes()

    @classmethod
    def from_bytes(cls, payload: bytes | bytearray | memoryview) -> "StepPlan":
        """Inverse of ``to_bytes``; ``ValueError`` on a truncated or inconsistent payload."""
        view = memoryview(payload).cast("B")
        if len(view) < _HEADER.size or (len(view) - _HEADER.size) % 4:
            raise ValueError(f"a StepPlan payload of {len(view)} B is truncated.")
        (step, layout, commit, resets, writes, mirror, resident, lost,
         released) = _HEADER.unpack_from(view)
        data = np.frombuffer(view[_HEADER.size:], dtype="<i4").astype(np.int32)
        return cls(step=step, layout=layout, commit=bool(commit), num_resets=resets,
                   num_writes=writes, num_mirror=mirror, num_resident=resident,
                   num_lost=lost, released_pages=released, data=data)

    @classmethod
    def build(cls, *, step: int, layout: int, commit: bool, reset_rows: np.ndarray,
              write_index: np.ndarray, write_value: np.ndarray, mirror_host_rows: np.ndarray,
              mirror_device_rows: np.ndarray, lost: np.ndarray,
              released_pages: int = 0) -> "StepPlan":
        """Pack the sections (each converted to int32) into one plan."""
        mirror_device_rows = np.asarray(mirror_device_rows, dtype=np.int32)
        num_resident = mirror_device_rows.shape[0] if mirror_device_rows.ndim == 2 else 0
        parts = [np.asarray(a, dtype=np.int32).reshape(-1)
                 for a in (reset_rows, write_index, write_value, mirror_host_rows,
                           mirror_device_rows, lost)]
        return cls(step=step, layout=layout, commit=commit, num_resets=parts[0].size,
                   num_writes=parts[1].size, num_mirror=parts[3].size,
                   num_resident=num_resident, num_lost=parts[5].size // 3,
                   released_pages=released_pages, data=np.concatenate(parts))

    def check(self, layout: TableLayout, num_device_blocks: int, num_host_blocks: int,
              block_size: int) -> None:
        """``ValueError`` naming the first entry that does not fit ``layout`` and the pools
        (state rows, arena indices, host and device rows). Reads only this plan."""
        S = layout.max_num_seqs
        if self.layout != layout.fingerprint:
            raise ValueError(f"StepPlan {self.step} was made for table layout "
                             f"{self.layout:#x}, this worker's is {layout.fingerprint:#x}: "
                             f"the scheduler and the worker use different plans.")
        checks = (
            ("reset_rows", self.reset_rows, S),
            ("write_index", self.write_index, layout.num_entries),
            ("mirror_host_rows", self.mirror_host_rows, num_host_blocks * block_size),
            ("mirror_device_rows", self.mirror_device_rows, num_device_blocks * block_size),
            ("lost state rows", self.lost[:, 0] if self.num_lost else self.lost, S),
        )
        for name, values, limit in checks:
            if values.size and (values.min() < 0 or values.max() >= limit):
                bad = values[(values < 0) | (values >= limit)][0]
                raise ValueError(f"StepPlan {self.step}: {name} holds {int(bad)}, outside "
                                 f"[0, {limit}).")


__all__ = ["StepPlan", "TableLayout"]
