"""Row/page transfer benchmarks (DESIGN.md section 9).

    python -m pytest bench/bench_transfer.py            # CPU: pytest-benchmark
    python -m pytest bench/bench_transfer.py -k gpu     # GPU: triton.testing.do_bench

Not part of the default test run (``testpaths = ["tests"]``). Every figure is GB/s of payload
(``rows x layers x row_bytes``) with its ratio to two baselines measured in the same run
(printed at the end; on GPU also written to ``bench/results/transfer-<device>.json``):

- ``eager``: what one writes without this package: ``index_select`` of the rows out of the
  source pool (pinned host memory for H2D), one copy across the link, ``index_copy_`` into the
  destination pool, all layers at once with precomputed flat row indices (favours eager);
- ``contiguous``: one copy of the same number of bytes between contiguous buffers (pinned
  host <-> device on GPU): the link's ceiling.

CPU figures use one torch thread unless ``HISPARSE_BENCH_THREADS`` says otherwise.
Measured methods: on CPU the torch backend (``reference.copy_rows``); on GPU the Triton
kernels (gather H2D, backup D2H rows; restore/spill whole pages) at 656 B rows, >= 4k rows.
The plan is decode-shaped: 64 requests x 2048 top-k columns, ``rows / 64`` misses each.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from hisparse_triton import reference
from hisparse_triton.row_table import RowTable

ROW_BYTES = 656
BLOCK = 64
REQUESTS, TOP_K = 64, 2048
HAS_CUDA = torch.cuda.is_available()


@dataclass
class Setup:
    """Pools, tables and plans of one (rows, layers) case (``rows`` moved per layer)."""

    rows: int
    layers: int
    host: RowTable      # layer-major, contiguous layers (pinned CPU on GPU runs)
    device: RowTable    # block-major: a block holds one page of every layer
    host_ids: torch.Tensor    # [64, 2048] int32 host rows (first counts[r] valid)
    device_ids: torch.Tensor  # [64, 2048] int32 device rows
    counts: torch.Tensor      # [64] int32
    host_flat: torch.Tensor   # [layers * rows] int64 row index into host_grid
    device_flat: torch.Tensor  # [layers * rows] int64 row index into device_grid

    @property
    def nbytes(self) -> int:
        return self.rows * self.layers * ROW_BYTES

    @property
    def host_grid(self) -> torch.Tensor:
        return self.host.pool.view(-1, ROW_BYTES)

    @property
    def device_grid(self) -> torch.Tensor:
        return self.device.pool.view(-1, ROW_BYTES)


def make_setup(rows: int, layers: int, device: torch.device, *, host_rows: int,
               seed: int = 0) -> Setup:
    """``rows`` misses per layer spread over 64 requests; random distinct rows both sides."""
    assert rows % REQUESTS == 0 and rows // REQUESTS <= TOP_K
    gen = torch.Generator().manual_seed(seed)
    cuda = device.type == "cuda"
    host_rows = -(-host_rows // BLOCK) * BLOCK
    device_rows = -(-2 * rows // BLOCK) * BLOCK
    page = BLOCK * ROW_BYTES
    host_pool = torch.randint(0, 256, (layers * host_rows * ROW_BYTES,), dtype=torch.uint8,
                              generator=gen)
    if cuda:
        host_pool = host_pool.pin_memory()
    host = RowTable.build(host_pool, [l * host_rows * ROW_BYTES for l in range(layers)],
                          row_bytes=ROW_BYTES, block_size=BLOCK, block_stride=page,
                          num_rows=host_rows, device=device)
    dev_pool = torch.zeros(layers * device_rows * ROW_BYTES, dtype=torch.uint8, device=device)
    dev = RowTable.build(dev_pool, [l * page for l in range(layers)], row_bytes=ROW_BYTES,
                         block_size=BLOCK, block_stride=layers * page, num_rows=device_rows,
                         device=device)
    per = rows // REQUESTS
    src = torch.randperm(host_rows, generator=gen)[:rows].view(REQUESTS, per)
    dst = torch.randperm(device_rows, generator=gen)[:rows].view(REQUESTS, per)
    pad = torch.full((REQUESTS, TOP_K - per), -1, dtype=torch.int64)
    host_ids = torch.cat([src, pad], 1).int()
    device_ids = torch.cat([dst, pad], 1).int()
    layer = torch.arange(layers).view(layers, 1)
    s, d = src.reshape(1, -1), dst.reshape(1, -1)
    host_flat = (layer * host_rows + s).reshape(-1)
    device_flat = ((d // BLOCK) * layers * BLOCK + layer * BLOCK + d % BLOCK).reshape(-1)
    return Setup(rows, layers, host, dev, host_ids.to(device), device_ids.to(device),
                 torch.full((REQUESTS,), per, dtype=torch.int32, device=device),
                 host_flat, device_flat.to(device))


def eager_gather(st: Setup) -> None:
    staged = st.host_grid.index_select(0, st.host_flat)
    st.device_grid.index_copy_(0, st.device_flat, staged.to(st.device.pool.device))


def eager_backup(st: Setup) -> None:
    staged = st.device_grid.index_select(0, st.device_flat)
    st.host_grid.index_copy_(0, st.host_flat, staged.cpu())


# ------------------------------------------------------------------------- CPU


@pytest.fixture(scope="module", params=(1, 4), ids=lambda v: f"L{v}")
def cpu_setup(request) -> Setup:
    """CPU pools; torch runs on ``$HISPARSE_BENCH_THREADS`` threads (default 1: on a small or
    busy machine OpenMP threads that wait for a core make every method erratic)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("HISPARSE_BENCH_THREADS", "1")))
    yield make_setup(4096, request.param, torch.device("cpu"), host_rows=16384)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("method", ("reference", "eager", "contiguous"))
def test_cpu_gather(benchmark, record, cpu_setup, method):
    st = cpu_setup
    if method == "reference":
        fn = lambda: reference.copy_rows(st.device, st.host, st.host_ids, st.device_ids,  # noqa: E731
                                          st.counts)
    elif method == "eager":
        fn = lambda: eager_gather(st)  # noqa: E731
    else:
        src = st.host.pool[: st.nbytes]
        dst = st.device.pool[: st.nbytes]
        fn = lambda: dst.copy_(src)  # noqa: E731
    benchmark.pedantic(fn, rounds=10, iterations=1, warmup_rounds=2)
    gbps = record(op="gather", method=method, device="cpu", rows=st.rows, layers=st.layers,
                  row_bytes=ROW_BYTES, nbytes=st.nbytes, seconds=benchmark.stats.stats.median)
    benchmark.extra_info["GB/s"] = round(gbps, 3)
    if method == "reference":  # the measured call really moved the rows
        got = st.device_grid.index_select(0, st.device_flat)
        assert torch.equal(got, st.host_grid.index_select(0, st.host_flat))


# ------------------------------------------------------------------------- GPU


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("rows", (4096, 16384, 65536))
@pytest.mark.parametrize("layers", (1, 4))
def test_gpu_transfers(record, rows, layers):
    """gather/backup rows and restore/spill pages vs eager and contiguous pinned copies."""
    from triton.testing import do_bench

    from hisparse_triton.kernels import backup, gather

    cuda = torch.device("cuda")
    st = make_setup(rows, layers, cuda, host_rows=max(4 * rows, 65536))
    pinned = torch.empty(st.nbytes, dtype=torch.uint8).pin_memory()
    dev_buf = torch.empty(st.nbytes, dtype=torch.uint8, device=cuda)
    pages = rows // BLOCK
    page_ids = torch.arange(pages, dtype=torch.int32, device=cuda).view(1, pages)
    host_pages = torch.randperm(st.host.num_blocks)[:pages].int().view(1, pages).to(cuda)

    def measure(op, method, fn, *, check=None):
        ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
        if check is not None:
            check()
        record(op=op, method=method, device="cuda", rows=rows, layers=layers,
               row_bytes=ROW_BYTES, nbytes=st.nbytes, seconds=ms / 1e3)

    def check_gather():
        torch.cuda.synchronize()
        got = st.device_grid.index_select(0, st.device_flat).cpu()
        assert torch.equal(got, st.host_grid.index_select(0, st.host_flat.cpu()))

    measure("gather", "triton", lambda: gather.gather_rows(
        st.device, st.host, st.host_ids, st.device_ids, st.counts), check=check_gather)
    measure("gather", "eager", lambda: eager_gather(st))
    measure("gather", "contiguous", lambda: dev_buf.copy_(pinned, non_blocking=True))
    measure("backup", "triton", lambda: backup.backup_rows(
        st.host, st.device, st.device_ids, st.host_ids, st.counts))
    measure("backup", "eager", lambda: eager_backup(st))
    measure("backup", "contiguous", lambda: pinned.copy_(dev_buf, non_blocking=True))
    measure("restore", "triton", lambda: gather.restore_pages(
        st.device, st.host, host_pages, page_ids))
    measure("restore", "contiguous", lambda: dev_buf.copy_(pinned, non_blocking=True))
    measure("spill", "triton", lambda: backup.spill_pages(
        st.host, st.device, page_ids, host_pages))
    measure("spill", "contiguous", lambda: pinned.copy_(dev_buf, non_blocking=True))
