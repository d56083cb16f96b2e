"""The worker's views: its pools, tables and layers' bytes, as live tensors (a mixin).

``WorkerViews`` holds the read-side accessors of ``HiSparseWorker``: layer views of both pools
(``device_cache``, ``device_rows``, ``host_cache``), the table arena's views (``block_tables``,
``seq_lens``, ``host_table``, ``tables``) and the pools themselves. Every view is live: ``apply``
and ``mirror`` update what it shows in place. It reads the worker's parts (``_layers``,
``_tables``, ``groups``, the pools) and changes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from hisparse_triton.errors import RuntimeClosedError
from hisparse_triton.worker.pools import DevicePool, HostPool

if TYPE_CHECKING:
    from hisparse_triton.groups import PlanGroups
    from hisparse_triton.worker.layers import PoolLayers
    from hisparse_triton.worker.tables import PlanTables

__all__ = ["WorkerViews"]


class WorkerViews:
    """Live views of a worker's pools and tables (mixed into ``HiSparseWorker``)."""

    groups: "PlanGroups"
    _layers: "PoolLayers"
    _tables: "PlanTables"
    _host_pool: Optional[HostPool]
    _device_pool: Optional[DevicePool]

    _closed: bool

    def _check_open(self) -> None:
        """``RuntimeClosedError`` once the worker is closed (every public call checks)."""
        if self._closed:
            raise RuntimeClosedError("the HiSparseWorker is closed.")

    def device_cache(self, layer_name: str) -> torch.Tensor:
        """``[num_blocks, block_size, row_bytes] uint8`` view of a device layer.

        ``layer_name``: an indexer or regular layer, a sparse layer (its resident and hot
        views are these same bytes), or a ``.hisparse_resident``/``.hisparse_hot`` name.
        Row ``r`` of ``append_slots``/``resolve_rows`` is ``view[r // B, r % B]`` with
        ``B = view.shape[1]`` (the view is strided: blocks lie ``bytes_per_block`` apart, so
        it cannot be flattened; ``device_rows`` is a flat view for a row-aligned plan)."""
        self._check_open()
        return self._layers.device_cache(layer_name)

    def device_rows(self, layer_name: str) -> torch.Tensor:
        """``[num_rows, row_bytes] uint8`` flat view of a sparse layer's device cache, for a
        plan made with ``row_aligned_blocks=True`` (``ValueError`` otherwise): the runtime's
        row id ``block * block_size + slot`` is flat row ``block * rows_per_block + slot``
        (``hisparse_triton.layout.device_row_layout(...).flat_row``), so an attention kernel
        can index every sparse layer as one array of rows without a block stride."""
        self._check_open()
        return self._layers.device_rows(layer_name)

    def host_cache(self, layer_name: str) -> torch.Tensor:
        """``[host_num_blocks, block_size, row_bytes] uint8`` view of a source layer's host
        rows (on CUDA, read it on the CPU only after synchronising with the mirror)."""
        self._check_open()
        return self._layers.host_cache(layer_name)

    def row_bytes(self, layer_name: str) -> int:
        """Bytes of one row of a device layer (a sparse layer's host rows are the same
        size)."""
        self._check_open()
        return self._layers.row_bytes(self.groups.device_layer_name(layer_name), host=False)

    def row_offsets(self, layer_name: str, rows: object, *, host: bool = False) -> np.ndarray:
        """``[n] int64`` byte offsets of ``rows`` (``[n]`` row ids: a ``KVImport``'s or
        ``KVExport``'s, ``append_slots``'s) of a layer from the start of its pool: the host
        pool (``host=True``: a source layer's host rows; the address is
        ``host_pool.data_ptr`` + offset) or the device pool (``device_pool.tensor.data_ptr()``
        + offset). Each row is ``row_bytes(layer)`` contiguous bytes (the rows of one page
        are consecutive). For a transport that addresses registered memory (RDMA;
        ``docs/runtime.md``, "Prefill/decode disaggregation"). ``ValueError`` for a row
        outside the pool, ``KeyError`` for an unknown layer."""
        self._check_open()
        return self._layers.row_offsets(layer_name, rows, host=host)

    def block_tables(self, layer_name: str) -> torch.Tensor:
        """``[max_num_seqs, pages] int32`` device block table of a layer's group, by state
        row (a view of the table arena, updated in place by ``apply``)."""
        self._check_open()
        return self.tables[self.groups.layer_group[self.groups.device_layer_name(layer_name)]]

    @property
    def seq_lens(self) -> torch.Tensor:
        """``[max_num_seqs] int32`` tokens appended, by state row (a live arena view)."""
        return self._tables.seq_lens

    @property
    def host_table(self) -> torch.Tensor:
        """``[max_num_seqs, pages] int32`` host block of every page (0 = none; live view)."""
        return self._tables.host_blocks

    @property
    def tables(self) -> list[torch.Tensor]:
        """Every device group's ``[max_num_seqs, width] int32`` block table (live views)."""
        return self._tables.group_tables

    @property
    def host_pool_secret(self) -> Optional[str]:
        """The shared host pool's run secret (hex; what every other rank must pass as
        ``host_pool_secret``), ``None`` for a private pool."""
        return None if self._host_pool is None else self._host_pool.secret

    @property
    def host_pool(self) -> HostPool:
        """The host pool (source layers' rows)."""
        return self._host_pool

    @property
    def device_pool(self) -> DevicePool:
        """The device pool (every device layer)."""
        return self._device_pool

    @property
    def leaders(self) -> list[str]:
        return list(self.groups.leaders)
