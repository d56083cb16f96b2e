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
rows emptied and their hot state invalidated (every slot empty, LRU in slot order);
(2) ``write_index``/``write_value`` and ``invalidate``: every hot slot of state row ``r`` (in
every index group) holding a host row in ``[lo, hi)`` of an entry ``(r, lo, hi)`` becomes
empty, and the row's LRU order then lists its empty slots first (oldest first, each part in
its previous order), so an emptied slot is reused before any held row is evicted; and after
the step's forward, (3) mirrors device rows
``mirror_device_rows[g, j]`` of resident group ``g``'s layers to host row
``mirror_host_rows[j]`` for every sparse layer.
"""

from __future__ import annotations

import functools
import hashlib
import numbers
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from hisparse_triton.groups import PlanGroups

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class TableLayout:
    """Column layout of the worker's per-request table arena (see the module docstring).

    ``pool_geometry``: ``(host_resident, offset, size, block_stride, layer_stride)`` of every
    ``KVCacheTensor`` of the plan (``build`` fills it in). The tensors' sizes grow with the
    pools' block counts, so two plans that differ only in a pool size have different
    fingerprints: a worker refuses plans made for pools of another size."""

    max_num_seqs: int
    width: int
    host_col: int
    host_width: int
    group_cols: tuple[int, ...]
    group_widths: tuple[int, ...]
    pool_geometry: tuple[tuple[int, ...], ...] = ()

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
        tensors = {id(t): t for t in (*groups.host_tensors.values(),
                                      *groups.device_tensors.values())}.values()
        geometry = tuple(sorted((int(t.host_resident), t.offset, t.size, t.block_stride,
                                 t.layer_stride) for t in tensors))
        layout = cls(max_num_seqs=max_num_seqs, width=col, host_col=host_col,
                     host_width=host_width, group_cols=tuple(cols), group_widths=tuple(widths),
                     pool_geometry=geometry)
        if max_num_seqs * col > _INT32_MAX:
            raise ValueError(f"the per-request tables need {max_num_seqs} x {col} int32 "
                             f"entries, more than int32 indices address; lower max_num_seqs.")
        return layout

    @functools.cached_property
    def fingerprint(self) -> int:
        """A 63-bit hash of the layout and the pool geometry (plans carry it; a worker
        refuses a foreign one)."""
        text = repr((self.max_num_seqs, self.width, self.host_col, self.host_width,
                     self.group_cols, self.group_widths, self.pool_geometry)).encode()
        return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1

    @property
    def num_entries(self) -> int:
        """int32 entries of the arena."""
        return self.max_num_seqs * self.width

    def column_name(self, column: int) -> str:
        """What arena column ``column`` holds (for messages)."""
        if column == self.SEQ_LEN_COL:
            return "seq_len"
        if self.host_col <= column < self.host_col + self.host_width:
            return f"host block of page {column - self.host_col}"
        for group, (start, width) in enumerate(zip(self.group_cols, self.group_widths)):
            if start <= column < start + width:
                return f"device group {group} entry {column - start}"
        return f"column {column}"


@dataclass(frozen=True)
class PlanLimits:
    """What a worker checks every received plan against: its own tables and pools.

    - ``layout``: its table layout; ``max_model_len``: the largest ``seq_len``;
      ``block_size``: rows per host block (and per resident device block);
    - ``num_device_blocks`` / ``num_host_blocks``: the pools' blocks (block 0 of each is the
      null block: never a mirror source or target);
    - ``resident``: device group positions of the resident groups, in plan order (the rows
      of ``mirror_device_rows``; what ``lost`` entries may name).
    """

    layout: TableLayout
    max_model_len: int
    block_size: int
    num_device_blocks: int
    num_host_blocks: int
    resident: tuple[int, ...]

    @functools.cached_property
    def column_bounds(self) -> np.ndarray:
        """``[width] int64``: every arena column's exclusive upper bound (``seq_len``:
        ``max_model_len + 1``; host blocks; device blocks)."""
        L = self.layout
        bounds = np.full(L.width, self.num_device_blocks, dtype=np.int64)
        bounds[L.SEQ_LEN_COL] = self.max_model_len + 1
        bounds[L.host_col:L.host_col + L.host_width] = self.num_host_blocks
        return bounds

    @functools.cached_property
    def _column_limits(self) -> np.ndarray:
        """``[width] uint32``: ``column_bounds`` capped at ``2**31`` (no int32 value reaches
        it), for ``StepPlan``'s vectorised check of values viewed as ``uint32`` (a negative
        value is then ``>= 2**31``, outside every column)."""
        return np.minimum(self.column_bounds, 2**31).astype(np.uint32)


#: The byte header of ``to_bytes``: magic, format version, then step, layout, commit, the
#: counts (resets, writes, mirror, resident, lost), released_pages, num_invalidate.
_HEADER = struct.Struct("<4sIqqqqqqqqqq")
_MAGIC = b"HSPL"
#: Version of the byte format (``to_bytes``); a payload of another version is refused.
PLAN_FORMAT_VERSION = 2
_INT64 = (-2**63, 2**63 - 1)
#: The integer header fields, each with its smallest allowed value.
_INT_FIELDS = (("step", 1), ("layout", 0), ("num_resets", 0), ("num_writes", 0),
               ("num_mirror", 0), ("num_resident", 0), ("num_lost", 0), ("released_pages", 0),
               ("num_invalidate", 0))


@dataclass(frozen=True, eq=False)
class StepPlan:
    """One step's worth of table updates and mirror work for every worker (no torch).

    - ``step``: sequence number (1, 2, ...); a worker applies plans strictly in order.
    - ``layout``: ``TableLayout.fingerprint`` of the scheduler that made it.
    - ``commit``: whether the plan ends a step (``HiSparseScheduler.step``): the scheduler
      has counted the mirror rows of every earlier plan as durable (it may reuse their
      pages' blocks from this plan on), so a worker applies it only after every earlier
      mirror. A plan without it (``HiSparseScheduler.flush``) declares nothing durable and
      may be applied while mirrors are due. Any plan's mirror rows are copied device ->
      host after the forward that wrote them (``HiSparseWorker.mirror``).
    - ``data``: ``int32`` sections, read through the properties: ``reset_rows [r]``,
      ``write_index [w]``, ``write_value [w]``, ``mirror_host_rows [m]``,
      ``mirror_device_rows [num_resident, m]``, ``lost [l, 3]`` (state row, device group
      position, page) of resident pages whose block went to another owner in this plan
      (already among the writes: their table entry becomes 0), ``invalidate [v, 3]``
      (state row, host row lo, host row hi): hot slots of that state row holding a host row
      in ``[lo, hi)`` are emptied (a rollback dropped those rows; see the module docstring).
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
    num_invalidate: int = 0
    data: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32), repr=False)

    def __post_init__(self) -> None:
        """Check the structure (types, counts, the data's dtype and size); values are
        checked by ``check`` against a receiver's own tables and pools."""
        fields = self.__dict__
        for name, minimum in _INT_FIELDS:
            value = fields[name]
            if type(value) is int and minimum <= value <= _INT64[1]:
                continue  # (the common case; anything else is checked and converted below)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
                raise ValueError(f"StepPlan.{name} must be an int, got {value!r}.")
            value = int(value)
            if not minimum <= value <= _INT64[1]:
                raise ValueError(f"StepPlan.{name} is {value}, outside [{minimum}, "
                                 f"{_INT64[1]}].")
            object.__setattr__(self, name, value)
        if self.commit.__class__ is not bool and not isinstance(self.commit, (bool, np.bool_)):
            raise ValueError(f"StepPlan.commit must be True or False, got {self.commit!r}.")
        object.__setattr__(self, "commit", bool(self.commit))
        data = self.data
        if type(data) is not np.ndarray or data.dtype != np.int32 or data.ndim != 1:
            what = (f"{data.dtype} array of shape {data.shape}"
                    if isinstance(data, np.ndarray) else type(data).__name__)
            raise ValueError(f"StepPlan.data must be a 1-D int32 numpy array, got {what}.")
        if self.num_mirror and self.num_resident == 0:
            raise ValueError(f"StepPlan {self.step} has {self.num_mirror} mirror rows but "
                             f"num_resident is 0.")
        expected = _data_size(self.num_resets, self.num_writes, self.num_mirror,
                              self.num_resident, self.num_lost, self.num_invalidate)
        if data.size != expected:
            raise ValueError(f"StepPlan.data holds {data.size} entries; its counts need "
                             f"{expected}.")

    @classmethod
    def received(cls, plan: object, *, what: str = "apply") -> "StepPlan":
        """A private, checked copy of a plan from elsewhere, for a receiver that trusts
        nothing: ``ValueError`` naming the field unless ``plan`` is a well-formed
        ``StepPlan``, whatever made it (the constructor, ``from_bytes``, or an unpickled
        object whose attributes anyone may have changed: unpickling skips the constructor's
        checks). The copy owns its data, so later changes to the sender's array do not reach
        it. ``what`` names the receiving call in the message."""
        if not isinstance(plan, StepPlan):
            raise ValueError(f"{what} takes a StepPlan, got {type(plan).__name__}.")
        fields = {}
        for name in (*(n for n, _ in _INT_FIELDS), "commit", "data"):
            try:
                fields[name] = object.__getattribute__(plan, name)
            except AttributeError:
                raise ValueError(f"{what}: the StepPlan has no {name!r} field (an "
                                 f"incomplete or foreign object).") from None
        if isinstance(fields["data"], np.ndarray):
            fields["data"] = np.array(fields["data"], copy=True, subok=False)
        return cls(**fields)

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
    def invalidate(self) -> np.ndarray:
        """``[v, 3] int32`` (state row, host row lo, host row hi): hot slots to empty."""
        start = self.data.size - 3 * self.num_invalidate
        return self._section(start, 3 * self.num_invalidate).reshape(self.num_invalidate, 3)

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
        if self.num_invalidate:
            lines.append(f"  {plural(self.num_invalidate, 'hot-slot range')} invalidated "
                         f"(state rows {some(np.unique(self.invalidate[:, 0]))})")
        return "\n".join(lines)

    # ------------------------------------------------------------------ (de)serialise
    def to_bytes(self) -> bytes:
        """The plan as bytes (a fixed header + the int32 data), for any transport."""
        header = _HEADER.pack(_MAGIC, PLAN_FORMAT_VERSION, self.step, self.layout,
                              int(self.commit), self.num_resets, self.num_writes,
                              self.num_mirror, self.num_resident, self.num_lost,
                              self.released_pages, self.num_invalidate)
        return header + self.data.astype("<i4", copy=False).tobytes()

    @classmethod
    def from_bytes(cls, payload: bytes | bytearray | memoryview) -> "StepPlan":
        """Inverse of ``to_bytes``; ``ValueError`` naming what is wrong with a truncated,
        foreign or inconsistent payload (magic, format version, a header field, the data's
        size)."""
        try:
            view = memoryview(payload).cast("B")
        except TypeError:
            raise ValueError(f"StepPlan.from_bytes takes bytes, got "
                             f"{type(payload).__name__}.") from None
        if len(view) < _HEADER.size:
            raise ValueError(f"a StepPlan payload of {len(view)} B is truncated (the header "
                             f"alone is {_HEADER.size} B).")
        (magic, version, step, layout, commit, resets, writes, mirror, resident, lost,
         released, invalidate) = _HEADER.unpack_from(view)
        if magic != _MAGIC:
            raise ValueError(f"not a StepPlan payload (magic {magic!r}, expected {_MAGIC!r}).")
        if version != PLAN_FORMAT_VERSION:
            raise ValueError(f"a StepPlan payload of format version {version}; this "
                             f"hisparse-triton reads version {PLAN_FORMAT_VERSION} (the "
                             f"scheduler and the workers must run the same version).")
        if commit not in (0, 1):
            raise ValueError(f"StepPlan {step}: the commit field holds {commit}, not 0 or 1.")
        if (len(view) - _HEADER.size) % 4:
            raise ValueError(f"a StepPlan payload of {len(view)} B is truncated (its data is "
                             f"not whole int32 entries).")
        data = np.frombuffer(view[_HEADER.size:], dtype="<i4").astype(np.int32)
        return cls(step=step, layout=layout, commit=bool(commit), num_resets=resets,
                   num_writes=writes, num_mirror=mirror, num_resident=resident,
                   num_lost=lost, released_pages=released, num_invalidate=invalidate,
                   data=data)

    @classmethod
    def build(cls, *, step: int, layout: int, commit: bool, reset_rows: np.ndarray,
              write_index: np.ndarray, write_value: np.ndarray, mirror_host_rows: np.ndarray,
              mirror_device_rows: np.ndarray, lost: np.ndarray,
              released_pages: int = 0,
              invalidate: Optional[np.ndarray] = None) -> "StepPlan":
        """Pack the sections (each converted to int32) into one plan. ``invalidate``:
        ``[v, 3]`` (state row, host row lo, host row hi) entries, or ``None`` for none."""
        if invalidate is None:
            invalidate = np.zeros((0, 3), dtype=np.int32)
        mirror_device_rows = np.asarray(mirror_device_rows, dtype=np.int32)
        num_resident = mirror_device_rows.shape[0] if mirror_device_rows.ndim == 2 else 0
        parts = [np.asarray(a, dtype=np.int32).reshape(-1)
                 for a in (reset_rows, write_index, write_value, mirror_host_rows,
                           mirror_device_rows, lost, invalidate)]
        if parts[1].size != parts[2].size:
            raise ValueError(f"StepPlan.build: {parts[1].size} write indices but "
                             f"{parts[2].size} write values.")
        if parts[4].size != num_resident * parts[3].size:
            raise ValueError(f"StepPlan.build: mirror_device_rows must be [resident groups, "
                             f"{parts[3].size}], got shape {mirror_device_rows.shape}.")
        for name, part in (("lost", parts[5]), ("invalidate", parts[6])):
            if part.size % 3:
                raise ValueError(f"StepPlan.build: {name} must be [n, 3], got {part.size} "
                                 f"values.")
        return cls(step=step, layout=layout, commit=commit, num_resets=parts[0].size,
                   num_writes=parts[1].size, num_mirror=parts[3].size,
                   num_resident=num_resident, num_lost=parts[5].size // 3,
                   released_pages=released_pages, num_invalidate=parts[6].size // 3,
                   data=np.concatenate(parts))

    def check(self, limits: PlanLimits) -> None:
        """``ValueError`` naming the first field and entry of this plan that does not fit a
        receiver's ``limits`` (its own layout and pools). Reads only this plan:

        - the layout fingerprint (which covers the pool sizes); resident groups of the
          mirror rows;
        - ``reset_rows``: state rows, distinct; ``write_index``: arena entries, distinct
          (a repeated index would be written in no defined order); ``write_value``: per
          column, ``seq_len`` in ``[0, max_model_len]``, host blocks in
          ``[0, num_host_blocks)``, device blocks in ``[0, num_device_blocks)``;
        - ``mirror_host_rows``: distinct host rows outside the null block; every row of
          ``mirror_device_rows``: a device row outside the null block;
        - ``lost``: every column (state row, a resident group's position, a page of it);
        - ``invalidate``: a state row and a host row range ``lo <= hi``.
        """
        L, step = limits.layout, self.step
        if self.layout != L.fingerprint:
            raise ValueError(f"StepPlan {step} was made for table layout "
                             f"{self.layout:#x}, this worker's is {L.fingerprint:#x} (the "
                             f"fingerprint covers the tables and the pool sizes): the "
                             f"scheduler and the worker use different plans.")
        resident = len(limits.resident)
        if self.num_mirror and self.num_resident != resident:
            raise ValueError(f"StepPlan {step} mirrors {self.num_resident} resident "
                             f"groups; this plan has {resident}.")
        if not self._tables_fit(limits):  # the detailed checks name the first bad value
            self._check_tables(limits)
        if self.num_lost:
            self._check_lost(limits)
        if self.num_invalidate:
            self._check_invalidate(limits)

    def _tables_fit(self, limits: PlanLimits) -> bool:
        """Whether ``reset_rows``, the writes and the mirror rows pass ``check``: a few
        numpy calls per non-empty section, none of them a ufunc reduction (``argmin`` /
        ``count_nonzero`` cost a third of one on small arrays). False may also mean "look
        closer": ``check`` then runs ``_check_tables``, which names the bad entry."""
        L, data, B = limits.layout, self.data, limits.block_size
        r, w, m = self.num_resets, self.num_writes, self.num_mirror
        if r and not _distinct_in(data[:r], 0, L.max_num_seqs):
            return False
        if w:
            index = data[r:r + w]
            if not _distinct_in(index, 0, L.num_entries):
                return False
            bounds = limits._column_limits.take(index % L.width)
            if np.count_nonzero(np.less(data[r + w:r + 2 * w].view(np.uint32), bounds)) != w:
                return False
        if m:
            start = r + 2 * w
            if not _distinct_in(data[start:start + m], B, limits.num_host_blocks * B):
                return False
            device = data[start + m:start + m * (1 + self.num_resident)]
            if (device[device.argmin()] < B
                    or device[device.argmax()] >= limits.num_device_blocks * B):
                return False
        return True

    def _check_tables(self, limits: PlanLimits) -> None:
        """``check``'s entry-by-entry checks of ``reset_rows``, the writes and the mirror
        rows: ``ValueError`` naming the first bad one."""
        L, step = limits.layout, self.step
        S, B = L.max_num_seqs, limits.block_size
        host_rows, device_rows = limits.num_host_blocks * B, limits.num_device_blocks * B
        _in_range(step, "reset_rows", self.reset_rows, 0, S)
        _distinct(step, "reset_rows", self.reset_rows)
        index, value = self.write_index, self.write_value
        _in_range(step, "write_index", index, 0, L.num_entries)
        _distinct(step, "write_index", index)
        if index.size:
            columns = index % L.width
            bounds = limits.column_bounds[columns]
            bad = (value < 0) | (value >= bounds)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ValueError(
                    f"StepPlan {step}: write_value[{i}] = {int(value[i])} for state row "
                    f"{int(index[i]) // L.width}, {L.column_name(int(columns[i]))}, is "
                    f"outside [0, {int(bounds[i])}).")
        _in_range(step, "mirror_host_rows", self.mirror_host_rows, B, host_rows,
                  " (rows of block 0, the null block, are never written)")
        _distinct(step, "mirror_host_rows", self.mirror_host_rows)
        _in_range(step, "mirror_device_rows", self.mirror_device_rows.reshape(-1), B,
                  device_rows, " (rows of block 0, the null block, hold no token)")

    def _check_lost(self, limits: PlanLimits) -> None:
        """``check`` of the ``lost`` section: ``ValueError`` naming the first bad entry."""
        L, step, S = limits.layout, self.step, limits.layout.max_num_seqs
        lost = self.lost
        _in_range(step, "lost state rows (column 0)", lost[:, 0], 0, S)
        positions = np.asarray(limits.resident, dtype=np.int64)
        not_resident = ~np.isin(lost[:, 1], positions)
        if not_resident.any():
            e = int(np.flatnonzero(not_resident)[0])
            raise ValueError(f"StepPlan {step}: lost[{e}] names device group "
                             f"{int(lost[e, 1])} (column 1), not a resident group "
                             f"{list(limits.resident)}.")
        widths = np.asarray(L.group_widths, dtype=np.int64)[lost[:, 1]]
        bad = (lost[:, 2] < 0) | (lost[:, 2] >= widths)
        if bad.any():
            e = int(np.flatnonzero(bad)[0])
            raise ValueError(f"StepPlan {step}: lost[{e}] names page {int(lost[e, 2])} "
                             f"(column 2), outside [0, {int(widths[e])}).")

    def _check_invalidate(self, limits: PlanLimits) -> None:
        """``check`` of the ``invalidate`` section: ``ValueError`` naming the first bad
        entry."""
        step, S = self.step, limits.layout.max_num_seqs
        host_rows = limits.num_host_blocks * limits.block_size
        entries = self.invalidate
        _in_range(step, "invalidate state rows (column 0)", entries[:, 0], 0, S)
        lo, hi = entries[:, 1], entries[:, 2]
        bad = (lo < 0) | (hi < lo) | (hi > host_rows)
        if bad.any():
            e = int(np.flatnonzero(bad)[0])
            raise ValueError(f"StepPlan {step}: invalidate[{e}] is host rows "
                             f"[{int(lo[e])}, {int(hi[e])}), not a range inside "
                             f"[0, {host_rows}].")


def _data_size(resets: int, writes: int, mirror: int, resident: int, lost: int,
               invalidate: int) -> int:
    """Entries of a plan's ``data`` for its section counts."""
    return resets + 2 * writes + mirror * (1 + resident) + 3 * lost + 3 * invalidate


def _distinct_in(values: np.ndarray, lo: int, hi: int) -> bool:
    """Whether the (non-empty) ``values`` are distinct and inside ``[lo, hi)``: one
    comparison when they are increasing (as a scheduler writes them), else a sort too."""
    n = values.size
    if np.count_nonzero(np.less(values[:-1], values[1:])) != n - 1:
        values = np.sort(values)
        if np.count_nonzero(np.less(values[:-1], values[1:])) != n - 1:
            return False
    return lo <= values[0] and values[-1] < hi


def _in_range(step: int, name: str, values: np.ndarray, lo: int, hi: int,
              why: str = "") -> None:
    """``ValueError`` naming ``name`` and its first value outside ``[lo, hi)``."""
    if values.size and (values.min() < lo or values.max() >= hi):
        bad = values[(values < lo) | (values >= hi)][0]
        raise ValueError(f"StepPlan {step}: {name} holds {int(bad)}, outside [{lo}, "
                         f"{hi}){why}.")


def _distinct(step: int, name: str, values: np.ndarray) -> None:
    """``ValueError`` naming ``name`` and a value it holds twice."""
    if values.size > 1:
        ordered = np.sort(values)
        repeated = ordered[1:] == ordered[:-1]
        if repeated.any():
            raise ValueError(f"StepPlan {step}: {name} holds "
                             f"{int(ordered[1:][repeated][0])} twice.")


__all__ = ["PLAN_FORMAT_VERSION", "PlanLimits", "StepPlan", "TableLayout"]
