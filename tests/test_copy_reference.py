"""reference.copy_rows / copy_pages against a per-row Python oracle, byte for byte.

The builders here (``make_table``, ``random_plan``, ``naive_copy``) are also used by the kernel
tests (``test_gather_kernel.py``, ``test_backup_kernel.py``). Every pool is filled with random
bytes, so the bytes around, between and after the layers act as canaries: each test compares
the WHOLE destination pool with the oracle's, which only rewrites the intended rows.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from hisparse_triton.ops.copy import reference as ref
from hisparse_triton.row_table import RowTable

ROW_SIZES = (16, 132, 656, 1152)
HUGE = 2**31 - 1


def make_table(num_layers: int, row_bytes: int, num_blocks: int, *, block_size: int = 4,
               layout: str = "host", lead: int = 16, gap: int = 16,
               device: str | torch.device = "cpu", offsets_device=None,
               seed: int = 0) -> RowTable:
    """A table over a pool of random bytes with ``lead`` bytes before the layers, ``gap``
    bytes between layers (host) or after each block (device) and a tail after them.

    - ``layout="host"``: layer-major, each layer ``num_blocks`` contiguous pages;
    - ``layout="device"``: block-major, a block holds one page of every layer, then ``gap``.
    """
    page = block_size * row_bytes
    gen = torch.Generator().manual_seed(seed)
    if layout == "host":
        stride = page
        offsets = [lead + layer * (num_blocks * page + gap) for layer in range(num_layers)]
        size = lead + num_layers * (num_blocks * page + gap) + 24
    elif layout == "device":
        stride = num_layers * page + gap
        offsets = [lead + layer * page for layer in range(num_layers)]
        size = lead + num_blocks * stride + 24
    else:
        raise ValueError(layout)
    pool = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen).to(device)
    return RowTable.build(pool, offsets, row_bytes=row_bytes, block_size=block_size,
                          block_stride=stride, num_rows=num_blocks * block_size,
                          device=offsets_device if offsets_device is not None else device)


def with_pool(table: RowTable, pool: torch.Tensor) -> RowTable:
    """``table`` over another pool of the same size (e.g. a clone)."""
    return RowTable(pool=pool, layer_offsets=list(table.offsets), row_bytes=table.row_bytes,
                    block_size=table.block_size, block_stride=table.block_stride,
                    num_rows=table.num_rows, device=table.device)


def random_plan(num_layers: int, rows: int, cols: int, src_limit: int, dst_limit: int, *,
                mode: str = "shared", seed: int = 0, device="cpu",
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(src_ids, dst_ids, counts)``: sources anywhere in ``[-3, src_limit + 3)`` plus a few
    huge/negative ids; destinations distinct per layer, some out of range; partial counts.

    ``mode``: ``"shared"`` ``[R, K]``, ``"per_layer"`` ``[L, R, K]``, ``"expanded"`` a
    stride-0 ``[L, R, K]`` expand of one plan.
    """
    gen = torch.Generator().manual_seed(seed)
    layers = num_layers if mode == "per_layer" else 1
    assert dst_limit + 4 >= rows * cols, "too few destinations for distinct ids"
    src = torch.randint(-3, src_limit + 3, (layers, rows, cols), generator=gen)
    flat = src.view(-1)
    flat[torch.randint(0, flat.numel(), (2,), generator=gen)] = HUGE
    flat[torch.randint(0, flat.numel(), (1,), generator=gen)] = -HUGE - 1
    dst = torch.stack([torch.randperm(dst_limit + 4, generator=gen)[: rows * cols] - 2
                       for _ in range(layers)]).view(layers, rows, cols)
    counts = torch.randint(0, cols + 2, (rows,), generator=gen)
    counts[0] = cols  # at least one full row
    src, dst = src.int(), dst.int()
    if mode == "shared":
        src, dst = src[0], dst[0]
    elif mode == "expanded":
        src, dst = src.expand(num_layers, rows, cols), dst.expand(num_layers, rows, cols)
    return src.to(device), dst.to(device), counts.int().to(device)


def naive_copy(dst: RowTable, src: RowTable, src_ids: torch.Tensor, dst_ids: torch.Tensor,
               counts: Optional[torch.Tensor], *, pages: bool) -> torch.Tensor:
    """The contract spelled out one span at a time; returns the expected destination pool."""
    out = dst.pool.detach().cpu().clone()
    src_pool = src.pool.detach().cpu()
    span = dst.row_bytes * (dst.block_size if pages else 1)
    src_off, dst_off = src.layer_offsets.tolist(), dst.layer_offsets.tolist()

    def address(offset: int, table: RowTable, ident: int) -> int:
        if pages:
            return offset + ident * table.block_stride
        return offset + (ident // table.block_size) * table.block_stride \
            + (ident % table.block_size) * table.row_bytes

    src_limit = src.num_blocks if pages else src.num_rows
    dst_limit = dst.num_blocks if pages else dst.num_rows
    rows, cols = src_ids.shape[-2:]
    counts_list = counts.tolist() if counts is not None else [cols] * rows
    for layer in range(dst.num_layers):
        s_plan = (src_ids[layer] if src_ids.dim() == 3 else src_ids).tolist()
        d_plan = (dst_ids[layer] if dst_ids.dim() == 3 else dst_ids).tolist()
        for r in range(rows):
            for j in range(min(cols, max(0, counts_list[r]))):
                s, d = s_plan[r][j], d_plan[r][j]
                if not 0 <= d < dst_limit:
                    continue
                a = address(dst_off[layer], dst, d)
                if 0 <= s < src_limit:
                    b = address(src_off[layer], src, s)
                    out[a:a + span] = src_pool[b:b + span]
                else:
                    out[a:a + span] = 0
    return out


def run_copy(fn, dst: RowTable, src: RowTable, src_ids, dst_ids, counts,
             **kwargs) -> torch.Tensor:
    """Run a copy (reference, launcher or op) into a clone of ``dst``'s pool; return it."""
    out = dst.pool.clone()
    fn(with_pool(dst, out), src, src_ids, dst_ids, counts, **kwargs)
    return out


def run_reference(dst: RowTable, src: RowTable, src_ids, dst_ids, counts, *,
                  pages: bool) -> torch.Tensor:
    """The destination pool after ``reference.copy_rows`` / ``copy_pages``."""
    return run_copy(ref.copy_pages if pages else ref.copy_rows, dst, src, src_ids, dst_ids,
                    counts)


def assert_matches_reference(fn, dst: RowTable, src: RowTable, src_ids, dst_ids, counts, *,
                             pages: bool, **kwargs) -> None:
    """``fn`` leaves the whole destination pool exactly as the reference does (and the plan
    is not trivial: the reference changes something)."""
    expected = run_reference(dst, src, src_ids, dst_ids, counts, pages=pages)
    assert not torch.equal(expected, dst.pool), "the plan copies nothing"
    assert torch.equal(run_copy(fn, dst, src, src_ids, dst_ids, counts, **kwargs), expected)


@pytest.mark.parametrize("row_bytes", ROW_SIZES)
@pytest.mark.parametrize("num_layers", (1, 4))
@pytest.mark.parametrize("mode", ("shared", "per_layer", "expanded"))
def test_copy_rows_matches_oracle(row_bytes, num_layers, mode):
    src = make_table(num_layers, row_bytes, 6, layout="host", seed=1)
    dst = make_table(num_layers, row_bytes, 4, layout="device", seed=2)
    s, d, c = random_plan(num_layers, 3, 5, src.num_rows, dst.num_rows, mode=mode, seed=3)
    out = run_reference(dst, src, s, d, c, pages=False)
    expected = naive_copy(dst, src, s, d, c, pages=False)
    assert torch.equal(out, expected)
    assert not torch.equal(out, dst.pool), "the plan copied nothing"


@pytest.mark.parametrize("direction", ("restore", "spill"))
@pytest.mark.parametrize("num_layers", (1, 3))
@pytest.mark.parametrize("mode", ("shared", "per_layer"))
def test_copy_pages_matches_oracle(direction, num_layers, mode):
    host = make_table(num_layers, 132, 7, layout="host", seed=4)
    device = make_table(num_layers, 132, 6, layout="device", seed=5)
    src, dst = (host, device) if direction == "restore" else (device, host)
    s, d, c = random_plan(num_layers, 2, 3, src.num_blocks, dst.num_blocks, mode=mode, seed=6)
    out = run_reference(dst, src, s, d, c, pages=True)
    assert torch.equal(out, naive_copy(dst, src, s, d, c, pages=True))
    assert not torch.equal(out, dst.pool)


@pytest.mark.parametrize("lead", (1, 2, 4, 8))
def test_unaligned_offsets(lead):
    """Layer offsets that are only 1-, 2-, 4- or 8-byte aligned (narrower word views)."""
    src = make_table(2, 132, 5, layout="host", lead=lead, gap=lead, seed=7)
    dst = make_table(2, 132, 4, layout="device", lead=3 * lead, gap=lead, seed=8)
    s, d, c = random_plan(2, 3, 4, src.num_rows, dst.num_rows, mode="per_layer", seed=9)
    out = run_reference(dst, src, s, d, c, pages=False)
    assert torch.equal(out, naive_copy(dst, src, s, d, c, pages=False))


def test_counts_none_copies_every_column_and_zero_fills():
    src = make_table(2, 16, 2, seed=10)
    dst = make_table(2, 16, 3, layout="device", seed=11)
    s = torch.tensor([[0, 7, -1, HUGE]], dtype=torch.int32)
    d = torch.tensor([[11, 0, 5, 6]], dtype=torch.int32)
    out = run_reference(dst, src, s, d, None, pages=False)
    assert torch.equal(out, naive_copy(dst, src, s, d, None, pages=False))
    view = with_pool(dst, out).row_view(1).reshape(-1, 16)
    assert torch.equal(view[0], with_pool(src, src.pool).row_view(1).reshape(-1, 16)[7])
    assert int(view[5].abs().sum()) == 0 and int(view[6].abs().sum()) == 0


def test_same_pool_device_to_device():
    """src and dst tables over one pool (disjoint layers of one device pool)."""
    both = make_table(4, 656, 4, layout="device", seed=12)
    offsets = both.layer_offsets
    src = RowTable(both.pool, offsets[:2].clone(), 656, 4, both.block_stride, both.num_rows)
    dst = RowTable(both.pool, offsets[2:].clone(), 656, 4, both.block_stride, both.num_rows)
    s, d, c = random_plan(2, 2, 4, src.num_rows, dst.num_rows, seed=13)
    expected = naive_copy(dst, src, s, d, c, pages=False)
    ref.copy_rows(dst, src, s, d, c)
    assert torch.equal(both.pool, expected)


def test_empty_plan_is_a_no_op():
    src = make_table(1, 16, 2, seed=14)
    dst = make_table(1, 16, 2, seed=15)
    before = dst.pool.clone()
    ref.copy_rows(dst, src, torch.zeros(0, 3, dtype=torch.int32),
                  torch.zeros(0, 3, dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
    ref.copy_pages(dst, src, torch.zeros(2, 0, dtype=torch.int32),
                   torch.zeros(2, 0, dtype=torch.int32))
    assert torch.equal(dst.pool, before)


def _bad_cases():
    src = make_table(2, 16, 2, seed=16)
    dst = make_table(2, 16, 2, seed=17)
    ok = torch.zeros(1, 2, dtype=torch.int32)
    other_rows = make_table(2, 32, 2, seed=18)
    other_layers = make_table(3, 16, 2, seed=19)
    other_block = make_table(2, 16, 1, block_size=8, seed=20)
    return [
        ("layers", dict(dst=other_layers, src=src, s=ok, d=ok, c=None)),
        ("row_bytes", dict(dst=other_rows, src=src, s=ok, d=ok, c=None)),
        ("int32", dict(dst=dst, src=src, s=ok.long(), d=ok, c=None)),
        ("int32", dict(dst=dst, src=src, s=ok, d=ok[0], c=None)),
        ("layer dim", dict(dst=dst, src=src, s=torch.zeros(3, 1, 2, dtype=torch.int32), d=ok,
                           c=None)),
        ("same \\[R, K\\]", dict(dst=dst, src=src, s=ok, d=torch.zeros(1, 3, dtype=torch.int32),
                                 c=None)),
        ("counts", dict(dst=dst, src=src, s=ok, d=ok, c=torch.zeros(2, dtype=torch.int32))),
        ("counts", dict(dst=dst, src=src, s=ok, d=ok, c=torch.zeros(1, dtype=torch.int64))),
        ("block_size", dict(dst=other_block, src=src, s=ok, d=ok, c=None, pages=True)),
    ]


@pytest.mark.parametrize("match,case", _bad_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_bad_arguments_raise_and_change_nothing(match, case):
    pages = case.pop("pages", False)
    dst = case["dst"]
    before = dst.pool.clone()
    fn = ref.copy_pages if pages else ref.copy_rows
    with pytest.raises(ValueError, match=match):
        fn(dst, case["src"], case["s"], case["d"], case["c"])
    assert torch.equal(dst.pool, before)


def test_table_outside_its_pool_is_refused_at_construction():
    pool = torch.zeros(200, dtype=torch.uint8)
    with pytest.raises(ValueError, match="layer 1 at byte offset 192 spans 128 B"):
        RowTable(pool, torch.tensor([0, 192]), 16, 4, 64, 8)
    with pytest.raises(ValueError, match="layer 0 at byte offset -16"):
        RowTable(pool, [-16, 0], 16, 4, 64, 8)
    with pytest.raises(ValueError, match="1-D int64"):
        RowTable(pool, torch.tensor([0, 64], dtype=torch.int32), 16, 4, 64, 8)


def _aliased_offsets(kind: str, values: list[int]):
    """An offsets tensor the caller can still change behind the table's back, and how."""
    if kind == "inference":
        with torch.inference_mode():
            t = torch.tensor(values, dtype=torch.int64)

        def change(i, v):
            with torch.inference_mode():
                t[i] = v
        return t, change
    if kind == "numpy":
        import numpy as np

        arr = np.array(values, dtype=np.int64)
        t = torch.from_numpy(arr)

        def change(i, v):
            arr[i] = v  # no torch version counter sees this
        return t, change
    t = torch.tensor(values, dtype=torch.int64)

    def change(i, v):
        t[i] = v
    return t, change


@pytest.mark.parametrize("kind", ("plain", "inference", "numpy"))
def test_changing_the_callers_offsets_cannot_move_the_table(kind):
    """A table owns a copy of its offsets, checked by value once: a later in-place change of
    the caller's tensor (with or without a working version counter) or of ``layer_offsets``
    (a copy) changes nothing, so a copy can never be pointed outside the pool."""
    src = make_table(2, 16, 2, seed=21)
    base = make_table(2, 16, 2, seed=22)
    offsets, change = _aliased_offsets(kind, list(base.offsets))
    dst = RowTable(base.pool, offsets, 16, 4, base.block_stride, base.num_rows)
    plan = torch.tensor([[0, 1, 5, 7]], dtype=torch.int32)
    ref.copy_rows(dst, src, plan, plan)  # first use
    change(1, dst.pool.numel() - 8)       # would put layer 1 past the pool's end
    dst.layer_offsets[0] = 10**9          # a copy: no effect either
    assert dst.offsets == base.offsets
    expected = naive_copy(dst, src, plan, plan, None, pages=False)
    ref.copy_rows(dst, src, plan, plan)
    assert torch.equal(dst.pool, expected)


def test_table_is_immutable_and_build_matches_init():
    table = make_table(2, 16, 2, seed=23)
    with pytest.raises(AttributeError, match="immutable"):
        table.row_bytes = 32
    again = RowTable(table.pool, table.layer_offsets, 16, 4, table.block_stride, table.num_rows)
    assert again.offsets == table.offsets and again.alignment == table.alignment == 16
    assert again.device_offsets() is table.device_offsets()  # one shared private copy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pages", (False, True))
def test_host_to_cuda_and_back(pages):
    """CPU host pool, CUDA device pool, plans and offset tables on CUDA."""
    host = make_table(3, 656, 8, layout="host", seed=23, offsets_device="cuda")
    device = make_table(3, 656, 6, layout="device", seed=24, device="cuda")
    for src, dst in ((host, device), (device, host)):
        lim_s = src.num_blocks if pages else src.num_rows
        lim_d = dst.num_blocks if pages else dst.num_rows
        s, d, c = random_plan(3, 2, 3, lim_s, lim_d, mode="per_layer", seed=25, device="cuda")
        out = run_reference(dst, src, s, d, c, pages=pages)
        assert torch.equal(out.cpu(), naive_copy(dst, src, s, d, c, pages=pages))
