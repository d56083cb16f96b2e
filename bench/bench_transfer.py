"""Row / page transfer benchmarks (the gather and backup targets: 656 B rows, 4k+ rows per
launch), on the measurement library ``hisparse_triton.benchmarks`` (the same pools, plans,
methods and checks as ``hisparse-triton bench``).

    python -m pytest bench/bench_transfer.py            # CPU: pytest-benchmark
    python -m pytest bench/bench_transfer.py -k gpu     # GPU: the library's sweep

Not part of the default test run (``testpaths = ["tests"]``). Every figure is GB/s of payload
(``rows x layers x row_bytes``) with its ratio to two baselines measured in the same run
(printed at the end; GPU figures also go to ``bench/results/pytest-bench-<gpu>.json``):
``eager`` (``index_select`` + one copy + ``index_copy_``) and ``contiguous`` (one copy of the
same bytes: the link's ceiling).

CPU: the torch backend of ``copy_rows`` (the runtime's CPU path) for gather and backup, at
4096 rows of 656 B, 1 and 4 layers, with pytest-benchmark; torch runs on one thread unless
``HISPARSE_BENCH_THREADS`` says otherwise. GPU: ``run_bench`` at 656 B rows, 4k / 16k / 64k
rows, 1 and 4 layers, every transfer op, Triton (per launch and graph replay), eager and
contiguous.
"""

from __future__ import annotations

import os

import pytest
import torch

from hisparse_triton import benchmarks as bm
from hisparse_triton.benchmarks.transfers import (
    contiguous_runner,
    eager_runner,
    kernel_runner,
    verify_transfer,
)

ROW_BYTES, ROWS, TOP_K = 656, 4096, 2048
HAS_CUDA = torch.cuda.is_available()
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=(1, 4), ids=lambda v: f"L{v}")
def cpu_case(request):
    """CPU pools of 16k rows and a 4096-row miss plan (two plan rows of 2048), per layer
    count; torch on ``$HISPARSE_BENCH_THREADS`` threads (default 1: on a small or busy machine
    OpenMP threads that wait for a core make every method erratic)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("HISPARSE_BENCH_THREADS", "1")))
    pools = bm.make_pools(ROW_BYTES, request.param, 4 * ROWS, CPU)
    plans = bm.make_row_plans(ROWS, TOP_K, 1.0, pools.num_rows, pools.num_rows, CPU,
                              variants=1, seed=0)
    yield pools, plans
    torch.set_num_threads(threads)


@pytest.mark.parametrize("op", bm.ROW_OPS)
@pytest.mark.parametrize("method", ("torch", "eager", "contiguous"))
def test_cpu_transfer(benchmark, record, cpu_case, op, method):
    pools, plans = cpu_case
    nbytes = ROWS * pools.layers * ROW_BYTES
    if method == "contiguous":
        run, _ = contiguous_runner(bm.DIRECTION[op], nbytes, pools)
    elif method == "eager":
        run = eager_runner(op, plans, pools, CPU)
    else:
        run = kernel_runner(op, "torch", plans, pools)
    if method != "contiguous":  # the measured call really moves the rows
        assert verify_transfer(op, plans, pools, CPU, lambda: run(0))
    benchmark.pedantic(run, args=(0,), rounds=10, iterations=1, warmup_rounds=2)
    if benchmark.stats is None:  # --benchmark-disable: ran once, nothing timed
        return
    seconds = benchmark.stats.stats.median
    gbps = bm.gbps(nbytes, seconds * 1e3)
    record({"op": op, "method": method, "row_bytes": ROW_BYTES, "rows": ROWS,
            "layers": pools.layers, "miss_ratio": None if method in bm.BASELINES else 1.0,
            "bytes": nbytes, "time_us": round(seconds * 1e6, 2), "gbps": round(gbps, 3)}, "cpu")
    benchmark.extra_info["GB/s"] = round(gbps, 3)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_transfers(record):
    """The library's sweep on the GPU; every figure verified, none failed."""
    device = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    settings = bm.BenchSettings(
        row_bytes=(ROW_BYTES,), rows=(4096, 16384, 65536), layers=(1, 4),
        miss_ratios=(1.0, 0.067), top_k=TOP_K, batch=(64,), hot_slots=4096, seq_len=32768,
        ops=bm.TRANSFER_OPS, methods=("triton", "eager", "contiguous"),
        rotate_bytes=max(2 * l2, 64 << 20), warmup_ms=10, rep_ms=50)
    result = bm.run_bench(settings, device)
    for figure in result["transfers"]:
        record(figure, "cuda")
    failed = [f for f in result["transfers"] if f.get("error")]
    assert not failed, failed[:3]
