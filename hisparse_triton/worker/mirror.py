"""The device -> host mirror of a plan's new rows (``HostMirror``).

After a step's forward wrote KV at the rows the scheduler handed out, ``mirror`` copies them
into the host pool (write-through): every source layer's row ``mirror_device_rows[g, j]`` of
its resident group ``g`` goes to host row ``mirror_host_rows[j]``. Source layers are grouped
by row size (``MirrorSet``); each set is ONE copy launch for all of its layers, whatever the
number of rows. The copy itself is handed in (``copy``), so this module runs no kernel.

Draft layers (a speculative drafter's own attention layers, e.g. DeepSeek's MTP block) write
their KV for a step after the main forward, when the drafter runs. Declared as such
(``draft_layers``), they form their own sets, copied by their own call (``copy(...,
draft=True)``), so each layer is mirrored only once its KV is there: a plan's mirror is a
main part and, with draft layers, a draft part.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from hisparse_triton.groups import PlanGroups
from hisparse_triton.row_table import RowTable
from hisparse_triton.step_plan import StepPlan
from hisparse_triton.worker.layers import PoolLayers
from hisparse_triton.worker.tables import PlanTables, ordinary_tensors

__all__ = ["CopyRows", "HostMirror", "MirrorSet"]

#: ``copy(dst, src, src_rows, dst_rows, counts=None, *, backend)``: ``ops.copy_rows``.
CopyRows = Callable[..., None]


@dataclass(frozen=True)
class MirrorSet:
    """Source layers of one row size, mirrored device -> host by one copy launch.

    ``resident_of_layer [L] int64``: for each layer, its resident group's row of
    ``plan.mirror_device_rows``; ``device_table`` / ``host_table``: the layers' rows in the
    two pools; ``draft``: whether they are draft layers (copied by the draft part).
    ``one_resident`` (derived): that row when every layer has the same one (the copy's
    source rows are then a view of the plan, no gather), else None."""

    layers: tuple[str, ...]
    row_bytes: int
    resident_of_layer: torch.Tensor
    device_table: RowTable
    host_table: RowTable
    draft: bool = False
    one_resident: Optional[int] = field(init=False, default=None)

    def __post_init__(self) -> None:
        rows = set(self.resident_of_layer.tolist())   # once, when the worker is built
        object.__setattr__(self, "one_resident", rows.pop() if len(rows) == 1 else None)


class HostMirror:
    """Copies plans' new rows device -> host (see the module docstring); counts the bytes
    moved in ``d2h_bytes`` (only once every copy of a plan was enqueued: a copy that raises
    counts nothing) and remembers the last plan's ``(step, bytes)`` in ``last``, so a
    reverted plan takes its bytes back (``uncount``). ``backend`` is passed to ``copy`` as
    is."""

    def __init__(self, sets: Sequence[MirrorSet], copy: CopyRows, *,
                 backend: Optional[str]) -> None:
        self.sets = tuple(sets)
        #: The sets of each part (False: the main layers, True: the draft layers).
        self._part_sets = {part: tuple(s for s in self.sets if s.draft == part)
                           for part in (False, True)}
        self._copy, self.backend = copy, backend
        self.d2h_bytes = 0
        self.last: tuple[int, int] = (0, 0)

    def uncount(self, step: int) -> None:
        """Take the bytes of plan ``step``'s copy back out of ``d2h_bytes`` (the plan was
        reverted); nothing when the last copy was of another plan."""
        if self.last[0] == step:
            self.d2h_bytes, self.last = self.d2h_bytes - self.last[1], (0, 0)

    def zero(self) -> None:
        """Zero the byte counter."""
        self.d2h_bytes, self.last = 0, (0, 0)

    @classmethod
    def build(cls, groups: PlanGroups, layers: PoolLayers, copy: CopyRows, *,
              backend: Optional[str],
              draft_layers: frozenset[str] = frozenset()) -> "HostMirror":
        """One ``MirrorSet`` per row size of ``groups.source_layers`` (in model order), the
        ``draft_layers`` (source layer names) in sets of their own."""
        by_kind: dict[tuple[bool, int], list[str]] = {}
        for layer in groups.source_layers:
            key = (layer in draft_layers, layers.row_bytes(layer, host=True))
            by_kind.setdefault(key, []).append(layer)
        resident_pos = {g.position: i for i, g in enumerate(groups.resident)}
        sets = []
        for (draft, _), names in by_kind.items():
            device_table, host_table, row_bytes = layers.row_tables(names)
            sets.append(MirrorSet(
                layers=tuple(names), row_bytes=row_bytes,
                resident_of_layer=torch.tensor(
                    [resident_pos[groups.resident_of_layer[layer]] for layer in names],
                    dtype=torch.int64, device=layers.device),
                device_table=device_table, host_table=host_table, draft=draft))
        return cls(sets, copy, backend=backend)

    @property
    def parts(self) -> frozenset[bool]:
        """The parts a plan's mirror has: ``{False}`` (main), ``{False, True}`` with draft
        layers."""
        return frozenset({False} | {s.draft for s in self.sets})

    @property
    def tables(self) -> list[RowTable]:
        """Every table the copies use (to validate them up front)."""
        return [t for s in self.sets for t in (s.device_table, s.host_table)]

    def copy(self, plan: StepPlan, packed: torch.Tensor, *, draft: bool = False) -> int:
        """Enqueue the copies of ``plan``'s mirror rows of the main layers (of the draft
        layers with ``draft``); returns the bytes they move, which the caller counts
        (``counted``) once every copy was enqueued. ``packed``: the plan's int32 data where
        the copies run (its mirror sections are read there: no host -> device copy)."""
        if not plan.num_mirror:
            return 0
        return self._copy_sets(plan, packed, self._part_sets[draft])

    @ordinary_tensors   # the views and gathers as ordinary tensors in any mode
    def _copy_sets(self, plan: StepPlan, packed: torch.Tensor,
                   sets: tuple[MirrorSet, ...]) -> int:
        """``copy`` of ``sets``: per set, the host rows as a ``[L, 1, n]`` view of
        ``packed`` (stride 0 over the layers) and the device rows gathered by resident
        group (or a view too, for a set of ``one_resident``), then one copy call."""
        n, resident = plan.num_mirror, plan.num_resident
        if packed.stride(0) != 1:
            packed = packed.contiguous()
        start = packed.storage_offset() + plan.num_resets + 2 * plan.num_writes
        device = None   # [num_resident, 1, n] the device rows, made when a set gathers
        moved = 0
        for mset in sets:
            layers = len(mset.layers)
            dst = packed.as_strided((layers, 1, n), (0, n, 1), start)
            if mset.one_resident is not None:
                src = packed.as_strided((layers, 1, n), (0, n, 1),
                                        start + n * (1 + mset.one_resident))
            else:
                if device is None:
                    device = packed.as_strided((resident, 1, n), (n, n, 1), start + n)
                src = device.index_select(0, mset.resident_of_layer)
            self._copy(mset.host_table, mset.device_table, src, dst, backend=self.backend)
            moved += n * layers * mset.row_bytes
        return moved

    def copy_due(self, tables: "PlanTables", *, draft: bool, writes_host: bool) -> None:
        """Copy the mirror rows of every plan ``tables`` holds as due for this part (the
        main layers, or the draft layers with ``draft``), in plan order; then count their
        bytes and mark the part mirrored, together. ``writes_host=False`` (a rank that does
        not write a shared pool) copies nothing and only marks them. A copy that raises
        counts nothing and leaves every mirror due."""
        due = [d for d in tables.due if draft in d.parts]
        if not due:  # nothing to copy, or already mirrored
            return
        counts = (self.d2h_bytes, self.last)
        for entry in due:  # in plan order; a copy that raises counts nothing
            moved = (self.copy(entry.plan, tables.packed(entry), draft=draft)
                     if writes_host else 0)
            counts = count_bytes(counts, entry.plan.step, moved)
        # One statement: the bytes are counted and the parts marked mirrored together.
        (self.d2h_bytes, self.last), tables.due = counts, tables.mirrored(draft)

    def counted(self, step: int, moved: int) -> tuple[int, tuple[int, int]]:
        """``(d2h_bytes, last)`` once plan ``step``'s ``moved`` bytes are counted (the caller
        assigns both in one statement, together with its own bookkeeping); the parts of one
        plan add up in ``last``."""
        return count_bytes((self.d2h_bytes, self.last), step, moved)


def count_bytes(counts: tuple[int, tuple[int, int]], step: int,
                moved: int) -> tuple[int, tuple[int, int]]:
    """``(d2h_bytes, last)`` after adding plan ``step``'s ``moved`` bytes to ``counts`` (the
    same pair): ``last`` holds the bytes of the last plan copied, which a revert of that
    plan takes back."""
    d2h_bytes, (last_step, last_bytes) = counts
    before = last_bytes if last_step == step else 0
    return d2h_bytes + moved, (step, before + moved)
