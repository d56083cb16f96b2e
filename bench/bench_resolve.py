"""``resolve`` benchmarks (DESIGN.md section 9: 64 requests x top-k 2048 x 4096 hot slots), on
the measurement library ``hisparse_triton.benchmarks`` (the workload and checks of
``hisparse-triton bench``).

    python -m pytest bench/bench_resolve.py             # CPU: pytest-benchmark
    python -m pytest bench/bench_resolve.py -k gpu      # GPU: the library's figures

Every call starts from the same warm state (``ResolveWorkload``: full hot buffers, the LRU
order of real use, restored before each call, untimed) with a prescribed miss ratio, so the
figures do not drift as the state would under repeated calls.

CPU: the torch reference (the runtime's CPU backend) at batch 1 / 8 / 64, miss ratio 0.067
(buffer = 4k in the GLM-5.1 trace) and 1 (cold). GPU: the Triton kernel per call, its
CUDA-graph replay and the torch reference on the GPU, at batch 64 and the three DESIGN.md
miss ratios, each checked bit for bit against the reference.
"""

from __future__ import annotations

import pytest
import torch

from hisparse_triton import benchmarks as bm
from hisparse_triton import reference

TOP_K, HOT, SEQ = 2048, 4096, 32768
HAS_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("batch, ratio", [(1, 0.067), (8, 0.067), (64, 0.067), (64, 1.0)])
def test_cpu_reference_resolve(benchmark, record, batch, ratio):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        work = bm.ResolveWorkload(batch, TOP_K, HOT, SEQ, ratio, torch.device("cpu"))
        out = benchmark.pedantic(lambda: reference.resolve(*work.args(), **work.kwargs),
                                 setup=work.restore, rounds=max(3, 24 // batch),
                                 warmup_rounds=1)
    finally:
        torch.set_num_threads(threads)
    misses = int(out.stats[:, 1].sum())
    assert misses == round(work.expected_miss_ratio * batch * TOP_K)
    if benchmark.stats is None:  # --benchmark-disable: ran once, nothing timed
        return
    record({"op": "resolve", "method": "torch", "batch": batch, "top_k": TOP_K,
            "hot_slots": HOT, "seq_len": SEQ, "miss_ratio": ratio,
            "measured_miss_ratio": misses / (batch * TOP_K),
            "time_us": round(benchmark.stats.stats.median * 1e6, 1)}, "cpu")


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_resolve(record):
    device = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    settings = bm.BenchSettings(
        row_bytes=(656,), rows=(4096,), layers=(1,), miss_ratios=bm.DEFAULT_MISS_RATIOS,
        top_k=TOP_K, batch=(64,), hot_slots=HOT, seq_len=SEQ, ops=("resolve",),
        methods=("triton", "torch"), rotate_bytes=max(2 * l2, 64 << 20))
    rbench = bm.ResolveBench(settings, device)
    figures = [f for ratio in settings.miss_ratios for f in rbench.case(64, ratio)]
    for figure in figures:
        record(figure.to_json(), "cuda")
    assert {f.method for f in figures} == {"triton", "triton_graph", "torch"}
    assert all(f.error is None and f.verified for f in figures), \
        [f.to_json() for f in figures if f.error]
