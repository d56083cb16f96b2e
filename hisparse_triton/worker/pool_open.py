"""The worker's two pools, allocated or adopted from the caller.

``open_host_pool`` gives the plan's host pool: the caller's tensor (adopted, registered if it
is not pinned and ``register`` allows), a private pool (pinned on a CUDA device), or a shared
``/dev/shm`` pool created by rank 0 and attached by the others. ``open_device_pool`` gives the
device pool: the caller's tensor or a new one. Sizes come from the plan
(``adopted.host_pool_bytes``, ``KVCacheConfig.num_blocks x bytes_per_block``).
"""

from __future__ import annotations

from typing import Optional

import torch

from hisparse_triton.specs import KVCacheConfig
from hisparse_triton.worker.adopted import host_pool_bytes
from hisparse_triton.worker.options import plan_fingerprint
from hisparse_triton.worker.pools import DevicePool, HostPool

__all__ = ["open_device_pool", "open_host_pool"]


def open_host_pool(kv_cache_config: KVCacheConfig, device: torch.device, *,
                   tensor: Optional[torch.Tensor], register: bool, max_ram_fraction: float,
                   shared_name: Optional[str], create: bool, secret: Optional[str],
                   group: Optional[str | int]) -> HostPool:
    """The host pool of ``kv_cache_config`` for a worker on ``device``: ``tensor`` adopted
    when given, else allocated (``shared_name``: the shared pool's file, created when
    ``create``, attached otherwise with ``secret``; ``group`` may attach)."""
    size = host_pool_bytes(kv_cache_config)
    if tensor is not None:
        return HostPool.adopt(tensor, size, register=register, device=device)
    return HostPool(size, pin=device.type == "cuda", max_ram_fraction=max_ram_fraction,
                    device=device, shared_name=shared_name, create=create,
                    fingerprint=plan_fingerprint(kv_cache_config), secret=secret, group=group)


def open_device_pool(kv_cache_config: KVCacheConfig, device: torch.device, *,
                     tensor: Optional[torch.Tensor]) -> DevicePool:
    """The device pool of ``kv_cache_config`` on ``device``: ``tensor`` adopted when given,
    else allocated."""
    blocks, block_bytes = kv_cache_config.num_blocks, kv_cache_config.bytes_per_block
    if tensor is not None:
        return DevicePool.adopt(tensor, blocks, block_bytes, device)
    return DevicePool(blocks, block_bytes, device)
