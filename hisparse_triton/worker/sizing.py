"""What a worker allocates, known before it allocates anything.

``memory_requests`` lists the worker's allocations for ``memory.check_memory``: the host
pool (nothing on an attaching rank or for a caller's tensor), the device pool (nothing for a
caller's tensor), and the bookkeeping (``bookkeeping_bytes``: the table arena, the hot state
and the counters, none of which grows with the pools' block counts). Nothing here builds
anything that grows with the pools, so a plan is checked before any allocation, by the worker
itself and by a caller (the in-process runtime, before its scheduler's block lists).
"""

from __future__ import annotations

import torch

from hisparse_triton.config import EngineConfig
from hisparse_triton.groups import PlanGroups
from hisparse_triton.memory import MemoryRequest
from hisparse_triton.specs import KVCacheConfig
from hisparse_triton.step_plan import TableLayout
from hisparse_triton.worker.adopted import host_pool_bytes
from hisparse_triton.worker.hot_cache import HotState
from hisparse_triton.worker.options import parse_device
from hisparse_triton.worker.pools import DevicePool, HostPool
from hisparse_triton.worker.tables import PlanTables

__all__ = ["bookkeeping_bytes", "memory_requests"]

_INT32_MAX = 2**31 - 1


def bookkeeping_bytes(layout: TableLayout, num_index_groups: int, max_num_seqs: int,
                      slots: int) -> int:
    """Device bytes of the table arena, the hot state and the counters: all the worker's
    bookkeeping (none of it grows with the pools' block counts)."""
    return PlanTables.nbytes(layout) + HotState.nbytes(num_index_groups, max_num_seqs, slots)


def memory_requests(kv_cache_config: KVCacheConfig, config: EngineConfig, *,
                    max_num_seqs: int, device: torch.device | str | None = None,
                    tp_rank: int = 0, device_pool_given: bool = False,
                    host_pool_given: bool = False) -> list[MemoryRequest]:
    """Everything a worker for this plan allocates, for ``memory.check_memory``: the host
    pool (nothing on an attaching rank or for a caller's tensor), the device pool (nothing
    for a caller's tensor), and the tables and hot state. ``ValueError`` when a pool has more
    rows than int32 row ids address, or the host pool has fewer than 2 blocks."""
    device = parse_device(device)
    groups = PlanGroups.from_config(kv_cache_config, config)
    B = groups.block_size
    for what, blocks in (("device", kv_cache_config.num_blocks),
                         ("host", kv_cache_config.hisparse_host_num_blocks)):
        if blocks * B > _INT32_MAX:
            raise ValueError(f"the {what} pool's {blocks} blocks x {B} rows exceed the "
                             f"{_INT32_MAX} row ids int32 tables address; plan fewer "
                             f"blocks.")
    if kv_cache_config.hisparse_host_num_blocks < 2:
        raise ValueError(f"the host pool needs at least 2 blocks (the null block and one "
                         f"page), the plan has {kv_cache_config.hisparse_host_num_blocks}.")
    layout = TableLayout.build(groups, max_num_seqs)
    shared = bool(kv_cache_config.hisparse_shared_host_pool)
    host = [] if host_pool_given else HostPool.memory_requests(
        host_pool_bytes(kv_cache_config), shared=shared, create=tp_rank == 0)
    dev = [] if device_pool_given else DevicePool.memory_requests(
        kv_cache_config.num_blocks, kv_cache_config.bytes_per_block, device)
    tables = bookkeeping_bytes(layout, len(groups.index_groups), max_num_seqs,
                               int(config.hisparse.device_buffer_size))
    return [*host, *dev, MemoryRequest("per-request tables and hot state", tables, device,
                                       hint="max_num_seqs or device_buffer_size")]
