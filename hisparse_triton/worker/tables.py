"""A worker's per-request tables and how a ``StepPlan`` changes them (``PlanTables``).

Tables (``TableLayout``): one int32 arena ``[max_num_seqs, width]``; ``seq_lens``, the host
block table and every device group's block table are column views of it (row stride
``width``), so a plan is applied with one host -> device copy and one scatter:

1. ``check(plan)``: the one place a received plan is validated: the worker takes its own
   copy (``StepPlan.received``: types, counts, the data's dtype and size, also for an
   unpickled plan that skipped the constructor), then checks the order, a mirror still due,
   and every value of every section against its own tables and pools (``StepPlan.check``
   with the worker's ``PlanLimits``); a refused plan changes nothing;
2. the plan's int32 data goes to the device through a ring of ``STAGING_SLOTS`` pinned
   buffers (``StagingRing``: the CPU may run that many plans ahead; a slot is reused only
   after its earlier copy ran);
3. resets (every table of those state rows emptied, and the hot state of the rows reset
   through a ``RowState``), then the writes (``arena.view(-1)[index] = value``) and the
   invalidations (hot slots holding dropped host rows emptied, through the ``RowState``).

What the last plan overwrote is kept, so ``revert(plan)`` restores the tables exactly (a
caller whose later work in the same call failed); a failure part-way through an apply
restores the touched entries before the error propagates. The copy of the last plan applied
is kept too: its mirror rows are the ones ``mirror`` copies, whatever the caller's plan
object holds afterwards.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional, Protocol

import numpy as np
import torch

from hisparse_triton.step_plan import PlanLimits, StepPlan, TableLayout

__all__ = ["STAGING_SLOTS", "DueMirror", "PlanTables", "RowState", "StagingRing"]

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

    def invalidate(self, rows: torch.Tensor, entry_row: torch.Tensor, lo: torch.Tensor,
                   hi: torch.Tensor) -> None:
        """Empty what state rows ``rows[entry_row[e]]`` hold in ``[lo[e], hi[e])`` (a
        plan's ``invalidate`` section; ``rows`` distinct)."""


class StagingRing:
    """Moves a plan's int32 data to the device without a host sync: through one of
    ``slots`` pinned buffers into one device buffer (on the CPU, the numpy data as is)."""

    def __init__(self, device: torch.device, slots: int = STAGING_SLOTS) -> None:
        self.device = device
        self._host = [torch.empty(0, dtype=torch.int32) for _ in range(slots)]
        self._events: list[Optional[torch.cuda.Event]] = [None] * slots
        self._next = 0
        self._device_buffer = torch.empty(0, dtype=torch.int32, device=device)
        #: ``(values, device tensor)`` of the last upload (``last`` hands the tensor back).
        self._last: tuple[Optional[np.ndarray], Optional[torch.Tensor]] = (None, None)

    def upload(self, values: np.ndarray) -> torch.Tensor:
        """``values`` (1-D int32) on the device: valid until the next ``upload``."""
        self._last = (None, None)
        data = self._upload(values)
        self._last = (values, data)
        return data

    def _upload(self, values: np.ndarray) -> torch.Tensor:
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
        """The device copy of ``values``, the data of the last ``upload`` (the very tensor
        ``upload`` returned when ``values`` is the array uploaded)."""
        uploaded, data = self._last
        if uploaded is values:
            return data
        if self.device.type == "cpu":
            return torch.from_numpy(values)
        return self._device_buffer[:values.size]


def ordinary_tensors(method: Callable) -> Callable:
    """``method`` run outside inference mode (the tables are ordinary tensors whatever the
    caller's mode); as a decorator, so no context exit runs in it. Outside inference mode
    it is called as is: no tensor it touches requires grad, so autograd records nothing
    either way, and entering the contexts would cost microseconds per call. Inside, it
    runs under ``inference_mode(False)`` and ``no_grad``."""
    ordinary = torch.inference_mode(False)(torch.no_grad()(method))

    @functools.wraps(method)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return ordinary(*args, **kwargs)
        return method(*args, **kwargs)

    return run


class _Undo(NamedTuple):
    """What one applied plan overwrote."""

    step: int
    resets: Optional[torch.Tensor]      # [r] state rows reset (None: no resets)
    arena_rows: Optional[torch.Tensor]  # [r, width] their arena rows before
    row_state: tuple                    # RowState.save_rows(resets)
    index: Optional[torch.Tensor]       # [w] flat arena indices written (None: no writes)
    old_values: Optional[torch.Tensor]  # [w] their values before (None: no writes)
    invalidated: Optional[torch.Tensor] = None  # [u] state rows invalidated (None: none)
    invalidated_state: tuple = ()       # RowState.save_rows(invalidated), before the plan


class DueMirror(NamedTuple):
    """An applied plan whose mirror rows are still to be copied: its device data once a
    later upload would overwrite it (None: still the last upload) and the parts left."""

    plan: StepPlan
    packed: Optional[torch.Tensor]
    parts: frozenset[bool]


class PlanTables:
    """The per-request table arena of one worker and the plans applied to it.

    - ``limits``: what every received plan is checked against (``PlanLimits``: the arena's
      columns, ``max_model_len``, the pools' block counts, the resident groups);
      ``row_state``: the per-row state a reset also empties.
    - Views (``[max_num_seqs, ...] int32``, updated in place): ``seq_lens``, ``host_blocks``
      (host block of every page), ``group_tables[i]`` (device group ``i``'s block table).
    - ``last_applied``: the worker's own copy of the last plan applied (``None`` before the
      first and after a revert); ``due``: every applied plan whose mirror rows are still to
      be copied (oldest first, each with the mirror parts left: ``False`` the main layers,
      ``True`` the draft layers). Several are due only when plans without ``commit`` came
      in between (a ``commit`` plan is refused while any mirror is due).
    """

    def __init__(self, limits: PlanLimits, device: torch.device, row_state: RowState, *,
                 mirror_parts: frozenset[bool] = frozenset({False})) -> None:
        self.limits, self.layout = limits, limits.layout
        self.device, self._row_state = device, row_state
        L = self.layout
        self.arena = torch.zeros(L.max_num_seqs, L.width, dtype=torch.int32, device=device)
        self.flat = self.arena.view(-1)
        self.seq_lens = self.arena[:, L.SEQ_LEN_COL]
        self.host_blocks = self.arena[:, L.host_col:L.host_col + L.host_width]
        self.group_tables = [self.arena[:, col:col + width]
                             for col, width in zip(L.group_cols, L.group_widths)]
        self.next_step = 1
        self.last_applied: Optional[StepPlan] = None
        #: The mirror parts (False: main layers, True: draft layers) a plan with mirror rows
        #: needs.
        self.mirror_parts = mirror_parts
        self.due: tuple[DueMirror, ...] = ()
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

    @property
    def mirror_due(self) -> Optional[StepPlan]:
        """The oldest applied plan whose mirror rows are still to be copied, else None."""
        return self.due[0].plan if self.due else None

    @property
    def parts_due(self) -> frozenset[bool]:
        """The mirror parts still to be copied for some due plan."""
        return frozenset().union(*(d.parts for d in self.due))

    @property
    def due_plans(self) -> list[StepPlan]:
        """Every applied plan whose mirror rows are still to be copied, oldest first."""
        return [d.plan for d in self.due]

    # ------------------------------------------------------------------ checks
    def check(self, plan: object) -> StepPlan:
        """The worker's own checked copy of ``plan`` (``StepPlan.received``): ``ValueError``
        unless it is a well-formed ``StepPlan``, the next one in order, for a ``commit`` plan
        every earlier plan's mirror rows were mirrored (a commit plan declares them durable:
        their blocks may be reused from then on; a plan without ``commit`` may come while
        mirrors are due), and every value of every section fits this worker's tables and
        pools (``StepPlan.check``)."""
        received = StepPlan.received(plan, what="apply")
        if received.step != self.next_step:
            what = "repeated" if received.step < self.next_step else "skipped ahead"
            raise ValueError(f"StepPlan {received.step} is out of order ({what}): this worker "
                             f"expects step {self.next_step}.")
        if self.due and received.commit:
            which = ("draft-layer mirror rows that were never mirrored: call "
                     "mirror(draft=True) once the drafter wrote their KV"
                     if self.parts_due == {True} else
                     "mirror rows that were never mirrored: call mirror(plan) after the "
                     "forward")
            raise ValueError(f"StepPlan {self.mirror_due.step} has {which}, before applying "
                             f"step {received.step}.")
        received.check(self.limits)
        return received

    def check_last(self, plan: object = None) -> Optional[StepPlan]:
        """The worker's copy of the last plan applied; ``ValueError`` unless ``plan`` is
        ``None`` or that very plan (same step, same content: a plan whose sections differ
        from what was applied is refused, so a mirror copies exactly the rows applied)."""
        last, expected = self.last_applied, self.next_step - 1
        if plan is None:
            return last
        step = getattr(plan, "step", None)
        if not isinstance(plan, StepPlan) or step != expected or last is None:
            raise ValueError(f"mirror(plan) takes the last plan applied (step {expected}), "
                             f"got step {step!r}.")
        if plan is not last and not _same_plan(plan, last):
            raise ValueError(f"mirror(plan): this StepPlan {step} is not the plan applied as "
                             f"step {step} (its header or sections differ); call mirror() "
                             f"with no argument to mirror what was applied.")
        return last

    # ------------------------------------------------------------------ apply / revert
    def apply(self, plan: object) -> None:
        """Check ``plan`` (``check``), then write its resets, writes and invalidations (one
        packed host -> device copy, then on-device scatters; no host sync). All or nothing:
        whatever raises part-way, the tables, the row state and the step count are as
        before."""
        received = self.check(plan)
        packed = received.data
        if received.num_invalidate:  # the distinct rows travel with the plan: one copy
            rows, entry_row = np.unique(received.invalidate[:, 0], return_inverse=True)
            packed = np.concatenate([packed, rows.astype(np.int32),
                                     entry_row.reshape(-1).astype(np.int32)])
        self._apply(received, packed)

    def revert(self, plan: object) -> None:
        """Undo ``apply(plan)``: every table entry and hot-state row it changed is restored
        and the next plan expected is ``plan.step`` again. ``plan`` must be the last plan
        applied and not reverted yet (``ValueError`` otherwise). Rows it mirrored stay in the
        host pool (nothing refers to them once the plan's sender has rolled back too)."""
        last = self._last
        if last is None or not isinstance(plan, StepPlan) or last.step != plan.step:
            raise ValueError(f"StepPlan {getattr(plan, 'step', plan)!r} is not the last plan "
                             f"applied.")
        self._revert(last)

    # The two methods below end with ONE statement that records the new step (after every
    # tensor write): whatever raises before it leaves the step count untouched, and the
    # tensor writes are undone first.
    @ordinary_tensors
    def _apply(self, plan: StepPlan, packed: np.ndarray) -> None:
        due = self.due
        if due and due[-1].packed is None:  # its device data survives the next upload
            # (kept as the due list even if this apply fails: the upload overwrites it)
            self.due = due = (*due[:-1], due[-1]._replace(
                packed=self._ring.last(due[-1].plan.data).clone()))
        data = self._ring.upload(packed)
        r, w = plan.num_resets, plan.num_writes
        resets = index = values = None
        if r or w:  # one split for the sections the writes read
            resets, index, values, _ = data.split_with_sizes(
                (r, w, w, packed.size - r - 2 * w))
        undo = self._save(plan, data, resets if r else None, index if w else None)
        kept = (self._last, self.next_step, self.last_applied, self.due)
        try:
            if r:
                self.arena[resets] = 0
                self._row_state.reset_rows(resets)
            if w:
                self.flat.index_put_((index,), values)
            if plan.num_invalidate:  # data: the plan's, then the distinct rows, entry rows
                v, end = plan.num_invalidate, plan.data.size
                entries = data[end - 3 * v:end].view(v, 3)
                entry_row = data[end + undo.invalidated.numel():]
                self._row_state.invalidate(undo.invalidated, entry_row, entries[:, 1],
                                           entries[:, 2])
            if plan.num_mirror:
                due = (*due, DueMirror(plan, None, self.mirror_parts))
            self._last, self.next_step, self.last_applied, self.due = (
                undo, plan.step + 1, plan, due)
        except BaseException:
            self._restore(undo)
            self._last, self.next_step, self.last_applied, self.due = kept
            raise

    @ordinary_tensors
    def _revert(self, undo: "_Undo") -> None:
        self._restore(undo)
        self._last, self.next_step, self.last_applied, self.due = (
            None, undo.step, None, tuple(d for d in self.due if d.plan.step != undo.step))

    def _save(self, plan: StepPlan, data: torch.Tensor, resets: Optional[torch.Tensor],
              index: Optional[torch.Tensor]) -> "_Undo":
        """What applying ``plan`` (its device ``data``; ``resets`` and ``index``: its
        sections there, None when empty) will overwrite; reads only. The invalidated rows'
        state is saved before the resets too: restoring both gives the state before the
        plan whatever the order."""
        arena_rows = old_values = invalidated = None
        row_state = invalidated_state = ()
        if resets is not None:
            arena_rows = self.arena.index_select(0, resets)
            row_state = self._row_state.save_rows(resets)
        if index is not None:
            old_values = self.flat.index_select(0, index)
        if plan.num_invalidate:
            end, v = plan.data.size, plan.num_invalidate
            invalidated = data[end:data.numel() - v]
            invalidated_state = self._row_state.save_rows(invalidated)
        return _Undo(plan.step, resets, arena_rows, row_state, index, old_values,
                     invalidated, invalidated_state)

    def packed(self, due: Optional["DueMirror"] = None) -> torch.Tensor:
        """A due plan's int32 data on the device (its mirror sections are read from there),
        by default the last applied plan's (on the CPU, the worker's own copy)."""
        if due is not None and due.packed is not None:
            return due.packed
        return self._ring.last((due.plan if due is not None else self.last_applied).data)

    def mirrored(self, draft: bool) -> tuple["DueMirror", ...]:
        """The due list once part ``draft`` of every due plan's mirror is done (the caller
        assigns it in one statement, with its byte count)."""
        only = _ONLY_PART[draft]
        return tuple(d._replace(parts=d.parts - only) for d in self.due if d.parts != only)

    def mark_mirrored(self) -> None:
        """Every part of every due plan's mirror was copied (or needs no copy here)."""
        self.due = ()

    def _restore(self, undo: _Undo) -> None:
        if undo.invalidated is not None:
            self._row_state.restore_rows(undo.invalidated, undo.invalidated_state)
        if undo.old_values is not None:
            self.flat[undo.index] = undo.old_values
        if undo.resets is not None:
            self.arena[undo.resets] = undo.arena_rows
            self._row_state.restore_rows(undo.resets, undo.row_state)


#: ``{part}`` of each mirror part (``mirrored``).
_ONLY_PART = {False: frozenset({False}), True: frozenset({True})}


def _same_plan(a: StepPlan, b: StepPlan) -> bool:
    """Whether two plans have the same header and sections."""
    return (a.step, a.layout, a.commit, a.num_resets, a.num_writes, a.num_mirror,
            a.num_resident, a.num_lost, a.released_pages, a.num_invalidate) == (
        b.step, b.layout, b.commit, b.num_resets, b.num_writes, b.num_mirror,
        b.num_resident, b.num_lost, b.released_pages, b.num_invalidate) and \
        isinstance(a.data, np.ndarray) and _same_values(a.data, b.data)


def _same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """``np.array_equal(a, b)``; for two 1-D arrays of one integer dtype, by their bytes
    (faster)."""
    if a.dtype == b.dtype and a.dtype.kind in "iu" and a.ndim == b.ndim == 1:
        return a.tobytes() == b.tobytes()
    return bool(np.array_equal(a, b))
