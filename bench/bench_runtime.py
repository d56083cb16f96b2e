"""pytest-benchmark: CPU-side costs a serving stack pays every decode step, and the torch
reference ops (the CPU backend). Run: ``pytest bench/bench_runtime.py --benchmark-only``.

- runtime bookkeeping: ``append_slots`` + ``commit`` for a batch (block allocation, table
  updates, the write-through mirror), ``resolve`` per index group (torch backend on the CPU:
  the reference resolve and gather), a whole decode step over every index group;
- reference ops at decode shapes: ``resolve`` (batch x 2048 x 4096), ``copy_rows`` (656 B
  rows), ``copy_pages``.

Geometry: DeepSeek-V3.2 fp8 rows (656 B, block 64, top-k 2048) cut to 4 layers so the pools
stay small; per-layer costs scale linearly with the layer count.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from hisparse_triton import reference
from hisparse_triton.benchmarking import ResolveWorkload, make_pools, make_row_plans
from hisparse_triton.presets import build_kv_cache_spec
from hisparse_triton.runtime import HiSparseRuntime
from hisparse_triton.workload import TopkTrace, plan_for_workload

LAYERS, TOPK, BUFFER, CONTEXT, BATCH = 4, 2048, 4096, 16384, 8
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def decoding_runtime():
    """``BATCH`` requests of ``CONTEXT`` tokens, offloaded, on the CPU (torch backend)."""
    spec = build_kv_cache_spec("deepseek-v3.2-fp8", num_layers=LAYERS)
    max_len = CONTEXT + 4096
    plan = plan_for_workload(spec, max_model_len=max_len, num_requests=BATCH, topk=TOPK,
                             device_buffer_size=BUFFER, prompt_len=CONTEXT)
    rt = HiSparseRuntime(plan.kv_cache_config, plan.config, max_num_seqs=BATCH, device=CPU,
                         backend="torch", offload_threshold_pages=1)
    ids = [f"r{i}" for i in range(BATCH)]
    for rid in ids:  # prefill one request at a time, as a scheduler would
        rt.add_request(rid, CONTEXT, 4096)
        rt.append_slots(rid, CONTEXT)
        rt.commit()
    trace = TopkTrace(TOPK, locality=0.9, seed=0)
    yield rt, ids, trace
    rt.close()


def _topk_steps(rt, ids, trace, leader, steps):
    """``steps`` consecutive ``[BATCH, TOPK]`` selections of one index group (generated up
    front, so the trace generator is not timed)."""
    return [torch.from_numpy(np.stack([trace.next((rid, leader), rt.seq_len(rid))
                                       for rid in ids])) for _ in range(steps)]


def test_append_and_commit_one_token_per_request(benchmark, decoding_runtime):
    rt, ids, _ = decoding_runtime

    def step():
        for rid in ids:
            rt.append_slots(rid, 1)
        rt.commit()

    benchmark.pedantic(step, rounds=200, iterations=1, warmup_rounds=5)


def test_resolve_one_index_group(benchmark, decoding_runtime):
    rt, ids, trace = decoding_runtime
    leader = rt.leaders[0]
    topks = iter(_topk_steps(rt, ids, trace, leader, 32))
    out = benchmark.pedantic(lambda: rt.resolve(leader, ids, next(topks)), rounds=30,
                             iterations=1, warmup_rounds=2)
    assert out.shape == (BATCH, TOPK)


def test_decode_step(benchmark, decoding_runtime):
    """append + commit + resolve of every index group: the runtime's whole per-step cost."""
    rt, ids, trace = decoding_runtime
    steps = {leader: iter(_topk_steps(rt, ids, trace, leader, 11)) for leader in rt.leaders}

    def step():
        for rid in ids:
            rt.append_slots(rid, 1)
        rt.commit()
        for leader in rt.leaders:
            rt.resolve(leader, ids, next(steps[leader]))

    benchmark.pedantic(step, rounds=10, iterations=1, warmup_rounds=1)


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_reference_resolve(benchmark, batch):
    work = ResolveWorkload(batch, TOPK, BUFFER, 32768, 0.1, CPU)
    calls = itertools.count()

    def run():
        return reference.resolve(*work.args(next(calls)), **work.kwargs)

    for _ in range(work.calls_per_cycle):
        run()
    out = benchmark.pedantic(run, rounds=max(3, 24 // batch), iterations=1)
    assert out.rows.shape == (batch, TOPK)


@pytest.mark.parametrize("rows", [2048, 16384])
def test_reference_copy_rows(benchmark, rows):
    pools = make_pools(656, LAYERS, 2 * rows, CPU)
    plans = make_row_plans(rows, TOPK, 1.0, pools.num_rows, pools.num_rows, CPU, variants=1,
                           seed=0)
    benchmark(reference.copy_rows, pools.device, pools.host, plans.src[0], plans.dst[0],
              plans.counts[0])
    benchmark.extra_info["bytes"] = rows * 656 * LAYERS


def test_reference_copy_pages(benchmark):
    pages = 64
    pools = make_pools(656, LAYERS, 4 * pages * 64, CPU)
    blocks = pools.num_rows // 64
    src = torch.randperm(blocks)[:pages].to(torch.int32).view(1, pages)
    dst = torch.randperm(blocks)[:pages].to(torch.int32).view(1, pages)
    benchmark(reference.copy_pages, pools.device, pools.host, src, dst)
    benchmark.extra_info["bytes"] = pages * 64 * 656 * LAYERS
