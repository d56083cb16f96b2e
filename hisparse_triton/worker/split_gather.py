"""Tensor-parallel ranks that split a step's gathers (``HiSparseWorker(split_gather=True)``).

With tensor parallelism the MLA KV is the same on every rank: every rank resolves the same
top-k against the same tables, so every rank's miss plan (``src_rows``, ``dst_rows`` ``[R,
K]``, ``counts [R]``, misses first in each row) is the same and, without this, every rank
pulls the SAME missed rows over its own PCIe link. With ``N`` ranks splitting, rank ``q``
pulls only its share of the misses from the host pool into a device staging buffer, the ranks
exchange their staging buffers over the stack's ``torch.distributed`` group (``all_gather``:
NCCL on GPUs, gloo on CPU) and every rank copies all ``N`` shares into its hot rows, so every
rank ends with identical hot buffers.

Layout. The plan's rows are cut into ``chunks`` chunks of ``rpc = ceil(R / chunks)`` rows
(fewer chunks when that would leave a chunk under ``MIN_CHUNK_ROWS`` rows).
Miss column ``j`` of row ``r`` belongs to rank ``j % N`` as that rank's column ``t = j //
N``; in a chunk, rank ``q``'s columns are packed densely, row after row: column ``t`` of row
``r`` takes staging row ``slot = excl[q, r] + t``, ``excl[q, r]`` the rank's columns in the
chunk's earlier rows. Each rank's staging buffer holds ``P`` rows per chunk (the capacity,
``split_capacity.capacity_rows``: ``ceil(fraction x rpc x K / N)``), so the exchange carries
``N x P`` rows per chunk, pooled over the chunk's rows: a row with many misses uses the
slots a row with few leaves. A miss whose slot is ``>= P`` is not exchanged: every rank
pulls it itself (the overflow pass), so every row is exact whatever the step's miss count.

Per call: a few whole-tensor ops that build the plan on the device (``_plan``; no host
sync), then per chunk one pull launch (host -> staging, 1/N of the chunk's misses), the
chunk's ``all_gather`` started asynchronously, so the pull of chunk ``i + 1`` runs while
chunk ``i`` is exchanged, then the overflow pass (every rank, also under the exchanges),
then per chunk a wait for its exchange and one copy launch (staging -> hot rows).

The capacity: ``fraction`` fixed (``split_gather_fraction`` a number), or ``"auto"``: it
starts at ``SPLIT_START_FRACTION`` and follows the observed miss fraction with a headroom
(``split_capacity``). Each exchange counts on the device, per call, the misses, the rows
past its capacity, the bytes it exchanged, and the plan's columns; ``on_plan`` (called by
the worker in each ``apply``) reads them every ``SPLIT_RETUNE_PLANS`` plans from a copy
made that many plans earlier (so the read never waits for the device), agreed over the group
(an ``all_reduce``), and retunes. A new capacity is a new exchange shape (its buffers are
kept: a CUDA graph captured at a capacity keeps using that one and stays exact). A capture
builds no exchange: it takes the one the last eager call of the shape used (the warm-up's),
so a retune between the warm-up and the capture changes eager calls only.

The host pool must hold the same rows on every rank (a shared host pool, or private pools
every rank mirrors). ``all_gather`` is a collective: every rank of the group resolves the
same index groups in the same order, as tensor-parallel ranks do, and applies the same plans.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch

from hisparse_triton.row_table import RowTable
from hisparse_triton.worker.split_capacity import (
    MIN_CHUNK_ROWS, SPLIT_CHUNKS, SPLIT_HEADROOM, SPLIT_RETUNE_PLANS, SPLIT_START_FRACTION,
    capacity_rows, check_fraction, chunk_rows, retune)

__all__ = ["SplitGather", "SplitStats", "build_exchange", "split_plan_reference"]

#: Entries of an exchange's device tally / accumulator (int64): misses (rows), rows past the
#: capacity (pulled by every rank), bytes received from the other ranks, calls, plan columns.
_MISSES, _OVERFLOW, _RECEIVED, _CALLS, _COLUMNS = range(5)


@dataclass(frozen=True)
class SplitStats:
    """What a rank's split gathers did (``SplitGather.stats()``), since it was built.

    - ``calls``: gathers; ``plan_columns``: their plans' ``R x K`` columns;
    - ``misses`` / ``miss_bytes``: missed rows (and their bytes over all the group's layers)
      that reached the hot buffers;
    - ``overflow_rows`` / ``overflow_bytes``: misses past the capacity, pulled by every rank;
    - ``exchange_bytes``: bytes this rank received from the other ranks (``(N - 1) x P``
      rows per chunk and call, whatever the misses);
    - ``pcie_bytes``: bytes this rank pulled over its host link (its share of the exchanged
      misses, ``(misses - overflow) / N``, plus every overflow row);
    - ``fraction``: the capacity fraction in force now.
    """

    calls: int
    plan_columns: int
    misses: int
    miss_bytes: int
    overflow_rows: int
    overflow_bytes: int
    exchange_bytes: int
    pcie_bytes: float
    fraction: float

    @property
    def miss_fraction(self) -> float:
        """``misses / plan_columns`` (0.0 before any call)."""
        return self.misses / self.plan_columns if self.plan_columns else 0.0

    @property
    def exchange_per_miss(self) -> float:
        """Bytes received per missed byte (``exchange_bytes / miss_bytes``; 0.0 without
        misses). A capacity equal to the misses gives ``(N - 1) / N``."""
        return self.exchange_bytes / self.miss_bytes if self.miss_bytes else 0.0


class _Chunk(NamedTuple):
    """One chunk of an exchange: rows ``[r0, r1)`` of the plan and its buffers."""

    r0: int
    r1: int
    staging: torch.Tensor          # [P, L, row_bytes] uint8: this rank's share, slot-major
    gathered: torch.Tensor         # [N, P, L, row_bytes] uint8: every rank's share
    parts: list                    # N views of ``gathered``, one per rank
    staging_table: RowTable        # P rows per layer over ``staging``
    gathered_table: RowTable       # N * P rows per layer: rank q's slot s is q * P + s


class _Exchange(NamedTuple):
    """The persistent buffers of one ``(R, K, layers, row_bytes, P)`` shape."""

    chunks: list                   # [_Chunk]
    capacity: int                  # P: staging rows per rank and chunk
    rows_per_chunk: int            # rpc
    share: torch.Tensor            # [N, n * rpc] int32: rank q's miss columns of row r
    incl: torch.Tensor             # [N, n, rpc] int32: inclusive prefix sums per chunk
    excl: torch.Tensor             # [N, n, rpc] int32: exclusive prefix sums per chunk
    slots: torch.Tensor            # [R, T, N] int32: staging row of (r, j = t * N + q)
    spilled: torch.Tensor          # [R, T, N] bool: slot >= P (pulled by every rank)
    unpack: torch.Tensor           # [R, T, N] int32: gathered row of (r, j)
    unpack_dst: torch.Tensor       # [R, K] int32: dst of exchanged misses, -1 if spilled
    overflow_dst: Optional[torch.Tensor]  # [R, K] int32: dst of spilled misses, else -1
    minus_one: torch.Tensor        # [] int32: -1
    over: torch.Tensor             # [N, n] int32 scratch: rows past P per rank and chunk
    offsets: torch.Tensor          # [N, 1] int32: N - 1 - q
    columns: torch.Tensor          # [1, T, 1] int32: t
    bases: torch.Tensor            # [N] int32: q * P
    tally: torch.Tensor            # [5] int64: this call's counts (constants prefilled)
    acc: torch.Tensor              # [5] int64: the sums over calls
    row_bytes: int                 # bytes of one row over the table's layers


class SplitGather:
    """One rank's part of a split gather (module docstring).

    ``group``: the tensor-parallel ranks' process group (None: the default group);
    ``device``: the worker's device; ``copy``: ``copy_rows(dst, src, src_ids, dst_ids,
    counts)`` (the worker's backend); ``fraction``: ``"auto"`` or a capacity fraction in
    ``(0, 1]``; ``chunks``: pipeline chunks (>= 1); ``headroom``: ``"auto"``'s headroom over
    the observed miss fraction; ``period``: plans between two retunes (``"auto"``);
    ``min_chunk_rows``: the fewest plan rows per chunk.
    ``rank`` / ``world_size``: this rank's place in ``group``."""

    def __init__(self, group: Any, device: torch.device, copy: Callable[..., None], *,
                 fraction: "float | str" = "auto", chunks: int = SPLIT_CHUNKS,
                 headroom: float = SPLIT_HEADROOM, period: int = SPLIT_RETUNE_PLANS,
                 min_chunk_rows: int = MIN_CHUNK_ROWS) -> None:
        import torch.distributed as dist

        fraction = check_fraction(fraction)
        if isinstance(chunks, bool) or not isinstance(chunks, int) or not 1 <= chunks <= 64:
            raise ValueError(f"split_gather_chunks must be an int in [1, 64], got {chunks!r}.")
        if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) \
                or not 0.0 <= headroom <= 10.0:
            raise ValueError(f"split gather headroom must be in [0, 10], got {headroom!r}.")
        from hisparse_triton.worker.tables import STAGING_SLOTS

        if isinstance(period, bool) or not isinstance(period, int) or period <= STAGING_SLOTS:
            raise ValueError(f"split gather period must be an int > {STAGING_SLOTS} (the plan "
                             f"staging ring), got {period!r}.")
        if isinstance(min_chunk_rows, bool) or not isinstance(min_chunk_rows, int) \
                or min_chunk_rows < 1:
            raise ValueError(f"min_chunk_rows must be an int >= 1, got {min_chunk_rows!r}.")
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("split_gather needs an initialised torch.distributed process "
                             "group (the tensor-parallel ranks').")
        #: Whether the capacity follows the observed miss fraction.
        self.auto = fraction == "auto"
        #: The capacity fraction in force (the next gather's).
        self.fraction = SPLIT_START_FRACTION if self.auto else float(fraction)
        self.chunks, self.headroom, self.period = chunks, float(headroom), period
        self.min_chunk_rows = min_chunk_rows
        self.group, self.device, self._copy = group, device, copy
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._exchanges: dict[tuple, _Exchange] = {}
        self._last: dict[tuple, _Exchange] = {}   # per plan shape: the last call's exchange
        self._last_step: Optional[int] = None
        self._pending: Optional[tuple] = None      # (host copy, event) of the last snapshot
        self._seen = [0] * 5                        # the sums read at the last retune
        self._host_bufs: list[torch.Tensor] = []

    # ---------------------------------------------------------------- buffers
    def _exchange(self, rows: int, cols: int, table: RowTable) -> _Exchange:
        """The exchange of a ``[rows, cols]`` plan over ``table``'s layers at the capacity in
        force, built on first use; while a CUDA graph is being captured, the one the last
        eager call of that shape used (a capture builds nothing: a retune between the
        warm-up and the capture does not change the captured capacity)."""
        shape = (rows, cols, table.num_layers, table.row_bytes)
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            found = self._last.get(shape)
            if found is not None:
                return found
        rpc, _ = chunk_rows(rows, self.chunks, self.min_chunk_rows)
        P = capacity_rows(rpc, cols, self.world_size, self.fraction)
        key = (*shape, P, rpc)
        found = self._exchanges.get(key)
        if found is None:
            found = self._exchanges[key] = build_exchange(
                rows, cols, table.num_layers, table.row_bytes, ranks=self.world_size,
                rows_per_chunk=rpc, capacity=P, device=self.device)
        self._last[shape] = found
        return found

    def staging_tables(self, rows: int, cols: int, table: RowTable) -> list[RowTable]:
        """The staging tables of a ``[rows, cols]`` plan over ``table``'s layers at the
        capacity in force (built on first use; to validate them up front)."""
        exchange = self._exchange(rows, cols, table)
        return [t for c in exchange.chunks for t in (c.staging_table, c.gathered_table)]

    # ---------------------------------------------------------------- the call
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
        T_q = len(range(q, cols, N))
        with torch.inference_mode(False), torch.no_grad():
            _plan(ex, counts, dst_rows, N)
            share = ex.share[q]
            works = []
            for c in ex.chunks:       # pull chunk c, then exchange it while c + 1 is pulled
                if T_q:
                    self._copy(c.staging_table, host_table, src_rows[c.r0:c.r1, q::N],
                               ex.slots[c.r0:c.r1, :T_q, q], share[c.r0:c.r1])
                works.append(dist.all_gather(c.parts, c.staging, group=self.group,
                                             async_op=True))
            if ex.overflow_dst is not None:   # misses past the capacity: every rank
                self._copy(device_table, host_table, src_rows, ex.overflow_dst, counts)
            unpack = ex.unpack.view(rows, -1)[:, :cols]
            for c, work in zip(ex.chunks, works):
                work.wait()
                self._copy(device_table, c.gathered_table, unpack[c.r0:c.r1],
                           ex.unpack_dst[c.r0:c.r1], counts[c.r0:c.r1])

    def set_programs_per_sm(self, programs_per_sm: int) -> None:
        """The grid budget of the pulls and copies (``split_copy``'s), when the copy takes
        one; between steps."""
        setter = getattr(self._copy, "set_programs_per_sm", None)
        if setter is not None:
            setter(programs_per_sm)

    # ---------------------------------------------------------------- capacity
    def on_plan(self, step: int) -> None:
        """When the worker applies plan ``step`` (every rank, same order; before its tables
        are written; a step seen before, e.g. retried after a refused plan, does nothing).
        With ``"auto"``,
        every ``period`` plans: snapshot the exchanges' device sums (agreed over the group:
        a collective), read the snapshot of ``period`` plans ago (long copied: no wait) and
        retune the capacity from the miss fraction of the calls between it and the snapshot
        before (the first: since the start)."""
        if not self.auto or (self._last_step is not None and step <= self._last_step):
            return
        self._last_step = step
        if step % self.period:
            return
        import torch.distributed as dist

        with torch.inference_mode(False), torch.no_grad():
            sums = torch.zeros(5, dtype=torch.int64, device=self.device)
            for ex in self._exchanges.values():
                sums += ex.acc
            dist.all_reduce(sums, op=dist.ReduceOp.MAX, group=self.group)
            host, event = self._snapshot(sums)
        previous, self._pending = self._pending, (host, event)
        if previous is None:
            return
        host, event = previous
        if event is not None:
            event.synchronize()   # copied `period` plans ago
        values = [int(v) for v in host.tolist()]
        seen, self._seen = self._seen, values
        columns = values[_COLUMNS] - seen[_COLUMNS]
        if columns > 0:
            miss = (values[_MISSES] - seen[_MISSES]) / columns
            self.fraction = retune(self.fraction, miss, self.headroom)

    def _snapshot(self, sums: torch.Tensor) -> tuple[torch.Tensor, Optional[object]]:
        """``sums`` copied to the host without waiting: a pinned buffer (two, alternating)
        and the copy's event on CUDA, a clone on the CPU."""
        if sums.device.type != "cuda":
            return sums.clone(), None
        if not self._host_bufs:
            self._host_bufs = [torch.empty(5, dtype=torch.int64, pin_memory=True)
                               for _ in range(2)]
        buf = self._host_bufs.pop(0)
        self._host_bufs.append(buf)
        buf.copy_(sums, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return buf, event

    def stats(self) -> SplitStats:
        """What the split gathers did so far (reads the device sums: a device sync on
        CUDA; call it between steps)."""
        totals = [0] * 5
        miss_bytes = overflow_bytes = 0
        for ex in self._exchanges.values():
            acc = [int(v) for v in ex.acc.tolist()]
            totals = [a + b for a, b in zip(totals, acc)]
            miss_bytes += acc[_MISSES] * ex.row_bytes
            overflow_bytes += acc[_OVERFLOW] * ex.row_bytes
        pcie = (miss_bytes - overflow_bytes) / self.world_size + overflow_bytes
        return SplitStats(calls=totals[_CALLS], plan_columns=totals[_COLUMNS],
                          misses=totals[_MISSES], miss_bytes=miss_bytes,
                          overflow_rows=totals[_OVERFLOW], overflow_bytes=overflow_bytes,
                          exchange_bytes=totals[_RECEIVED], pcie_bytes=pcie,
                          fraction=self.fraction)


def build_exchange(rows: int, cols: int, layers: int, row_bytes: int, *, ranks: int,
                   rows_per_chunk: int, capacity: int, device: torch.device) -> _Exchange:
    """The buffers of a split gather of ``[rows, cols]`` plans over ``layers`` layers of
    ``row_bytes`` rows, ``ranks`` ranks, chunks of ``rows_per_chunk`` rows (the last one
    shorter) and ``capacity`` staging rows per rank and chunk."""
    N, dev, P, rpc = ranks, device, capacity, rows_per_chunk
    n = -(-rows // rpc)
    L, rb, T = layers, row_bytes, -(-cols // N)
    slot_bytes = L * rb     # a slot holds the row of every layer: block size 1, so the
    share_bytes = P * slot_bytes   # copy kernel's constexprs never depend on P
    with torch.inference_mode(False), torch.no_grad():
        offsets = [layer * rb for layer in range(L)]
        parts = []
        for c in range(n):
            staging = torch.zeros(share_bytes, dtype=torch.uint8, device=dev)
            gathered = torch.zeros(N * share_bytes, dtype=torch.uint8, device=dev)
            parts.append(_Chunk(
                c * rpc, min(rows, (c + 1) * rpc), staging, gathered,
                list(gathered.chunk(N)),
                RowTable.build(staging, offsets, row_bytes=rb, block_size=1,
                               block_stride=slot_bytes, num_rows=P, device=dev),
                RowTable.build(gathered, offsets, row_bytes=rb, block_size=1,
                               block_stride=slot_bytes, num_rows=N * P, device=dev)))
        i32 = dict(dtype=torch.int32, device=dev)
        spills = P < rpc * T     # at full capacity no slot reaches P
        tally = torch.tensor([0, 0, (N - 1) * P * n * L * rb, 1, rows * cols],
                             dtype=torch.int64, device=dev)
        found = _Exchange(
            parts, P, rpc, torch.zeros(N, n * rpc, **i32),
            torch.zeros(N, n, rpc, **i32), torch.zeros(N, n, rpc, **i32),
            torch.zeros(rows, T, N, **i32),
            torch.zeros(rows, T, N, dtype=torch.bool, device=dev),
            torch.zeros(rows, T, N, **i32), torch.zeros(rows, cols, **i32),
            torch.zeros(rows, cols, **i32) if spills else None,
            torch.full((), -1, **i32),
            torch.zeros(N, n, **i32),
            (N - 1 - torch.arange(N, **i32)).view(N, 1),
            torch.arange(T, **i32).view(1, T, 1),
            torch.arange(N, **i32) * P, tally, torch.zeros_like(tally), L * rb)
    return found


def _plan(ex: _Exchange, counts: torch.Tensor, dst_rows: torch.Tensor, N: int) -> None:
    """The call's plan, on the device into ``ex``'s buffers (no host sync, no allocation):
    ``share[q, r]`` = ``ceil((counts[r] - q) / N)`` (at least 0), prefix sums per chunk,
    each column's staging slot, whether it spills past ``P``, its row in the gathered
    buffer, the destinations of the exchanged misses and of the overflow pass (each -1
    where the other copies: a copy skips a column whose destination is -1), and the
    tally."""
    rows, cols = dst_rows.shape
    n, rpc, P = len(ex.chunks), ex.rows_per_chunk, ex.capacity
    torch.add(counts[None, :], ex.offsets, out=ex.share[:, :rows])
    ex.share.floor_divide_(N)                          # the padding rows stay 0
    share = ex.share.view(N, n, rpc)
    torch.cumsum(share, dim=2, dtype=torch.int32, out=ex.incl)
    torch.sub(ex.incl, share, out=ex.excl)
    excl = ex.excl.view(N, n * rpc)[:, :rows].t()      # [R, N]
    torch.add(excl[:, None, :], ex.columns, out=ex.slots)
    torch.ge(ex.slots, P, out=ex.spilled)
    torch.add(ex.slots, ex.bases, out=ex.unpack)
    spilled = ex.spilled.view(rows, -1)[:, :cols]
    torch.where(spilled, ex.minus_one, dst_rows, out=ex.unpack_dst)
    if ex.overflow_dst is not None:
        torch.where(spilled, dst_rows, ex.minus_one, out=ex.overflow_dst)
    totals = ex.incl[:, :, -1]                          # [N, n] a rank's misses per chunk
    torch.sum(totals, dim=(0, 1), out=ex.tally[_MISSES])
    torch.sub(totals, P, out=ex.over)
    ex.over.clamp_(min=0)
    torch.sum(ex.over, dim=(0, 1), out=ex.tally[_OVERFLOW])
    ex.acc.add_(ex.tally)


def split_plan_reference(counts: list[int], cols: int, ranks: int, rows_per_chunk: int,
                         capacity: int) -> dict[tuple[int, int], tuple[int, int, bool]]:
    """The split plan written as loops (the definition ``_plan`` is tested against): for
    every miss ``(r, j)`` with ``j < counts[r]``, ``(rank, slot, spilled)``: the rank that
    pulls it (``j % ranks``), its staging row in its chunk (that rank's earlier misses in the
    chunk's earlier rows, then ``j // ranks``), and whether ``slot >= capacity``."""
    out = {}
    for q in range(ranks):
        used = 0
        for r, count in enumerate(counts):
            if r % rows_per_chunk == 0:
                used = 0
            mine = [j for j in range(min(count, cols)) if j % ranks == q]
            for t, j in enumerate(mine):
                out[(r, j)] = (q, used + t, used + t >= capacity)
            used += len(mine)
    return out
