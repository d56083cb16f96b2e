"""The device -> host mirror of a plan's new rows (``HostMirror``).

After a step's forward wrote KV at the rows the scheduler handed out, ``mirror`` copies them
into the host pool (write-through): every source layer's row ``mirror_device_rows[g, j]`` of
its resident group ``g`` goes to host row ``mirror_host_rows[j]``. Source layers are grouped
by row size (``MirrorSet``); each set is ONE copy launch for all of its layers, whatever the
number of rows. The copy itself is handed in (``copy``), so this module runs no kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from hisparse_triton.groups import PlanGroups
from hisparse_triton.row_table import RowTable
from hisparse_triton.step_plan import StepPlan
from hisparse_triton.worker.layers import PoolLayers

__all__ = ["CopyRows", "HostMirror", "MirrorSet"]

#: ``copy(dst, src, src_rows, dst_rows, counts=None, *, backend)``: ``ops.copy_rows``.
CopyRows = Callable[..., None]


@dataclass(frozen=True)
class MirrorSet:
    """Source layers of one row size, mirrored device -> host by one copy launch.

    ``resident_of_layer [L] int64``: for each layer, its resident group's row of
    ``plan.mirror_device_rows``; ``device_table`` / ``host_table``: the layers' rows in the
    two pools."""

    layers: tuple[str, ...]
    row_bytes: int
    resident_of_layer: torch.Tensor
    device_table: RowTable
    host_table: RowTable


class HostMirror:
    """Copies plans' new rows device -> host (see the module docstring); counts the bytes
    it moved in ``d2h_bytes``. ``backend`` is passed to ``copy`` as is."""

    def __init__(self, sets: Sequence[MirrorSet], copy: CopyRows, *,
                 backend: Optional[str]) -> None:
        self.sets = tuple(sets)
        self._copy, self.backend = copy, backend
        self.d2h_bytes = 0

    @classmethod
    def build(cls, groups: PlanGroups, layers: PoolLayers, copy: CopyRows, *,
              backend: Optional[str]) -> "HostMirror":
        """One ``MirrorSet`` per row size of ``groups.source_layers`` (in model order)."""
        by_size: dict[int, list[str]] = {}
        for layer in groups.source_layers:
            by_size.setdefault(layers.row_bytes(layer, host=True), []).append(layer)
        resident_pos = {g.position: i for i, g in enumerate(groups.resident)}
        sets = []
        for names in by_size.values():
            device_table, host_table, row_bytes = layers.row_tables(names)
            sets.append(MirrorSet(
                layers=tuple(names), row_bytes=row_bytes,
                resident_of_layer=torch.tensor(
                    [resident_pos[groups.resident_of_layer[layer]] for layer in names],
                    dtype=torch.int64, device=layers.device),
                device_table=device_table, host_table=host_table))
        return cls(sets, copy, backend=backend)

    @property
    def tables(self) -> list[RowTable]:
        """Every table the copies use (to validate them up front)."""
        return [t for s in self.sets for t in (s.device_table, s.host_table)]

    def copy(self, plan: StepPlan, packed: torch.Tensor) -> None:
        """Enqueue the copies of ``plan``'s mirror rows. ``packed``: the plan's int32 data
        where the copies run (its mirror sections are read there: no host -> device copy)."""
        n = plan.num_mirror
        if not n:
            return
        with torch.inference_mode(False), torch.no_grad():
            start = plan.num_resets + 2 * plan.num_writes
            host = packed[start:start + n]
            device = packed[start + n:start + n * (1 + plan.num_resident)].view(
                plan.num_resident, n)
            for mset in self.sets:
                layers = len(mset.layers)
                src = device.index_select(0, mset.resident_of_layer).unsqueeze(1)
                dst = host.view(1, 1, n).expand(layers, 1, n)
                self._copy(mset.host_table, mset.device_table, src, dst,
                           backend=self.backend)
                self.d2h_bytes += n * layers * mset.row_bytes
