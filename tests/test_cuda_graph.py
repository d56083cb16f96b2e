"""A whole decode step (every index group's ``resolve_rows`` + an attention read of the
returned rows) captured in ONE CUDA graph and replayed with changing top-k: bit-exact with
the same step run eagerly on an identical worker. Needs CUDA (skipped otherwise)."""

import pytest
import torch

from hisparse_triton.presets import build_kv_cache_spec
from hisparse_triton.scheduler import HiSparseScheduler
from hisparse_triton.worker import HiSparseWorker
from hisparse_triton.workload import plan_for_workload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

B, TOPK, BUFFER, BATCH, PROMPT = 16, 32, 64, 4, 200


def _pair(device):
    spec = build_kv_cache_spec("tiny")
    plan = plan_for_workload(spec, max_model_len=512, num_requests=BATCH, topk=TOPK,
                             device_buffer_size=BUFFER, device_blocks=600)
    config = plan.config
    scheduler = HiSparseScheduler(plan.kv_cache_config, config, max_num_seqs=BATCH,
                                  free_block_watermark=1.0)
    worker = HiSparseWorker(plan.kv_cache_config, config, max_num_seqs=BATCH, device=device,
                            backend="triton")
    return scheduler, worker


def _attention(worker: HiSparseWorker, leader: str, rows: torch.Tensor) -> torch.Tensor:
    """A stand-in for sparse attention: every layer of the group reads its rows."""
    out = []
    for layer in worker._index_group(leader).layers:
        cache = worker.device_cache(layer)
        flat = cache.reshape(-1, cache.shape[-1])
        picked = flat.index_select(0, rows.clamp(min=0).reshape(-1).long())
        picked = picked.reshape(*rows.shape, -1).float() * (rows >= 0).unsqueeze(-1)
        out.append(picked.sum(dim=1))
    return torch.stack(out)


def test_a_whole_decode_step_replays_from_one_cuda_graph():
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    halves = [_pair(device) for _ in range(2)]         # [0] eager, [1] graph
    ids = [f"r{i}" for i in range(BATCH)]
    for scheduler, worker in halves:
        for rid in ids:
            scheduler.add_request(rid, PROMPT, 64)
            scheduler.append_slots(rid, PROMPT)
        plan = scheduler.step()
        worker.apply(plan)
    data = {layer: torch.randint(0, 256, halves[0][1].device_cache(layer).shape,
                                 dtype=torch.uint8, generator=gen)
            for layer in halves[0][0].device_layers}
    for scheduler, worker in halves:                    # identical KV in both pools
        for layer, values in data.items():
            worker.device_cache(layer).copy_(values)
        worker.mirror(plan)
        worker.apply(scheduler.step())                 # the prompt is durable: offloaded
    leaders = halves[0][0].leaders
    state_rows = torch.from_numpy(halves[0][0].state_rows(ids)).to(device)

    def topks():
        return {leader: torch.randint(0, PROMPT, (BATCH, TOPK), dtype=torch.int32,
                                      generator=gen).to(device) for leader in leaders}

    def eager_step(worker, topk):
        rows = {leader: worker.resolve_rows(leader, state_rows, topk[leader])
                for leader in leaders}
        return rows, {leader: _attention(worker, leader, rows[leader]) for leader in leaders}

    warm = topks()                                     # compiles every kernel, same on both
    for _, worker in halves:
        eager_step(worker, warm)
    static = topks()
    graph_worker = halves[1][1]
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        graph_rows, graph_out = eager_step(graph_worker, static)
    for step in range(6):
        fresh = topks()
        for leader in leaders:
            static[leader].copy_(fresh[leader])
        graph.replay()
        rows, out = eager_step(halves[0][1], fresh)
        torch.cuda.synchronize()
        for leader in leaders:
            assert torch.equal(graph_rows[leader], rows[leader]), (step, leader)
            assert torch.equal(graph_out[leader], out[leader]), (step, leader)
    assert halves[0][1].stats() == halves[1][1].stats()
    assert halves[0][1].stats().misses > 0
    for _, worker in halves:
        worker.close()
