"""Prefill staging on the worker: ``PrefillStager`` serves a prefill chunk's top-k rows.

A prefill chunk (``T`` query tokens, up to ``max_num_batched_tokens``) selects ``K`` rows per
token; under offload many of them live only in the host pool. ``PrefillStager.stage`` maps
one index group's ``[T, K]`` selections to rows of ``device_cache(layer)`` for the leader
and every follower:

- rows whose page still has a device block in the index group's resident group (dirty,
  pinned, or unpinned but not yet reused) are read in place;
- every other row is copied once (however many tokens select it) from the host pool into
  a staging row (``hisparse_triton.staging``: a region the scheduler never hands out, or
  blocks it lent for the step, ``staging_blocks``), for all of the group's layers in one
  gather launch.

Hot buffers and their LRU order are never read or written: prefill does not disturb what
the decode steps of the same requests hit. The plan is computed on the device (``ops``'
``stage_prefill``: four plan launches and one gather, no host sync) in a workspace
allocated once (``PrefillWorkspace``), shared by the index groups, whose calls run one after
another. Staged rows are valid until the next ``stage`` (any index group), rows read in
place until the next plan applied.

Overflow: a chunk that references more distinct host-only rows than there are staging rows
gets
-1 for the rows beyond it (never a read outside the pools). ``stage`` reports it without a
sync when the caller passes ``host_rows_bound`` (an upper bound it knows, e.g. from the
scheduler's block tables: ``hisparse_triton.staging.host_rows_bound``) that fits; otherwise
it reads the device count once and raises ``PrefillStagingError`` naming both numbers
(``check=False`` skips that read: the counts stay readable in ``counts``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from hisparse_triton.config import EngineConfig
from hisparse_triton.errors import PrefillStagingError
from hisparse_triton.specs import KVCacheConfig
from hisparse_triton.worker import hot_cache
from hisparse_triton.worker.placement import check_readable, on_device

from hisparse_triton.staging import PrefillStaging

if TYPE_CHECKING:  # pragma: no cover
    from hisparse_triton.ops import PrefillWorkspace
    from hisparse_triton.worker.hot_cache import HotCache

__all__ = ["PrefillStager", "check_prefill_args", "check_prefill_topk",
           "check_staging_blocks"]


def check_prefill_topk(topk: object, state_rows: object) -> None:
    """``ValueError`` unless ``topk`` is an integer ``[T, K]`` tensor (``K >= 1``) and
    ``state_rows`` an int32 ``[T]`` tensor."""
    if not isinstance(topk, torch.Tensor) or topk.dim() != 2:
        raise ValueError(f"topk must be a [tokens, k] tensor, got {type(topk).__name__} of "
                         f"shape {tuple(getattr(topk, 'shape', ()))}.")
    if topk.dtype.is_floating_point or topk.dtype.is_complex or topk.dtype == torch.bool:
        raise ValueError(f"topk must hold integer positions, got {topk.dtype}.")
    if topk.shape[1] < 1:
        raise ValueError(f"topk must have at least one column, got shape {tuple(topk.shape)}.")
    T = topk.shape[0]
    if (not isinstance(state_rows, torch.Tensor) or state_rows.dtype != torch.int32
            or tuple(state_rows.shape) != (T,)):
        raise ValueError(f"state_rows must be an int32 tensor [{T}] (one per query token), "
                         f"got {getattr(state_rows, 'dtype', type(state_rows).__name__)} of "
                         f"shape {tuple(getattr(state_rows, 'shape', ()))}.")


def check_prefill_args(state_rows: object, topk: object, host_rows_bound: object,
                       device: torch.device) -> Optional[int]:
    """Every argument check of ``PrefillStager.stage``: ``check_prefill_topk``, both
    tensors readable on ``device`` (there or on the CPU), ``host_rows_bound`` None or an int
    ``>= 0`` (returned). ``ValueError`` naming the bad value."""
    check_prefill_topk(topk, state_rows)
    bound = _check_bound(host_rows_bound)
    check_readable(state_rows, device, "state_rows")
    check_readable(topk, device, "topk")
    return bound


class PrefillStager:
    """The prefill staging of one worker (see the module docstring).

    - ``staging``: the plan's ``PrefillStaging`` (a reserved region, or none: staging
      blocks are lent per call, ``staging_blocks``);
    - ``num_host_rows``: rows of the host pool; ``num_device_blocks``: blocks of the device
      pool; ``device``: the worker's device; ``kernel``: ``"triton"`` or ``"torch"``.
    """

    def __init__(self, staging: PrefillStaging, *, num_host_rows: int, num_device_blocks: int,
                 device: torch.device, kernel: str) -> None:
        self.staging = staging
        self.num_device_blocks = num_device_blocks
        self.kernel = kernel
        self.device = device
        self._ops = hot_cache.load_ops()
        self.workspace: "PrefillWorkspace" = self._ops.PrefillWorkspace(
            device, num_host_rows=num_host_rows, capacity_rows=staging.capacity_rows,
            first_row=staging.first_row)
        self._lent: tuple[int, ...] = ()     # the blocks the workspace's map stages into

    @classmethod
    def for_plan(cls, kv_cache_config: KVCacheConfig, config: EngineConfig, *,
                 device: torch.device, kernel: str) -> "PrefillStager":
        """The stager of a worker built from ``kv_cache_config`` and ``config``: the region
        ``PrefillStaging.from_plan`` gives (the one the scheduler keeps out of allocation)."""
        staging = PrefillStaging.from_plan(kv_cache_config, config)
        return cls(staging, num_host_rows=kv_cache_config.hisparse_host_num_blocks
                   * staging.block_size, num_device_blocks=kv_cache_config.num_blocks,
                   device=device, kernel=kernel)

    @property
    def capacity_rows(self) -> int:
        """Distinct host-only rows the next call can stage (the region's, or the lent
        blocks' of the last call)."""
        return self.workspace.capacity_rows

    @property
    def counts(self) -> torch.Tensor:
        """``[2] int32`` on the device: rows the last call staged and rows it needed
        (``needed > capacity_rows``: it overflowed). A live view; reading it syncs."""
        return self.workspace.counts

    @property
    def nbytes(self) -> int:
        """Device bytes of the workspace (the staging rows themselves are in the pool)."""
        return self.workspace.nbytes

    def check(self, state_rows: object, topk: object, host_rows_bound: object,
              staging_blocks: object) -> tuple[Optional[int], Optional[tuple[int, ...]]]:
        """Every argument check of ``stage`` (``check_prefill_args``, ``staging_blocks``):
        ``(bound, blocks)``; ``ValueError`` naming the bad value."""
        bound = check_prefill_args(state_rows, topk, host_rows_bound, self.device)
        return bound, check_staging_blocks(staging_blocks, self.staging,
                                           self.num_device_blocks)

    def stage(self, cache: "HotCache", state_rows: torch.Tensor, topk: torch.Tensor, *,
              host_rows_bound: Optional[int] = None, check: bool = True,
              staging_blocks: object = None) -> torch.Tensor:
        """``[T, K] int32`` rows of ``cache``'s index group for ``topk [T, K]`` (any integer
        dtype; -1 and out-of-range positions are masked) of the tokens' ``state_rows [T]
        int32`` (-1 = padding); stages the host-only rows (see the module docstring) into
        the reserved region, or into the rows of ``staging_blocks`` (blocks the scheduler
        lent for the step: ``check_staging_blocks``). ``PrefillStagingError`` when the
        chunk needs more staging rows than there are (read on the device unless
        ``host_rows_bound <= capacity_rows``; not read with ``check=False``);
        ``ValueError`` for bad arguments. The output is the workspace's buffer,
        overwritten by the next call."""
        bound, blocks = self.check(state_rows, topk, host_rows_bound, staging_blocks)
        T, K = topk.shape
        state_rows = on_device(state_rows, self.device, "state_rows")
        topk = on_device(topk, self.device, "topk")
        if blocks is not None and blocks != self._lent:
            self._map(blocks)
        ws = self.workspace
        capacity = ws.capacity_rows
        plan = self._ops.stage_prefill(
            cache.device_table, cache.host_table, topk, state_rows, cache.seq_lens,
            cache.resident_table, cache.host_blocks, **cache.sizes,
            staging_first_row=ws.first_row, staging_rows=capacity, workspace=ws,
            backend=self.kernel)
        if not check or (bound is not None and bound <= capacity):
            return plan.rows          # proven to fit, or the caller reads the counts itself
        needed = int(plan.needed[0])
        if needed > capacity:
            raise PrefillStagingError(
                f"the prefill chunk ({T} tokens x {K} selections) references {needed} "
                f"distinct host-only rows but {self._where(capacity)}",
                resource="prefill staging rows", needed=needed, available=capacity)
        return plan.rows

    def _where(self, capacity: int) -> str:
        """The end of an overflow message: what holds the staging rows, and what helps."""
        if not self.staging.lent:
            return (f"the staging region holds {capacity} (prefill_staging_rows rounded up "
                    f"to whole blocks); raise HiSparseConfig.prefill_staging_rows or split "
                    f"the chunk.")
        if not capacity:
            return ("the staging region holds 0 and no staging_blocks were given: this plan "
                    "reserves no region (prefill_staging_rows=0), so borrow the rows for the "
                    "step (HiSparseScheduler.borrow_prefill_staging(rows), rows from "
                    "staging.scheduler_host_rows_bound) and pass the blocks as "
                    "staging_blocks, or set HiSparseConfig.prefill_staging_rows to reserve a "
                    "region.")
        return (f"the {len(self._lent)} staging_blocks lent for it hold {capacity}; borrow "
                f"at least that many rows (HiSparseScheduler.borrow_prefill_staging) and pass "
                f"every block it returns.")

    def _map(self, blocks: tuple[int, ...]) -> None:
        """Stage into the rows of ``blocks`` (in order) from now on."""
        B = self.staging.block_size
        rows = (torch.tensor(blocks, dtype=torch.int64)[:, None] * B
                + torch.arange(B, dtype=torch.int64)).flatten().to(torch.int32)
        self.workspace.map_staging(on_device(rows, self.device, "staging rows"))
        self._lent = blocks


def check_staging_blocks(blocks: object, staging: PrefillStaging,
                         num_device_blocks: int) -> Optional[tuple[int, ...]]:
    """``staging_blocks`` of a ``resolve_prefill`` as a tuple of block ids (``()`` for None
    on a plan without a region; None for None on a plan with one). ``ValueError`` unless a
    sequence (or 1-D integer tensor / array) of distinct ids in ``[1, num_device_blocks)``,
    given only when the plan reserves no region."""
    if blocks is None:
        return () if staging.lent else None
    if not staging.lent:
        raise ValueError(f"staging_blocks: this plan reserves a staging region of "
                         f"{staging.capacity_rows} rows (prefill_staging_rows), which "
                         f"resolve_prefill uses; pass none.")
    if isinstance(blocks, torch.Tensor):
        blocks = blocks.tolist() if blocks.dim() == 1 and not blocks.is_floating_point() \
            else None
    elif hasattr(blocks, "tolist") and not isinstance(blocks, (str, bytes)):
        blocks = blocks.tolist()
    if not isinstance(blocks, (list, tuple)) or not all(
            isinstance(b, int) and not isinstance(b, bool) for b in blocks):
        raise ValueError(f"staging_blocks must be a sequence of block ids (what "
                         f"HiSparseScheduler.borrow_prefill_staging returns), got "
                         f"{blocks!r}.")
    bad = [b for b in blocks if not 0 < b < num_device_blocks]
    if bad:
        raise ValueError(f"staging_blocks: block {bad[0]} is outside [1, {num_device_blocks}) "
                         f"of the device pool.")
    if len(set(blocks)) != len(blocks):
        raise ValueError(f"staging_blocks: a block is named twice in {list(blocks)}.")
    return tuple(blocks)


def _check_bound(bound: object) -> Optional[int]:
    if bound is None:
        return None
    if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
        raise ValueError(f"host_rows_bound must be None or an int >= 0, got {bound!r}.")
    return bound
