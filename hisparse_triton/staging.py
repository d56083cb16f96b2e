"""The prefill staging rows: device blocks ``resolve_prefill`` copies host-only rows into.

A prefill chunk's top-k selections may name rows whose page lives only in the host pool.
``resolve_prefill`` copies each distinct such row once into *staging rows* of the device
pool, so the attention kernel reads every selected row through the same per-layer
``device_cache`` view as resident rows. Where those rows are:

- **lent per step** (``HiSparseConfig.prefill_staging_rows = 0``, the default): nothing is
  reserved. Before a chunk is staged the scheduler lends free device blocks for the rest of
  the step (``HiSparseScheduler.borrow_prefill_staging(rows)``; the facade borrows
  ``scheduler_host_rows_bound`` rows, all the chunk can need) and takes them back when the
  step ends; the worker stages into the rows of the blocks it is given
  (``resolve_prefill(..., staging_blocks=)``). It works for any chunk whose bound fits the
  blocks free at that moment (beside the hot regions reserved for other requests and the
  blocks held for this step's reads); memory is used only while a chunk needs it.
- **a reserved region** (``prefill_staging_rows = N > 0``): ``cdiv(N, block_size)`` blocks
  at the end of the pool, ``[num_blocks_total - num_blocks, num_blocks_total)``, never
  allocated (the scheduler allocates only ids below ``first_block``); the worker stages into
  rows ``first_row + i``, ``i < capacity_rows``. A guarantee, paid for all the time.

A staging row is a row of every layer's view: the worker copies the row into the pages of
every layer of the index group it serves (each layer at its own offset inside the block, as
for any resident page). So a staged row costs ``bytes_per_block / block_size`` bytes of the
pool although a call writes only its index group's layers: ``row_bytes * len(index
group)``, at most ``largest_group_row_bytes``. (Rows are addressed through each layer's
block-strided view, whose other layers' pages in the same block a call cannot use.)

Both halves derive the region from the plan and the config with ``PrefillStaging.from_plan``,
so they agree without exchanging anything. Memory: a region costs ``num_blocks *
bytes_per_block`` of the planned device pool; the worker adds one ``int32`` per host-pool
row of device scratch (``resolve_prefill``'s distinct-row table) and ``8`` bytes per staging
row of plan. ``chunk_rows(config)`` is what one chunk of one request can need at most.

This module imports no torch (the scheduler side uses it too) and no numpy at import
(``hisparse-triton plan`` reads it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Optional, Sequence

from hisparse_triton.config import EngineConfig
from hisparse_triton.specs import KVCacheConfig, cdiv

__all__ = ["PrefillStaging", "chunk_rows", "host_only_rows", "host_rows_bound",
           "largest_group_row_bytes", "scheduler_host_rows_bound"]


@dataclass(frozen=True)
class PrefillStaging:
    """The staging region of one plan (see the module docstring).

    - ``first_block``: the first reserved block id, also the number of block ids the
      scheduler may use (``[0, first_block)``, block 0 being the null block);
    - ``num_blocks``: reserved blocks (0: no region: staging blocks are lent per step);
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
    def lent(self) -> bool:
        """Whether staging blocks are lent per step (no region reserved)."""
        return self.num_blocks == 0

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


def chunk_rows(config: EngineConfig) -> int:
    """Staging rows one prefill chunk of one request can need at most: its distinct
    host-only rows are at most its ``T * index_topk`` selections (``T`` =
    ``max_num_batched_tokens``, or ``max_model_len`` when unset: a whole prompt per step)
    and at most its history (below ``max_model_len``). A chunk of several requests needs at
    most ``T * index_topk`` and their histories summed (``host_rows_bound``)."""
    if config.hisparse is None:
        raise ValueError("prefill staging needs an EngineConfig with hisparse set.")
    tokens = config.max_num_batched_tokens or config.max_model_len
    return min(tokens * config.hisparse.index_topk, config.max_model_len)


def largest_group_row_bytes(kv_cache_config: KVCacheConfig) -> int:
    """Bytes one staged row writes for the index group with the most row bytes (its layers'
    rows summed): what a ``resolve_prefill`` call writes per staged row, at most."""
    topology = kv_cache_config.hisparse_topology
    if topology is None:
        raise ValueError("largest_group_row_bytes needs a HiSparse KVCacheConfig.")
    groups = kv_cache_config.kv_cache_groups
    best = 0
    for ig in topology.index_groups:
        group = groups[ig.resident_group]
        row = group.layer_page_size_bytes // group.kv_cache_spec.block_size
        best = max(best, row * len(ig.layers))
    return best


def host_only_rows(resident_blocks: Sequence[int], host_blocks: Sequence[int], seq_len: int,
                   block_size: int) -> int:
    """Rows of one request that only the host pool holds: rows below ``seq_len`` of pages
    with a host block (non-zero) and no device block (zero) in ``resident_blocks`` (the
    request's block table of the index group's resident group)."""
    import numpy as np   # here: ``hisparse-triton plan`` reads this module without numpy

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
