"""A worker's per-request tables and how a ``StepPlan`` changes them (``PlanTables``).

Tables (``TableLayout``): one int32 arena ``[max_num_seqs, width]``; ``seq_lens``, the host
block table and every device group's block table are column views of it (row stride
``width``), so a plan is applied with one host -> device copy and one scatter:

1. ``check(plan)``: the one place a plan is validated (type, order, a mirror still due, every
   entry inside the layout and the pools); a refused plan changes nothing;
2. the plan's int32 data goes to the device through a ring of ``STAGING_SLOTS`` pinned
   buffers (``StagingRing``: the CPU may run that many plans ahead; a slot is reused only
   after its earlier copy ran);
3. resets (every table of those state rows emptied, and the hot state of the rows reset
   through a ``RowState``), then the writes (``arena.view(-1)[index] = value``).

What the last plan overwrote is kept, so ``revert(plan)`` restores the tables exactly (a
caller whose later work in the same call failed); a failure part-way through an apply
restores the touched entries before the error propagates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import numpy as np
import torch

from hisparse_triton.step_plan import StepPlan, TableLayout

__all__ = ["STAGING_SLOTS", "PlanTables", "RowState", "StagingRing"]

#: Pinned staging buffers for plans in flight (the CPU may run this many plans ahead).
STAGING_SLOTS = 4


class RowState(Protocol):
    """Per-state-row device state that a plan's resets empty besides the tables (the hot
    state of every index group)."""

    def save_rows(self, rows: torch.Tensor) -> tuple:
        """A copy of the state of ``rows`` (``[r]`` state rows), for ``restore_rows``."""

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Empty the state of ``rows``."""

    def restore_rows(self, rows: torch.Tensor, saved: tuple) -> None:
        """Put back what ``save_rows(rows)`` copied."""


class StagingRing:
    """Moves a plan's int32 data to the device without a host sync: through one of
    ``slots`` pinned buffers into one device buffer (on the CPU, the numpy data as is)."""

    def __init__(self, device: torch.device, slots: int = STAGING_SLOTS) -> None:
        self.device = device
        self._host = [torch.empty(0, dtype=torch.int32) for _ in range(slots)]
        self._events: list[Optional[torch.cuda.Event]] = [None] * slots
        self._next = 0
        self._device_buffer = torch.empty(0, dtype=torch.int32, device=device)

    def upload(self, values: np.ndarray) -> torch.Tensor:
        """``values`` (1-D int32) on the device: valid until the next ``upload``."""
        host = torch.from_numpy(values)
        if self.device.type == "cpu":
            return host
        n = host.numel()
        slot = self._next
        event = self._events[slot]
        if event is not None:
            event.synchronize()  # that slot's earlier copy must have read it
        if self._host[slot].numel() < n:
            self._host[slot] = torch.empty(max(n, 2 * self._host[slot].numel(), 1024),
                                           dtype=torch.int32, pin_memory=True)
        if self._device_buffer.numel() < n:
            self._device_buffer = torch.empty(max(n, 2 * self._device_buffer.numel(), 1024),
                                              dtype=torch.int32, device=self.device)
        staged = self._host[slot][:n]
        staged.copy_(host)
        data = self._device_buffer[:n]
        data.copy_(staged, non_blocking=True)
        if event is None:
            event = self._events[slot] = torch.cuda.Event()
        event.record()
        self._next = (slot + 1) % len(self._host)
        return data

    def last(self, values: np.ndarray) -> torch.Tensor:
        """The device copy of ``values``, the data of the last ``upload``."""
        if self.device.type == "cpu":
            return torch.from_numpy(values)
        return self._device_buffer[:values.size]


@dataclass(frozen=True)
class _Undo:
    """What one applied plan overwrote."""

    step: int
    resets: Optional[torch.Tensor]      # [r] state rows reset (None: no resets)
    arena_rows: Optional[torch.Tensor]  # [r, width] their arena rows before
    row_state: tuple                    # RowState.save_rows(resets)
    index: torch.Tensor                 # [w] flat arena indices written
    old_values: Optional[torch.Tensor]  # [w] their values before (None: no writes)


class PlanTables:
    """The per-request table arena of one worker and the plans applied to it.

    - ``layout``: the arena's columns (``TableLayout``); ``row_state``: the per-row state a
      reset also empties; ``num_device_blocks``, ``num_host_blocks``, ``block_size``,
      ``num_resident``: what a plan's entries are checked against.
    - Views (``[max_num_seqs, ...] int32``, updated in place): ``seq_lens``, ``host_blocks``
      (host block of every page), ``group_tables[i]`` (device group ``i``'s block table).
    """

    def __init__(self, layout: TableLayout, device: torch.device, row_state: RowState, *,
                 num_device_blocks: int, num_host_blocks: int, block_size: int,
                 num_resident: int) -> None:
        self.layout, self.device, self._row_state = layout, device, row_state
        self._limits = (num_device_blocks, num_host_blocks, block_size)
        self._num_resident = num_resident
        L = layout
        self.arena = torch.zeros(L.max_num_seqs, L.width, dtype=torch.int32, device=device)
        self.flat = self.arena.view(-1)
        self.seq_lens = self.arena[:, L.SEQ_LEN_COL]
        self.host_blocks = self.arena[:, L.host_col:L.host_col + L.host_width]
        self.group_tables = [self.arena[:, col:col + width]
                             for col, width in zip(L.group_cols, L.group_widths)]
        self.next_step = 1
        #: The last plan applied while its mirror rows are still to be copied, else None.
        self.mirror_due: Optional[StepPlan] = None
        self._ring = StagingRing(device)
        self._last: Optional[_Undo] = None

    @staticmethod
    def nbytes(layout: TableLayout) -> int:
        """Device bytes of the arena of ``layout``."""
        return 4 * layout.num_entries

    @property
    def applied(self) -> int:
        """Plans applied (and not reverted)."""
        return self.next_step - 1

    # ------------------------------------------------------------------ checks
    def check(self, plan: object) -> None:
        """``ValueError`` unless ``plan`` is the next ``StepPlan`` of this layout, the last
        one's mirror rows were mirrored, and every entry fits the layout and the pools."""
        if not isinstance(plan, StepPlan):
            raise ValueError(f"apply takes a StepPlan, got {type(plan).__name__}.")
        if plan.step != self.next_step:
            what = "repeated" if plan.step < self.next_step else "skipped ahead"
            raise ValueError(f"StepPlan {plan.step} is out of order ({what}): this worker "
                             f"expects step {self.next_step}.")
        if self.mirror_due is not None:
            raise ValueError(f"StepPlan {self.mirror_due.step} has mirror rows that were "
                             f"never mirrored: call mirror(plan) after the forward, before "
                             f"applying step {plan.step}.")
        plan.check(self.layout, *self._limits)
        if plan.num_mirror and plan.num_resident != self._num_resident:
            raise ValueError(f"StepPlan {plan.step} mirrors {plan.num_resident} resident "
                             f"groups; this plan has {self._num_resident}.")

    def check_last(self, plan: object) -> None:
        """``ValueError`` unless ``plan`` is the last plan applied."""
        step = getattr(plan, "step", None)
        if not isinstance(plan, StepPlan) or step != self.next_step - 1:
            raise ValueError(f"mirror(plan) takes the last plan applied (step "
                             f"{self.next_step - 1}), got step {step!r}.")

    # ------------------------------------------------------------------ apply / revert
    def apply(self, plan: StepPlan) -> None:
        """Check ``plan`` (``check``), then write its resets and writes (one packed host ->
        device copy, then on-device scatters; no host sync). All or nothing."""
        self.check(plan)
        with torch.inference_mode(False), torch.no_grad():
            data = self._ring.upload(plan.data)
            self._last = self._write(plan, data)
        self.next_step += 1
        self.mirror_due = plan if plan.num_mirror else None

    def revert(self, plan: StepPlan) -> None:
        """Undo ``apply(plan)``: every table entry and hot-state row it changed is restored
        and the next plan expected is ``plan.step`` again. ``plan`` must be the last plan
        applied and not reverted yet (``ValueError`` otherwise). Rows it mirrored stay in the
        host pool (nothing refers to them once the plan's sender has rolled back too)."""
        last = self._last
        if last is None or not isinstance(plan, StepPlan) or last.step != plan.step:
            raise ValueError(f"StepPlan {getattr(plan, 'step', plan)!r} is not the last plan "
                             f"applied.")
        with torch.inference_mode(False), torch.no_grad():
            self._restore(last)
        self._last = None
        self.next_step -= 1
        self.mirror_due = None

    def packed(self, plan: StepPlan) -> torch.Tensor:
        """The last applied plan's int32 data on the device (its mirror sections are read
        from there)."""
        return self._ring.last(plan.data)

    def mark_mirrored(self) -> None:
        """The last plan's mirror rows were copied (or need no copy on this rank)."""
        self.mirror_due = None

    def _write(self, plan: StepPlan, data: torch.Tensor) -> _Undo:
        r, w = plan.num_resets, plan.num_writes
        resets, index, value = data[:r], data[r:r + w], data[r + w:r + 2 * w]
        undo = _Undo(step=plan.step, resets=resets if r else None,
                     arena_rows=self.arena[resets].clone() if r else None,
                     row_state=self._row_state.save_rows(resets) if r else (),
                     index=index, old_values=self.flat[index] if w else None)
        try:
            if r:
                self.arena[resets] = 0
                self._row_state.reset_rows(resets)
            if w:
                self.flat[index] = value
        except BaseException:
            self._restore(undo)
            raise
        return undo

    def _restore(self, undo: _Undo) -> None:
        if undo.old_values is not None:
            self.flat[undo.index] = undo.old_values
        if undo.resets is not None:
            self.arena[undo.resets] = undo.arena_rows
            self._row_state.restore_rows(undo.resets, undo.row_state)
