"""The data a benchmark moves: pools, row / page plans, and a decode step of ``resolve``.

- ``make_pools``: a host pool (layer-major, pinned on CUDA) and a device pool (the layers one
  page apart inside each block, as the planner lays them out), both of random bytes.
- ``make_row_plans`` / ``make_page_plans``: rotations of plans shaped like ``resolve``'s miss
  plans (``[R, top_k] int32``, ``counts`` valid columns per row, ``-1`` after them), random
  distinct ids, disjoint across the rotation.
- ``ResolveWorkload``: a decode step in a prescribed steady state (see its docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hisparse_triton.benchmarks.settings import BLOCK_SIZE, TAIL_PAGES, min_seq_len
from hisparse_triton.row_table import RowTable


@dataclass
class Pools:
    """A host pool and a device pool of ``layers`` layers of ``num_rows`` rows each.

    Host: layer-major, layer ``l`` row ``g`` is flat row ``l * num_rows + g`` of ``host_flat``.
    Device: blocks outermost, the layers one page apart inside a block, so layer ``l`` row
    ``r`` is flat row ``(r // B) * L * B + l * B + r % B`` of ``device_flat``."""

    host: RowTable
    device: RowTable
    host_flat: torch.Tensor    # [L * N, row_bytes] uint8 view of the host pool
    device_flat: torch.Tensor  # [L * N, row_bytes] uint8 view of the device pool
    layers: int
    row_bytes: int
    num_rows: int

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.layers * self.row_bytes


def alloc_host(nbytes: int, device: torch.device) -> torch.Tensor:
    """``[nbytes] uint8`` host buffer, pinned when ``device`` is CUDA."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


def _fill_random(buffer: torch.Tensor, gen: torch.Generator) -> None:
    chunk = 256 << 20
    for start in range(0, buffer.numel(), chunk):
        n = min(chunk, buffer.numel() - start)
        buffer[start:start + n].copy_(torch.randint(0, 256, (n,), dtype=torch.uint8,
                                                    device=gen.device, generator=gen))


def make_pools(row_bytes: int, layers: int, num_rows: int, device: torch.device,
               seed: int = 0) -> Pools:
    """Pools of ``num_rows`` rows (rounded up to whole blocks) per layer, random bytes in both
    (never time on zeros)."""
    num_rows = -(-num_rows // BLOCK_SIZE) * BLOCK_SIZE
    nbytes = num_rows * layers * row_bytes
    gen = torch.Generator(device=device if device.type == "cuda" else "cpu").manual_seed(seed)
    host = alloc_host(nbytes, device)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    _fill_random(host, gen)
    _fill_random(dev, gen)
    page = BLOCK_SIZE * row_bytes
    host_table = RowTable.build(host, [l * num_rows * row_bytes for l in range(layers)],
                                row_bytes=row_bytes, block_size=BLOCK_SIZE, block_stride=page,
                                num_rows=num_rows, device=device)
    dev_table = RowTable.build(dev, [l * page for l in range(layers)], row_bytes=row_bytes,
                               block_size=BLOCK_SIZE, block_stride=layers * page,
                               num_rows=num_rows, device=device)
    return Pools(host=host_table, device=dev_table, host_flat=host.view(-1, row_bytes),
                 device_flat=dev.view(-1, row_bytes), layers=layers, row_bytes=row_bytes,
                 num_rows=num_rows)


def host_flat_rows(rows: torch.Tensor, layers: int, num_rows: int) -> torch.Tensor:
    """``[V, N]`` host row ids -> ``[V, layers * N] int64`` flat rows of every layer of
    ``Pools.host_flat`` (layer-major)."""
    rows = rows.to(torch.int64)
    base = torch.arange(layers, dtype=torch.int64, device=rows.device) * num_rows
    return (base[None, :, None] + rows[:, None, :]).reshape(rows.shape[0], -1)


def device_flat_rows(rows: torch.Tensor, layers: int) -> torch.Tensor:
    """``[V, N]`` device row ids -> ``[V, layers * N] int64`` flat rows of
    ``Pools.device_flat`` (same order as ``host_flat_rows``)."""
    rows = rows.to(torch.int64)[:, None, :]
    layer = torch.arange(layers, dtype=torch.int64, device=rows.device)[None, :, None]
    flat = (rows // BLOCK_SIZE) * layers * BLOCK_SIZE + layer * BLOCK_SIZE + rows % BLOCK_SIZE
    return flat.reshape(rows.shape[0], -1)


@dataclass
class RowPlans:
    """``variants`` rotated plans of ``rows`` valid entries in ``[R, top_k]`` shape.

    ``src``/``dst``: ``[V, R, K] int32`` (-1 past ``counts``), ``counts``: ``[V, R] int32``
    (``None`` for page plans), ``src_valid``/``dst_valid``: ``[V, rows] int64`` the valid ids
    in plan order (CPU)."""

    src: torch.Tensor
    dst: torch.Tensor
    counts: Optional[torch.Tensor]
    src_valid: torch.Tensor
    dst_valid: torch.Tensor

    @property
    def variants(self) -> int:
        return int(self.src.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.src.shape[1]), int(self.src.shape[2])


def plan_geometry(rows: int, top_k: int, miss_ratio: float) -> tuple[int, int, list[int]]:
    """``(R, K, counts)``: ``rows`` misses as batch rows of ``round(miss_ratio * K)`` each
    (at least 1), the last row taking the remainder; ``K = top_k``."""
    per_row = max(1, min(top_k, round(miss_ratio * top_k)))
    num = -(-rows // per_row)
    counts = [per_row] * num
    counts[-1] = rows - per_row * (num - 1)
    return num, top_k, counts


def plan_variants(pool_units: int, units: int, plan_bytes_each: int, max_plan_bytes: int) -> int:
    """How many disjoint plans of ``units`` fit a pool of ``pool_units`` and the plan budget."""
    return max(1, min(pool_units // max(units, 1), max_plan_bytes // max(plan_bytes_each, 1)))


def make_row_plans(rows: int, top_k: int, miss_ratio: float, src_rows_total: int,
                   dst_rows_total: int, device: torch.device, *, variants: int,
                   seed: int) -> RowPlans:
    """Random distinct source / destination rows, disjoint across the ``variants``."""
    num, width, counts = plan_geometry(rows, top_k, miss_ratio)
    gen = torch.Generator().manual_seed(seed)
    src_valid = torch.randperm(src_rows_total, generator=gen)[:variants * rows]
    dst_valid = torch.randperm(dst_rows_total, generator=gen)[:variants * rows]
    src_valid, dst_valid = src_valid.view(variants, rows), dst_valid.view(variants, rows)
    # Position of valid entry j in the flattened [R, K] plan.
    counts_t = torch.tensor(counts, dtype=torch.int64)
    row_of = torch.repeat_interleave(torch.arange(num), counts_t)
    starts = torch.cumsum(counts_t, 0) - counts_t
    col_of = torch.arange(rows) - starts[row_of]
    flat_pos = row_of * width + col_of
    src = torch.full((variants, num * width), -1, dtype=torch.int32)
    dst = torch.full((variants, num * width), -1, dtype=torch.int32)
    src[:, flat_pos] = src_valid.to(torch.int32)
    dst[:, flat_pos] = dst_valid.to(torch.int32)
    counts_v = torch.tensor(counts, dtype=torch.int32).expand(variants, num).contiguous()
    return RowPlans(src=src.view(variants, num, width).to(device),
                    dst=dst.view(variants, num, width).to(device),
                    counts=counts_v.to(device), src_valid=src_valid, dst_valid=dst_valid)


def make_page_plans(pages: int, src_blocks_total: int, dst_blocks_total: int,
                    device: torch.device, *, variants: int, seed: int) -> RowPlans:
    """``[V, 1, pages]`` block plans (no counts), disjoint across the variants."""
    gen = torch.Generator().manual_seed(seed)
    src_valid = torch.randperm(src_blocks_total, generator=gen)[:variants * pages]
    dst_valid = torch.randperm(dst_blocks_total, generator=gen)[:variants * pages]
    src_valid = src_valid.view(variants, pages)
    dst_valid = dst_valid.view(variants, pages)
    return RowPlans(src=src_valid.to(torch.int32).view(variants, 1, pages).to(device),
                    dst=dst_valid.to(torch.int32).view(variants, 1, pages).to(device),
                    counts=None, src_valid=src_valid, dst_valid=dst_valid)


class ResolveWorkload:
    """One decode step of ``resolve`` for ``batch`` requests, from a prescribed steady state.

    Every request has ``seq_len`` tokens: its last ``TAIL_PAGES`` pages resident on the
    device, the rest host-only, ``hot_slots`` hot-buffer slots. Warm-up (the torch reference,
    from empty hot buffers): ``ceil(hot_slots / top_k) + 1`` steps of random history positions,
    which fill every slot and leave an LRU order of real use. The state after warm-up
    (``slot_host_rows``, ``lru``) is snapshotted; ``restore()`` puts it back, so every timed
    call starts from the same state.

    The timed step's top-k (``topk``) keeps ``round((1 - miss_ratio) * top_k)`` positions of
    the last warm-up step (hits: they are in the hot buffer) and draws the others from history
    positions neither in the hot buffer nor in the resident tail (misses): the step's miss
    ratio is exactly ``expected_miss_ratio``, whatever the state's history.
    """

    def __init__(self, batch: int, top_k: int, hot_slots: int, seq_len: int, miss_ratio: float,
                 device: torch.device, *, seed: int = 0) -> None:
        if seq_len < min_seq_len(top_k, hot_slots):
            raise ValueError(f"ResolveWorkload: seq_len={seq_len} < "
                             f"{min_seq_len(top_k, hot_slots)} (hot_slots + top_k + the tail).")
        if hot_slots < top_k:
            raise ValueError(f"ResolveWorkload: hot_slots={hot_slots} < top_k={top_k}.")
        B = BLOCK_SIZE
        i32 = torch.int32
        self.batch, self.top_k, self.device = batch, top_k, device
        pages = -(-seq_len // B)
        hot_blocks = -(-hot_slots // B)
        tail = min(TAIL_PAGES, pages)
        gen = torch.Generator().manual_seed(seed)
        host_blocks = (1 + torch.arange(batch * pages, dtype=i32)).view(batch, pages)
        resident = torch.zeros(batch, pages, dtype=i32)
        resident[:, pages - tail:] = (1 + torch.arange(batch * tail, dtype=i32)).view(batch, tail)
        hot = (1 + batch * tail + torch.arange(batch * hot_blocks, dtype=i32)).view(batch,
                                                                                    hot_blocks)
        self.state_rows = torch.arange(batch, dtype=i32)
        self.seq_lens = torch.full((batch,), seq_len, dtype=i32)
        self.resident_blocks, self.host_blocks, self.hot_blocks = resident, host_blocks, hot
        self.slot_host_rows = torch.full((batch, hot_slots), -1, dtype=i32)
        self.lru = torch.arange(hot_slots, dtype=i32).expand(batch, hot_slots).contiguous()
        self.kwargs = {"block_size": B, "num_device_blocks": 1 + batch * (tail + hot_blocks),
                       "num_host_blocks": 1 + batch * pages}
        history = (pages - tail) * B  # positions [0, history) live on the host only
        history = min(history, seq_len)

        for name in ("state_rows", "seq_lens", "resident_blocks", "host_blocks", "hot_blocks",
                     "slot_host_rows", "lru"):
            setattr(self, name, getattr(self, name).to(device))

        from hisparse_triton.ops.resolve import reference

        last = torch.empty(0)
        for _ in range(-(-hot_slots // top_k) + 1):  # warm-up, on the device
            last = torch.rand(batch, history, generator=gen).topk(top_k, dim=1).indices
            reference.resolve(last.to(i32).to(device), *self._state(), **self.kwargs)
        keep = int(round((1 - miss_ratio) * top_k))
        kept = last.gather(1, torch.rand(batch, top_k, generator=gen).argsort(dim=1)[:, :keep])
        # Fresh positions: not in the hot buffer, not kept, not in the resident tail.
        slot_rows = self.slot_host_rows.cpu()
        in_hot = slot_rows >= 0
        hot_rows = slot_rows.clamp(min=0).long()
        hot_pos = ((hot_rows // B - 1) % pages) * B + hot_rows % B  # host_blocks' inverse
        taken = torch.zeros(batch, history + 1, dtype=torch.bool)
        taken.scatter_(1, torch.where(in_hot, hot_pos.clamp(max=history), history), True)
        taken[:, :history].scatter_(1, kept, True)
        scores = torch.rand(batch, history, generator=gen)
        scores[taken[:, :history]] = 2.0
        fresh = scores.topk(top_k - keep, dim=1, largest=False).indices
        step = torch.cat([kept, fresh], dim=1)
        step = step.gather(1, torch.rand(batch, top_k, generator=gen).argsort(dim=1))
        self.expected_miss_ratio = (top_k - keep) / top_k
        self.topk = step.to(i32).to(device)
        self._snapshot = (self.slot_host_rows.clone(), self.lru.clone())

    def _state(self) -> tuple[torch.Tensor, ...]:
        return (self.state_rows, self.seq_lens, self.resident_blocks, self.host_blocks,
                self.hot_blocks, self.slot_host_rows, self.lru)

    def restore(self) -> None:
        """Put the hot buffers back to the snapshot taken after warm-up (in stream order)."""
        self.slot_host_rows.copy_(self._snapshot[0])
        self.lru.copy_(self._snapshot[1])

    def args(self) -> tuple[torch.Tensor, ...]:
        """Positional arguments of ``ops.resolve`` / ``reference.resolve`` for the timed step
        (the state tensors are updated in place by the call)."""
        return (self.topk, *self._state())

    @property
    def state_bytes(self) -> int:
        """Bytes of hot-buffer state the step reads and writes (``slot_host_rows`` + ``lru``)."""
        return 2 * self.slot_host_rows.numel() * 4
