"""The prefill staging region: device blocks kept out of allocation for ``resolve_prefill``.

A prefill chunk's top-k selections may name rows whose page lives only in the host pool.
``resolve_prefill`` copies each distinct such row once into a *staging region* of the device
pool, so the attention kernel reads every selected row through the same per-layer
``device_cache`` view as resident rows. The region is part of the planned device pool:

- size: ``HiSparseConfig.prefill_staging_rows`` rows (host-only rows one call can stage),
  rounded up to whole blocks: ``num_blocks = cdiv(prefill_staging_rows, block_size)``;
- place: the LAST ``num_blocks`` block ids of the device pool,
  ``[num_blocks_total - num_blocks, num_blocks_total)``. The scheduler allocates only ids
  below ``first_block``; the worker stages into rows ``first_row + i``,
  ``i < capacity_rows``, of every sparse layer of the index group it serves (each layer at
  its own offset inside the block, as for any resident page).

Both halves derive the region from the plan and the config with ``PrefillStaging.from_plan``,
so they agree without exchanging anything. Memory: the region costs ``num_blocks *
bytes_per_block`` of the planned device pool (blocks the scheduler can no longer hand out);
the worker adds one ``int32`` per host-pool row of device scratch (``resolve_prefill``'s
distinct-row table) and ``8 * capacity_rows`` bytes of staging plan.

This module imports no torch: the scheduler side uses it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Optional, Sequence

import numpy as np

from hisparse_triton.config import EngineConfig
from hisparse_triton.specs import KVCacheConfig, cdiv

__all__ = ["PrefillStaging", "host_only_rows", "host_rows_bound", "scheduler_host_rows_bound"]


@dataclass(frozen=True)
class PrefillStaging:
    """The staging region of one plan (see the module docstring).

    - ``first_block``: the first reserved block id, also the number of block ids the
      scheduler may use (``[0, first_block)``, block 0 being the null block);
    - ``num_blocks``: reserved blocks (0: no staging region);
    - ``block_size``: rows per block (the source group's).
    """

    first_block: int
    num_blocks: int
    block_size: int

    @classmethod
    def from_plan(cls, kv_cache_config: KVCacheConfig,
                  config: EngineConfig) -> "PrefillStaging":
        """The region of ``kv_cache_config`` for ``config.hisparse.prefill_staging_rows``;
        ``ValueError`` naming both numbers when it would leave the pool fewer than 2 blocks
        (the null block and one allocatable block)."""
        if config.hisparse is None:
            raise ValueError("prefill staging needs an EngineConfig with hisparse set.")
        sources = [g for g in kv_cache_config.kv_cache_groups if g.host_resident]
        if len(sources) != 1:
            raise ValueError(f"a HiSparse KVCacheConfig has exactly one host-resident group, "
                             f"got {len(sources)}.")
        block_size = sources[0].kv_cache_spec.block_size
        rows = config.hisparse.prefill_staging_rows
        num_blocks = cdiv(rows, block_size)
        total = kv_cache_config.num_blocks
        if total - num_blocks < 2:
            raise ValueError(
                f"prefill_staging_rows={rows} reserves {num_blocks} blocks of {block_size} "
                f"rows, but the device pool has only {total} blocks (at least 2 must stay "
                f"allocatable: the null block and one page); lower prefill_staging_rows or "
                f"plan more device blocks.")
        return cls(first_block=total - num_blocks, num_blocks=num_blocks,
                   block_size=block_size)

    @property
    def capacity_rows(self) -> int:
        """Distinct host-only rows one ``resolve_prefill`` call can stage."""
        return self.num_blocks * self.block_size

    @property
    def first_row(self) -> int:
        """Device row id of staging row 0 (``first_block * block_size``)."""
        return self.first_block * self.block_size

    def nbytes(self, bytes_per_block: int) -> int:
        """Device-pool bytes the region takes out of allocation."""
        return self.num_blocks * bytes_per_block


def host_only_rows(resident_blocks: Sequence[int], host_blocks: Sequence[int], seq_len: int,
                   block_size: int) -> int:
    """Rows of one request that only the host pool holds: rows below ``seq_len`` of pages
    with a host block (non-zero) and no device block (zero) in ``resident_blocks`` (the
    request's block table of the index group's resident group)."""
    pages = min(len(resident_blocks), len(host_blocks), cdiv(seq_len, block_size))
    if pages <= 0:
        return 0
    resident = np.asarray(resident_blocks[:pages])
    host = np.asarray(host_blocks[:pages])
    only = (host != 0) & (resident == 0)
    rows = int(only.sum()) * block_size
    if only[pages - 1]:  # the last page may be partly filled
        rows -= pages * block_size - seq_len
    return rows


def host_rows_bound(per_request_host_rows: Iterable[int], tokens: int, top_k: int) -> int:
    """An upper bound of the distinct host-only rows a chunk can reference: the chunk's
    ``tokens * top_k`` selections, and at most every host-only row of its distinct requests
    (``per_request_host_rows``, e.g. ``host_only_rows`` of each)."""
    return min(tokens * top_k, sum(per_request_host_rows))


def scheduler_host_rows_bound(scheduler: Any, leader_layer: str,
                              request_ids: Sequence[Optional[Hashable]], top_k: int) -> int:
    """``host_rows_bound`` of a chunk from a scheduler's bookkeeping (``block_table``,
    ``host_block_table``, ``seq_len`` and ``block_size`` of a ``HiSparseScheduler``): one
    request id per query token (None = padding), each distinct request counted once. Valid
    once the scheduler's pending changes are in the worker's tables (after ``step()`` and
    ``apply``), so that both name the same device blocks."""
    block_size = scheduler.block_size
    per_request = [host_only_rows(scheduler.block_table(rid, leader_layer),
                                  scheduler.host_block_table(rid), scheduler.seq_len(rid),
                                  block_size)
                   for rid in dict.fromkeys(r for r in request_ids if r is not None)]
    return host_rows_bound(per_request, len(request_ids), top_k)
