"""A worker's constructor options: the device, the backend names, and their checks.

``check_options`` refuses a bad argument before anything is allocated; ``parse_device`` turns
a device argument into a usable ``torch.device``; ``plan_fingerprint`` names a plan, so that
the ranks sharing one host pool can check they planned alike.
"""

from __future__ import annotations

import hashlib
import numbers
from typing import Optional, Sequence

import numpy as np
import torch

from hisparse_triton.config import EngineConfig
from hisparse_triton.groups import PlanGroups
from hisparse_triton.layout import underlying_layer_name
from hisparse_triton.memory import check_fraction
from hisparse_triton.specs import KVCacheConfig
from hisparse_triton.worker import shared_pool

__all__ = ["BACKENDS", "check_draft_layers", "check_options", "parse_device", "plan_fingerprint"]

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
    if parsed.type == "cpu" and parsed.index not in (None, 0):
        raise ValueError(f"device {device!r}: there is one CPU device; use 'cpu' (or "
                         f"'cpu:0').")
    if parsed.type == "cpu":
        parsed = torch.device("cpu")
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
                   host_ram_fraction: float, host_pool_secret: object = None,
                   host_pool_group: object = None) -> tuple[int, int]:
    """``ValueError`` naming the first bad constructor argument; returns ``(max_num_seqs,
    tp_rank)`` as ints (numpy integers are accepted wherever an int is)."""
    if not isinstance(config, EngineConfig) or config.hisparse is None:
        raise ValueError("HiSparseWorker needs an EngineConfig with hisparse set.")
    if not _is_int(max_num_seqs) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be an int >= 1, got {max_num_seqs!r}.")
    shared = bool(kv_cache_config.hisparse_shared_host_pool)
    if not _is_int(tp_rank) or tp_rank < 0:
        raise ValueError(f"tp_rank must be an int >= 0, got {tp_rank!r}.")
    max_num_seqs, tp_rank = int(max_num_seqs), int(tp_rank)
    if tp_rank >= config.tensor_parallel_size:
        raise ValueError(f"tp_rank {tp_rank} must be < tensor_parallel_size="
                         f"{config.tensor_parallel_size}.")
    if shared and host_pool_name is None:
        raise ValueError("kv_cache_config.hisparse_shared_host_pool is True (one host pool "
                         "shared by the TP ranks of the node): pass host_pool_name (the "
                         "same on every rank; tp_rank 0 creates the pool).")
    if not shared:
        for name, value in (("host_pool_name", host_pool_name),
                            ("host_pool_secret", host_pool_secret),
                            ("host_pool_group", host_pool_group)):
            if value is not None:
                raise ValueError(f"{name}={value!r} was given but "
                                 f"kv_cache_config.hisparse_shared_host_pool is False (each "
                                 f"rank owns a private host pool); plan with "
                                 f"shared_host_pool=True or drop {name}.")
    else:
        if tp_rank > 0 and host_pool_secret is None:
            raise ValueError(f"tp_rank {tp_rank} attaches to the shared host pool "
                             f"{host_pool_name!r}: pass host_pool_secret, the creating rank's "
                             f"(tp_rank 0's worker.host_pool_secret; e.g. "
                             f"hisparse_triton.distributed.broadcast_host_pool_secret).")
        if host_pool_secret is not None:
            shared_pool.check_secret(host_pool_secret)
        shared_pool.group_id(host_pool_group)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    check_fraction(host_ram_fraction, "host_ram_fraction")
    return max_num_seqs, tp_rank


def _is_int(value: object) -> bool:
    """An int or a numpy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_draft_layers(names: Sequence[str], groups: PlanGroups) -> frozenset[str]:
    """``names`` (model or group-layer names) as source layer names; ``ValueError`` for a
    string or for a name that is not a sparse (source) layer of the plan."""
    if isinstance(names, str):
        raise ValueError(f"draft_layers must be a sequence of layer names, got the "
                         f"string {names!r}.")
    found = set()
    for name in names:
        layer = underlying_layer_name(name)
        if layer not in groups.source_layers:
            raise ValueError(f"draft layer {name!r} is not a sparse (source) layer of this "
                             f"plan: only layers whose KV the host pool holds are "
                             f"mirrored.")
        found.add(layer)
    return frozenset(found)
