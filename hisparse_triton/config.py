"""User-facing configuration: ``HiSparseConfig`` and ``EngineConfig``, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

#: Largest hot buffer (rows per request) the resolve kernel is designed for.
MAX_DEVICE_BUFFER_SIZE = 32768

#: Resident pages a request keeps on the GPU at steady state (the page being written and
#: the one before it).
ACTIVE_TAIL_PAGES = 2

#: Bytes in one GiB.
GIB = 1 << 30


def _check_int(owner: str, name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an int >= {minimum}, got {value!r}.")


@dataclass(frozen=True)
class HiSparseConfig:
    """HiSparse settings; constructing one enables HiSparse.

    - ``index_topk``: rows the indexer selects per query (2048 on DeepSeek-V3.2 / GLM-5).
    - ``device_buffer_size``: hot-buffer rows per request; default
      ``(max_decode_query_len + 1) * index_topk``; must lie in
      ``[max_decode_query_len * index_topk, 32768]``.
    - ``host_pool_gib``: size of the pinned host pool (required, > 0).
    - ``max_decode_query_len``: query tokens per request per decode step.
    - ``shared_host_pool``: one host pool for all tensor-parallel ranks of a node;
      ``None`` means auto (on when ``tensor_parallel_size > 1``), see
      ``EngineConfig.shared_host_pool``.
    """

    index_topk: int = 2048
    device_buffer_size: Optional[int] = None
    host_pool_gib: Optional[float] = None
    max_decode_query_len: int = 1
    shared_host_pool: Optional[bool] = None

    def __post_init__(self) -> None:
        _check_int("HiSparseConfig", "index_topk", self.index_topk, 1)
        _check_int("HiSparseConfig", "max_decode_query_len", self.max_decode_query_len, 1)
        needed = self.max_decode_query_len * self.index_topk
        defaulted = self.device_buffer_size is None
        if defaulted:
            object.__setattr__(self, "device_buffer_size",
                               (self.max_decode_query_len + 1) * self.index_topk)
        else:
            _check_int("HiSparseConfig", "device_buffer_size", self.device_buffer_size, 1)
        size = self.device_buffer_size
        if size < needed:
            raise ValueError(
                f"HiSparseConfig.device_buffer_size={size} is smaller than "
                f"max_decode_query_len * index_topk = {needed}; one step's top-k must fit.")
        if size > MAX_DEVICE_BUFFER_SIZE:
            origin = (" (the default, (max_decode_query_len + 1) * index_topk; set "
                      "device_buffer_size explicitly)" if defaulted else "")
            raise ValueError(f"HiSparseConfig.device_buffer_size={size}{origin} exceeds the "
                             f"maximum of {MAX_DEVICE_BUFFER_SIZE}.")
        if self.host_pool_gib is None:
            raise ValueError("HiSparseConfig.host_pool_gib is required when HiSparse is "
                             "enabled (the size of the pinned host pool in GiB).")
        if (isinstance(self.host_pool_gib, bool)
                or not isinstance(self.host_pool_gib, (int, float))
                or not self.host_pool_gib > 0
                or (isinstance(self.host_pool_gib, float)
                    and not math.isfinite(self.host_pool_gib * GIB))):
            raise ValueError(f"HiSparseConfig.host_pool_gib must be a finite number > 0, "
                             f"got {self.host_pool_gib!r}.")
        if self.shared_host_pool is not None and not isinstance(self.shared_host_pool, bool):
            raise ValueError(f"HiSparseConfig.shared_host_pool must be True, False or None, "
                             f"got {self.shared_host_pool!r}.")

    @property
    def host_pool_bytes(self) -> int:
        """``host_pool_gib`` in bytes (rounded down)."""
        return int(self.host_pool_gib * GIB)


@dataclass(frozen=True)
class EngineConfig:
    """The serving engine's settings the planner needs."""

    max_model_len: int
    hisparse: Optional[HiSparseConfig] = None
    num_gpu_blocks_override: Optional[int] = None
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _check_int("EngineConfig", "max_model_len", self.max_model_len, 1)
        _check_int("EngineConfig", "tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.num_gpu_blocks_override is not None:
            _check_int("EngineConfig", "num_gpu_blocks_override",
                       self.num_gpu_blocks_override, 1)
        if self.hisparse is not None and not isinstance(self.hisparse, HiSparseConfig):
            raise TypeError(f"EngineConfig.hisparse must be a HiSparseConfig or None, "
                            f"got {type(self.hisparse).__name__}.")

    @property
    def shared_host_pool(self) -> bool:
        """Whether the host pool is shared by the TP ranks of one node (auto: TP > 1)."""
        if self.hisparse is None:
            return False
        if self.hisparse.shared_host_pool is not None:
            return self.hisparse.shared_host_pool
        return self.tensor_parallel_size > 1
