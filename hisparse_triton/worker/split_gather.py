"""Tensor-parallel ranks that split a step's gathers (``HiSparseWorker(split_gather=True)``).

With tensor parallelism the MLA KV is the same on every rank: every rank resolves the same
top-k against the same tables, so every rank's miss plan is the same and, without this,
every rank pulls the SAME missed rows over its own PCIe link. With ``N`` ranks splitting,
rank ``q`` gathers only the miss columns ``j`` with ``j % N == q`` (1/N of the rows) from
the host pool into a device staging buffer, the ranks exchange their staging buffers over
the stack's ``torch.distributed`` group (``all_gather``: NCCL on GPUs, gloo on CPU) and
every rank copies all ``N`` shares into its hot rows, so every rank ends with identical hot
buffers. Per index group and call: one gather launch (host -> staging), one
``all_gather``, one copy launch (staging -> hot rows), no host sync.

Shapes are fixed per ``[R, K]`` miss plan (the count is never read on the host), so the
exchange moves a fixed number of rows: ``C = ceil(fraction x K / N)`` columns per row and
rank (``fraction``: ``split_gather_fraction``, default 0.25). The first ``N x C`` miss
columns of a row are split (rank ``q`` pulls ``j % N == q``) and exchanged; a row with more
misses than that has its remaining columns (``j >= N x C``) pulled by every rank itself, as
without splitting, so the result is exact for any miss count. With ``fraction = 1`` every
miss column is split (the exchange then carries ``R x ceil(K / N)`` rows per rank). The
host pool
must hold the same rows on every rank (a shared host pool, or private pools every rank
mirrors). ``all_gather`` is a collective: every rank of the group resolves the same index
groups in the same order, as tensor-parallel ranks do.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch

from hisparse_triton.row_table import RowTable

__all__ = ["SplitGather"]


class _Exchange(NamedTuple):
    """The persistent buffers and plans of one ``(R, K, layers, row_bytes)`` shape."""

    staging: torch.Tensor          # [L * P * row_bytes] uint8: this rank's share
    chunks: list                   # N views of ``gathered``, one per rank
    staging_table: RowTable        # P rows per layer over ``staging``
    gathered_table: RowTable       # N * P rows per layer: rank q's row i is q * P + i
    pack_dst: torch.Tensor         # [R, T_rank] int32: r * T + t
    unpack_src: torch.Tensor       # [R, K] int32: (j % N) * P + r * T + j // N
    share_counts: torch.Tensor     # [R] int32 scratch: this rank's columns below counts[r]
    split_counts: torch.Tensor     # [R] int32 scratch: min(counts[r], split)
    rest_counts: torch.Tensor      # [R] int32 scratch: counts[r] - split, at least 0
    split: int                     # columns j < split are split over the ranks


class SplitGather:
    """One rank's part of a split gather (module docstring).

    ``group``: the tensor-parallel ranks' process group (None: the default group);
    ``device``: the worker's device; ``copy``: ``copy_rows(dst, src, src_ids, dst_ids,
    counts)`` (the worker's backend). ``rank`` / ``world_size``: this rank's place in
    ``group``."""

    def __init__(self, group: Any, device: torch.device, copy: Callable[..., None], *,
                 fraction: float = 0.25) -> None:
        import torch.distributed as dist

        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
                or not 0.0 < fraction <= 1.0:
            raise ValueError(f"split_gather_fraction must be in (0, 1], got {fraction!r}.")
        self.fraction = float(fraction)

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("split_gather needs an initialised torch.distributed process "
                             "group (the tensor-parallel ranks').")
        self.group, self.device, self._copy = group, device, copy
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._exchanges: dict[tuple, _Exchange] = {}

    def _exchange(self, rows: int, cols: int, table: RowTable) -> _Exchange:
        key = (rows, cols, table.num_layers, table.row_bytes)
        found = self._exchanges.get(key)
        if found is not None:
            return found
        N, q, dev = self.world_size, self.rank, self.device
        L, rb = table.num_layers, table.row_bytes
        T = self.columns(cols)                # a rank's split columns per row
        P = rows * T                          # staging rows per layer
        share = L * P * rb                    # bytes of one rank's staging buffer
        with torch.inference_mode(False), torch.no_grad():
            gathered = torch.zeros(N * share, dtype=torch.uint8, device=dev)
            staging = torch.zeros(share, dtype=torch.uint8, device=dev)
            offsets = [layer * P * rb for layer in range(L)]
            staging_table = RowTable.build(staging, offsets, row_bytes=rb, block_size=P,
                                           block_stride=share, num_rows=P, device=dev)
            gathered_table = RowTable.build(gathered, offsets, row_bytes=rb, block_size=P,
                                            block_stride=share, num_rows=N * P, device=dev)
            r = torch.arange(rows, dtype=torch.int32, device=dev)[:, None]
            split = min(cols, N * T)             # columns j < split are split
            t_rank = len(range(q, split, N))
            pack_dst = (r * T + torch.arange(t_rank, dtype=torch.int32, device=dev)).contiguous()
            j = torch.arange(split, dtype=torch.int32, device=dev)[None, :]
            unpack_src = ((j % N) * P + r * T + j // N).expand(rows, split).contiguous()
            found = _Exchange(staging, list(gathered.chunk(N)), staging_table, gathered_table,
                              pack_dst, unpack_src,
                              torch.zeros(rows, dtype=torch.int32, device=dev),
                              torch.zeros(rows, dtype=torch.int32, device=dev),
                              torch.zeros(rows, dtype=torch.int32, device=dev), split)
        self._exchanges[key] = found
        return found

    def columns(self, cols: int) -> int:
        """Split columns per row and rank of a ``K = cols`` plan: ``ceil(fraction x K /
        N)``, at least 1."""
        return max(1, math.ceil(self.fraction * cols / self.world_size - 1e-9))

    def staging_tables(self, rows: int, cols: int, table: RowTable) -> list[RowTable]:
        """The staging tables of a ``[rows, cols]`` plan over ``table``'s layers (built on
        first use; to validate them up front)."""
        exchange = self._exchange(rows, cols, table)
        return [exchange.staging_table, exchange.gathered_table]

    def gather(self, device_table: RowTable, host_table: RowTable, src_rows: torch.Tensor,
               dst_rows: torch.Tensor, counts: torch.Tensor) -> None:
        """``copy_rows(device_table, host_table, src_rows, dst_rows, counts)`` split over the
        ranks: ``src_rows`` / ``dst_rows`` ``[R, K] int32`` (the resolve's miss plan, misses
        first in each row), ``counts [R] int32``. A collective."""
        import torch.distributed as dist

        rows, cols = src_rows.shape[-2], src_rows.shape[-1]
        if rows == 0 or cols == 0:
            return
        N, q = self.world_size, self.rank
        ex = self._exchange(rows, cols, device_table)
        split = ex.split
        with torch.inference_mode(False), torch.no_grad():
            # the split columns j < split: this rank's j = q, q + N, ... below counts[r]
            # (ceil((min(count, split) - q) / N) of them), exchanged, then all copied in
            torch.clamp(counts, max=split, out=ex.split_counts)
            share = ex.share_counts
            torch.sub(ex.split_counts, q - N + 1, out=share)
            share.div_(N, rounding_mode="floor").clamp_(min=0)
            self._copy(ex.staging_table, host_table, src_rows[:, q:split:N], ex.pack_dst,
                       share)
            dist.all_gather(ex.chunks, ex.staging, group=self.group)
            self._copy(device_table, ex.gathered_table, ex.unpack_src,
                       dst_rows[:, :split], ex.split_counts)
            if split < cols:  # columns past the split: every rank pulls them itself
                torch.sub(counts, split, out=ex.rest_counts)
                ex.rest_counts.clamp_(min=0)
                self._copy(device_table, host_table, src_rows[:, split:], dst_rows[:, split:],
                           ex.rest_counts)
