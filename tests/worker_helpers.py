"""Shared set-up of the worker-part tests: a small scheduler + worker pair and a prefill.

Geometry: the ``tiny`` preset cut to 4 sparse layers (two index groups of leader + follower),
block size 4, top-k 8, a 16-row hot buffer; every request offloads as soon as it can, so a
resolve goes through the hot buffer.
"""

from __future__ import annotations

import torch

from hisparse_triton.presets import build_kv_cache_spec
from hisparse_triton.scheduler import HiSparseScheduler
from hisparse_triton.worker import HiSparseWorker
from hisparse_triton.workload import plan_for_workload

B, TOPK, BUFFER = 4, 8, 16
L0 = "model.layers.0.self_attn.attn"


def make_plan(max_num_seqs: int = 2, max_model_len: int = 64):
    spec = build_kv_cache_spec("tiny", num_layers=4, block_size=B)
    return plan_for_workload(spec, max_model_len=max_model_len, num_requests=max_num_seqs,
                             topk=TOPK, device_buffer_size=BUFFER)


def make_pair(*, max_num_seqs: int = 2, backend: str = "torch",
              **worker_kwargs) -> tuple[HiSparseScheduler, HiSparseWorker]:
    """A scheduler and a CPU worker built from one plan."""
    plan = make_plan(max_num_seqs)
    scheduler = HiSparseScheduler(plan.kv_cache_config, plan.config, max_num_seqs=max_num_seqs,
                                  free_block_watermark=1.0)
    worker = HiSparseWorker(plan.kv_cache_config, plan.config, max_num_seqs=max_num_seqs,
                            device="cpu", backend=backend, **worker_kwargs)
    return scheduler, worker


def write_rows(worker: HiSparseWorker, rows: dict, gen: torch.Generator) -> None:
    """Random KV bytes at ``rows`` (``append_slots``' ``{layer: [n] rows}``) of every layer."""
    for layer, ids in rows.items():
        cache = worker.device_cache(layer)            # [blocks, block_size, row_bytes]
        ids = torch.as_tensor(ids, dtype=torch.int64)
        cache[ids // cache.shape[1], ids % cache.shape[1]] = torch.randint(
            0, 256, (ids.numel(), cache.shape[2]), dtype=torch.uint8, generator=gen)


def prefill(scheduler: HiSparseScheduler, worker: HiSparseWorker, request_id: str, n: int,
            gen: torch.Generator) -> None:
    """Admit ``request_id`` with ``n`` prompt tokens, write their KV, mirror it, and apply
    the plan that lets its committed pages leave the GPU."""
    scheduler.add_request(request_id, n, 8)
    rows = scheduler.append_slots(request_id, n)
    plan = scheduler.step()
    worker.apply(plan)
    write_rows(worker, rows, gen)
    worker.mirror(plan)
    offload = scheduler.step()
    worker.apply(offload)
    worker.mirror(offload)
