"""A worker's constructor options: the device, the backend names, and their checks.

``check_options`` refuses a bad argument before anything is allocated; ``parse_device`` turns
a device argument into a usable ``torch.device``; ``plan_fingerprint`` names a plan, so that
the ranks sharing one host pool can check they planned alike.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import torch

from hisparse_triton.config import EngineConfig
from hisparse_triton.specs import KVCacheConfig

__all__ = ["BACKENDS", "check_options", "parse_device", "plan_fingerprint"]

#: Accepted ``backend`` values.
BACKENDS = ("auto", "triton", "torch")


def plan_fingerprint(kv_cache_config: KVCacheConfig) -> str:
    """A short hash of a plan: the ranks sharing one host pool must have planned alike."""
    return hashlib.sha256(repr(kv_cache_config).encode()).hexdigest()[:24]


def parse_device(device: object) -> torch.device:
    """``device`` (``None`` = CUDA when available, else CPU) as a usable ``torch.device``;
    ``ValueError`` naming it when it is not a cpu/cuda device or is CUDA on a machine
    without."""
    if device is None:
        parsed = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            parsed = torch.device(device)  # type: ignore[arg-type]
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ValueError(f"device {device!r} is not a torch device: {exc}") from None
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: the runtime runs on a cpu or cuda device.")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: CUDA is not available on this machine.")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s).")
        if parsed.index is None:
            parsed = torch.device("cuda", torch.cuda.current_device())
    return parsed


def check_options(kv_cache_config: KVCacheConfig, config: EngineConfig, max_num_seqs: int,
                   backend: str, tp_rank: int, host_pool_name: Optional[str],
                   host_ram_fraction: float) -> None:
    """``ValueError`` naming the first bad constructor argument."""
    if not isinstance(config, EngineConfig) or config.hisparse is None:
        raise ValueError("HiSparseWorker needs an EngineConfig with hisparse set.")
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be an int >= 1, got {max_num_seqs!r}.")
    shared = bool(kv_cache_config.hisparse_shared_host_pool)
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or tp_rank < 0:
        raise ValueError(f"tp_rank must be an int >= 0, got {tp_rank!r}.")
    if tp_rank >= config.tensor_parallel_size:
        raise ValueError(f"tp_rank {tp_rank} must be < tensor_parallel_size="
                         f"{config.tensor_parallel_size}.")
    if shared and host_pool_name is None:
        raise ValueError("kv_cache_config.hisparse_shared_host_pool is True (one host pool "
                         "shared by the TP ranks of the node): pass host_pool_name (the "
                         "same on every rank; tp_rank 0 creates the pool).")
    if not shared and host_pool_name is not None:
        raise ValueError(f"host_pool_name={host_pool_name!r} was given but "
                         f"kv_cache_config.hisparse_shared_host_pool is False (each rank "
                         f"owns a private host pool); plan with shared_host_pool=True or "
                         f"drop host_pool_name.")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    if (isinstance(host_ram_fraction, bool) or not isinstance(host_ram_fraction, (int, float))
            or not 0 < host_ram_fraction <= 1):
        raise ValueError(f"host_ram_fraction must be in (0, 1], got {host_ram_fraction!r}.")
