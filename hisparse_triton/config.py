"""User-facing configuration: ``HiSparseConfig`` and ``EngineConfig``, validated on construction."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Optional

from hisparse_triton.tuning import MAX_RESOLVE_WIDTH  # torch-free

#: Largest hot buffer (rows per request): the widest top-k row the resolve kernel resolves
#: (``MAX_RESOLVE_WIDTH``; a speculative step resolves up to ``device_buffer_size`` columns).
MAX_DEVICE_BUFFER_SIZE = MAX_RESOLVE_WIDTH

#: Resident pages a request keeps on the GPU at steady state (the page being written and
#: the one before it).
ACTIVE_TAIL_PAGES = 2

#: Bytes in one GiB.
GIB = 1 << 30


#: Largest ``host_pool_gib`` (1 PiB): far above any machine, and its bytes fit an int64.
MAX_HOST_POOL_GIB = 1 << 20


def _check_int(owner: object, name: str, value: object, minimum: int) -> None:
    """``ValueError`` unless ``owner.name`` is an int >= ``minimum`` (a numpy integer too:
    it is stored as an int); ``owner`` is the frozen dataclass being checked."""
    kind = type(owner).__name__
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{kind}.{name} must be an int >= {minimum}, got {value!r}.")
    object.__setattr__(owner, name, int(value))


@dataclass(frozen=True)
class HiSparseConfig:
    """HiSparse settings; constructing one enables HiSparse.

    - ``index_topk``: rows the indexer selects per query (2048 on DeepSeek-V3.2 / GLM-5).
    - ``device_buffer_size``: hot-buffer rows per request; default
      ``(max_decode_query_len + 1) * index_topk``; must lie in
      ``[max_decode_query_len * index_topk, 32768]``.
    - ``host_pool_gib``: size of the pinned host pool (required, in
      ``(0, MAX_HOST_POOL_GIB]``).
    - ``max_decode_query_len``: query tokens per request per decode step.
    - ``shared_host_pool``: one host pool for all tensor-parallel ranks of a node;
      ``None`` means auto, see ``EngineConfig.shared_host_pool``.
    - ``prefill_staging_rows``: where ``resolve_prefill`` copies the host-only rows a
      prefill chunk references (``hisparse_triton.staging``). ``0`` (the default): nothing
      is reserved; free device blocks are lent for the step that needs them
      (``HiSparseScheduler.borrow_prefill_staging``; the facade borrows what each chunk
      can need). ``N > 0``: a region that holds ``N`` rows, the last
      ``cdiv(N, block_size)`` blocks of the device pool, kept out of allocation.
    """

    index_topk: int = 2048
    device_buffer_size: Optional[int] = None
    host_pool_gib: Optional[float] = None
    max_decode_query_len: int = 1
    shared_host_pool: Optional[bool] = None
    prefill_staging_rows: int = 0

    def __post_init__(self) -> None:
        _check_int(self, "index_topk", self.index_topk, 1)
        _check_int(self, "prefill_staging_rows", self.prefill_staging_rows, 0)
        _check_int(self, "max_decode_query_len", self.max_decode_query_len, 1)
        needed = self.max_decode_query_len * self.index_topk
        defaulted = self.device_buffer_size is None
        if defaulted:
            object.__setattr__(self, "device_buffer_size",
                               (self.max_decode_query_len + 1) * self.index_topk)
        else:
            _check_int(self, "device_buffer_size", self.device_buffer_size, 1)
        size = self.device_buffer_size
        if size < needed:
            raise ValueError(
                f"HiSparseConfig.device_buffer_size={size} is smaller than "
                f"max_decode_query_len * index_topk = {needed}; one step's top-k must fit.")
        if size > MAX_DEVICE_BUFFER_SIZE:
            origin = (" (the default, (max_decode_query_len + 1) * index_topk; set "
                      "device_buffer_size explicitly)" if defaulted else "")
            raise ValueError(f"HiSparseConfig.device_buffer_size={size}{origin} exceeds the "
                             f"maximum of {MAX_DEVICE_BUFFER_SIZE} (the resolve kernel's "
                             f"widest row, MAX_RESOLVE_WIDTH).")
        if self.host_pool_gib is None:
            raise ValueError("HiSparseConfig.host_pool_gib is required when HiSparse is "
                             "enabled (the size of the pinned host pool in GiB).")
        gib = self.host_pool_gib
        if (isinstance(gib, bool) or not isinstance(gib, numbers.Real)
                or not 0 < gib <= MAX_HOST_POOL_GIB):   # (NaN and infinities fail it too)
            text = repr(gib)
            text = text if len(text) <= 40 else f"{text[:20]}...({len(text)} digits)"
            raise ValueError(f"HiSparseConfig.host_pool_gib must be a finite number in "
                             f"(0, {MAX_HOST_POOL_GIB}] (GiB), got {text}.")
        object.__setattr__(self, "host_pool_gib", int(gib) if isinstance(gib, numbers.Integral)
                           else float(gib))
        if self.shared_host_pool is not None and not isinstance(self.shared_host_pool, bool):
            raise ValueError(f"HiSparseConfig.shared_host_pool must be True, False or None, "
                             f"got {self.shared_host_pool!r}.")

    @property
    def host_pool_bytes(self) -> int:
        """``host_pool_gib`` in bytes (rounded down)."""
        return int(self.host_pool_gib * GIB)


@dataclass(frozen=True)
class EngineConfig:
    """The serving engine's settings the planner needs.

    - ``max_model_len``: tokens per request at most.
    - ``hisparse``: HiSparse settings, or ``None`` (HiSparse off).
    - ``num_gpu_blocks_override``: device pool blocks, instead of what the memory allows.
    - ``tensor_parallel_size``, ``pipeline_parallel_size``: ranks per stage and stages;
      ``num_nodes``: machines the engine's ranks span.
    - ``max_num_batched_tokens``: tokens the engine schedules per step over all requests
      (vLLM's scheduler budget); ``None`` means a whole prompt may run in one step. It caps
      what one request has in flight, which is what a resident or sliding-window group must
      hold at admission.
    - ``max_concurrent_batches``: steps the engine keeps in flight at once (vLLM's
      ``VllmConfig.max_concurrent_batches``: 1 when each step finishes before the next is
      scheduled, 2 with async scheduling, the pipeline depth with pipeline parallelism).
      Every in-flight step may hold ``max_num_batched_tokens`` tokens of a request that are
      scheduled but not yet committed, so the admission window is
      ``max_concurrent_batches * max_num_batched_tokens`` (see ``in_flight_tokens``).
    """

    max_model_len: int
    hisparse: Optional[HiSparseConfig] = None
    num_gpu_blocks_override: Optional[int] = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    num_nodes: int = 1
    max_num_batched_tokens: Optional[int] = None
    max_concurrent_batches: int = 1

    def __post_init__(self) -> None:
        _check_int(self, "max_model_len", self.max_model_len, 1)
        _check_int(self, "tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_int(self, "pipeline_parallel_size", self.pipeline_parallel_size, 1)
        _check_int(self, "num_nodes", self.num_nodes, 1)
        if self.num_gpu_blocks_override is not None:
            _check_int(self, "num_gpu_blocks_override",
                       self.num_gpu_blocks_override, 1)
        if self.max_num_batched_tokens is not None:
            _check_int(self, "max_num_batched_tokens",
                       self.max_num_batched_tokens, 1)
        _check_int(self, "max_concurrent_batches", self.max_concurrent_batches, 1)
        if self.hisparse is not None and not isinstance(self.hisparse, HiSparseConfig):
            raise TypeError(f"EngineConfig.hisparse must be a HiSparseConfig or None, "
                            f"got {type(self.hisparse).__name__}.")
        if self.hisparse is not None and self.hisparse.shared_host_pool and \
                not self._one_node_one_stage:
            raise ValueError(
                f"HiSparseConfig.shared_host_pool=True needs every rank on one node and no "
                f"pipeline parallelism (one host pool serves the tensor-parallel ranks of one "
                f"node), but num_nodes={self.num_nodes} and pipeline_parallel_size="
                f"{self.pipeline_parallel_size}; leave shared_host_pool unset (auto) or False.")

    @property
    def _one_node_one_stage(self) -> bool:
        return self.num_nodes == 1 and self.pipeline_parallel_size == 1

    @property
    def shared_host_pool(self) -> bool:
        """Whether the host pool is shared by the TP ranks of one node.

        Auto (``HiSparseConfig.shared_host_pool=None``): on when ``tensor_parallel_size > 1``
        and every rank sits on one node with no pipeline parallelism (``num_nodes == 1``,
        ``pipeline_parallel_size == 1``): the sparse-MLA KV is then identical on every rank
        and one ``/dev/shm`` pool serves them all.
        """
        if self.hisparse is None:
            return False
        if self.hisparse.shared_host_pool is not None:
            return self.hisparse.shared_host_pool
        return self.tensor_parallel_size > 1 and self._one_node_one_stage

    @property
    def in_flight_tokens(self) -> int:
        """Tokens of one request that can be scheduled but not yet committed:
        ``min(max_concurrent_batches * max_num_batched_tokens, max_model_len)``, or
        ``max_model_len`` when ``max_num_batched_tokens`` is unset (a whole prompt in one
        step)."""
        if self.max_num_batched_tokens is None:
            return self.max_model_len
        return min(self.max_concurrent_batches * self.max_num_batched_tokens,
                   self.max_model_len)
