"""pytest-benchmark: CPU-side costs a serving stack pays every decode step.
Run: ``pytest bench/bench_runtime.py --benchmark-only``.

Runtime bookkeeping: ``append_slots`` + ``commit`` for a batch (block allocation, table
updates, the write-through mirror), ``resolve`` per index group (torch backend on the CPU: the
reference resolve and gather), a whole decode step over every index group. The reference ops
alone are measured by ``bench_resolve.py`` and ``bench_transfer.py``.

Geometry: DeepSeek-V3.2 fp8 rows (656 B, block 64, top-k 2048) cut to 4 layers so the pools
stay small; per-layer costs scale linearly with the layer count.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

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
