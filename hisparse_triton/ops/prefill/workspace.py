"""``PrefillWorkspace``: every buffer a ``plan_prefill`` call needs, allocated once per worker.

A prefill chunk's plan is built on the device with fixed shapes, so its buffers are sized
by the plan, not by the call:

- ``row_rank [num_host_rows] int32``: one entry per host-pool row: the Triton kernels mark
  the rows a chunk references there, then replace each mark by the row's staging rank
  (its number among the chunk's distinct host-only rows, in increasing host row order).
  Entries of rows a call does not reference keep older values, which no call acts on.
  Initially -1 (``ROW_UNUSED``); ``ROW_MARK`` (-2) only between two kernels of one call.
- ``tile_sums [cdiv(num_host_rows, RANK_TILE)] int32``: marked rows per tile of
  ``row_rank`` (the scan's first pass);
- the staging plan: ``src_rows [1, C] int32`` (host row of staging row ``i``; -1 past the
  staged count), ``dst_rows [1, C] int32`` (the device row of staging row ``i``:
  ``first_row + i`` for a region of consecutive rows, written once; any rows for a
  workspace given a map with ``map_staging``), ``counts [2] int32`` (``staged``,
  ``needed``); ``C`` = the region's capacity in rows;
- ``rows``: the ``[T, K] int32`` output, one grow-only buffer whose views are cached per
  shape (a chunk of a new, larger shape allocates; size it with ``reserve`` up front).

The reference uses the plan buffers and the output, never ``row_rank``.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["PrefillWorkspace", "RANK_TILE", "ROW_MARK", "ROW_UNUSED"]

#: Host rows per program of the rank scan (a power of two).
RANK_TILE = 4096
#: ``row_rank`` value of a row no call has ranked yet.
ROW_UNUSED = -1
#: ``row_rank`` value of a row marked by the current call, before it is ranked.
ROW_MARK = -2


def _normalise(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:<current>`` (tensors always carry an index; compare like them)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"PrefillWorkspace: {name} must be an int >= {minimum}, got "
                         f"{value!r}")
    return value


class PrefillWorkspace:
    """Buffers of ``plan_prefill`` on one device (see the module docstring).

    - ``num_host_rows``: rows of the host pool (``num_host_blocks * block_size``);
    - ``capacity_rows``: the staging region's rows (0: no region, every host-only column
      overflows); ``first_row``: device row of staging row 0 (the region's rows are
      consecutive; ``map_staging`` maps them anywhere instead).
    Device memory: ``4 * num_host_rows + 8 * capacity_rows`` bytes plus the output. Not
    thread-safe: one call at a time (the calls of a worker run one after another).
    """

    def __init__(self, device: torch.device | str, *, num_host_rows: int, capacity_rows: int,
                 first_row: int) -> None:
        self.device = _normalise(torch.device(device))
        self.num_host_rows = _check_count("num_host_rows", num_host_rows, 1)
        self.capacity_rows = _check_count("capacity_rows", capacity_rows, 0)
        self.first_row = _check_count("first_row", first_row, 0)
        if first_row + capacity_rows > 2**31 - 1:
            raise ValueError(f"PrefillWorkspace: staging rows up to "
                             f"{first_row + capacity_rows} do not fit int32 row ids")
        with torch.inference_mode(False):
            self.row_rank = torch.full((num_host_rows,), ROW_UNUSED, dtype=torch.int32,
                                       device=self.device)
            self.tile_sums = torch.zeros(-(-num_host_rows // RANK_TILE), dtype=torch.int32,
                                         device=self.device)
            self._rows = torch.empty(0, dtype=torch.int32, device=self.device)
            self._plan = torch.empty(0, dtype=torch.int32, device=self.device)
            self._set_plan(capacity_rows)
            self.dst_rows.copy_(torch.arange(first_row, first_row + capacity_rows,
                                             dtype=torch.int32, device=self.device).view(1, -1))
        #: Whether ``map_staging`` gave the staging rows (else ``first_row + i``).
        self.mapped = False
        self._views: dict[tuple[int, int], torch.Tensor] = {}

    def _set_plan(self, capacity_rows: int) -> None:
        """The plan's views for ``capacity_rows`` rows, in one grow-only allocation (a
        zero-capacity plan still has valid addresses); ``src_rows`` -1, counts 0."""
        C, size = capacity_rows, 2 * max(capacity_rows, 1) + 2
        if self._plan.numel() < size:
            self._plan = torch.empty(size, dtype=torch.int32, device=self.device)
        plan = self._plan
        self.src_rows = plan[:C].view(1, C)
        self.src_rows.fill_(-1)
        self.dst_rows = plan[max(C, 1):max(C, 1) + C].view(1, C)
        self.counts = plan[2 * max(C, 1):2 * max(C, 1) + 2]
        self.counts.zero_()
        #: ``[1] int32`` views of ``counts``: rows staged (the gather's count), rows needed.
        self.staged = self.counts[0:1]
        self.needed = self.counts[1:2]
        self.capacity_rows = C

    def map_staging(self, rows: torch.Tensor) -> None:
        """Stage into ``rows`` from the next call on: ``[C] int32`` device rows on this
        workspace's device, staging row ``i`` -> ``rows[i]`` (e.g. blocks borrowed from the
        pool, not consecutive). The workspace then has ``capacity_rows = C`` and
        ``first_row = 0`` (what a call passes as ``staging_rows`` / ``staging_first_row``);
        the plan buffer grows at most to the largest ``C`` seen. Eager calls only (the
        registered op, under tracing, stages into consecutive rows)."""
        if (not isinstance(rows, torch.Tensor) or rows.dtype != torch.int32
                or rows.dim() != 1 or _normalise(rows.device) != self.device):
            raise ValueError(f"PrefillWorkspace.map_staging: rows must be a 1-D int32 tensor "
                             f"on {self.device}, got {getattr(rows, 'dtype', type(rows))} of "
                             f"shape {tuple(getattr(rows, 'shape', ()))}")
        with torch.inference_mode(False):
            self._set_plan(rows.numel())
            self.dst_rows.copy_(rows.view(1, -1))
        self.first_row, self.mapped = 0, True

    @property
    def nbytes(self) -> int:
        """Device bytes held (scratch, plan and the output buffer)."""
        return 4 * (self.row_rank.numel() + self.tile_sums.numel() + self._plan.numel()
                    + self._rows.numel())

    def reserve(self, tokens: int, top_k: int) -> None:
        """Grow the output buffer to hold ``[tokens, top_k]`` rows (allocates at most once
        per larger size; views of the old buffer are dropped)."""
        _check_count("tokens", tokens, 0)
        _check_count("top_k", top_k, 1)
        if tokens * top_k > self._rows.numel():
            with torch.inference_mode(False):
                self._rows = torch.empty(tokens * top_k, dtype=torch.int32,
                                         device=self.device)
            self._views.clear()

    def rows(self, tokens: int, top_k: int) -> torch.Tensor:
        """The ``[tokens, top_k] int32`` output view (cached; grows the buffer first when
        needed)."""
        view = self._views.get((tokens, top_k))
        if view is None:
            self.reserve(tokens, top_k)
            view = self._views[(tokens, top_k)] = self._rows[:tokens * top_k].view(tokens,
                                                                                  top_k)
        return view

    def matches(self, num_host_rows: int, capacity_rows: int, first_row: int,
                device: torch.device) -> bool:
        """Whether this workspace was built for these sizes on ``device``."""
        return (self.num_host_rows == num_host_rows and self.capacity_rows == capacity_rows
                and self.first_row == first_row and self.device == device)

    def clear_marks(self) -> None:
        """Drop the marks a call left behind when it failed between its kernels (torch
        ops; the failure path only)."""
        self.row_rank.masked_fill_(self.row_rank == ROW_MARK, ROW_UNUSED)

    @classmethod
    def for_call(cls, workspace: Optional["PrefillWorkspace"], device: torch.device, *,
                 num_host_rows: int, capacity_rows: int, first_row: int) -> "PrefillWorkspace":
        """``workspace``, or a one-off one for a call without it."""
        if workspace is not None:
            return workspace
        return cls(device, num_host_rows=num_host_rows, capacity_rows=capacity_rows,
                   first_row=first_row)

    def __repr__(self) -> str:
        mapped = ", mapped" if self.mapped else ""
        return (f"PrefillWorkspace(device={self.device}, num_host_rows={self.num_host_rows}, "
                f"capacity_rows={self.capacity_rows}, first_row={self.first_row}{mapped}, "
                f"rows={self._rows.numel()})")
