"""A whole decode step (every index group's ``resolve_rows`` + an attention read of the
returned rows) captured in ONE CUDA graph and replayed with changing top-k: bit-exact with
the same step run eagerly on an identical worker; and a serving loop around it: a new plan
applied before each replay, batches smaller than the captured one padded, requests leaving
and joining, misses, followers, byte for byte against the eager loop (``FixedStep``,
``decode_fixed_against_eager``; tests/test_fixed_shape_decode.py runs the same loop without
a capture on CPU). Needs CUDA (skipped otherwise)."""

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


# -- decode at the captured batch, padded, with a new plan each step, against eager --------
class FixedStep:
    """The decode forward of a serving stack at its captured batch: every index group's
    ``resolve_rows`` (the gather inside) on persistent inputs (``state_rows [batch]``, -1 =
    padding; ``topk[leader] [batch, K]``) and an attention read of the rows. ``capture``: once,
    in a CUDA graph (warmed on padding rows only, which changes nothing), then replayed;
    otherwise the same fixed-shape step runs eagerly (what the graph replays)."""

    def __init__(self, worker: HiSparseWorker, leaders: list, batch: int, k: int,
                 capture: bool) -> None:
        dev = worker.device
        self.worker, self.leaders, self.batch, self.capture = worker, leaders, batch, capture
        self.state_rows = torch.full((batch,), -1, dtype=torch.int32, device=dev)
        self.topk = {leader: torch.full((batch, k), -1, dtype=torch.int32, device=dev)
                     for leader in leaders}
        self.graph, self.outputs, self.replays = None, None, 0

    def forward(self):
        rows = {leader: self.worker.resolve_rows(leader, self.state_rows, self.topk[leader])
                for leader in self.leaders}
        return rows, {leader: _attention(self.worker, leader, rows[leader])
                      for leader in self.leaders}

    def __call__(self, state_rows: torch.Tensor, topk: dict):
        R = state_rows.shape[0]
        if self.capture and self.graph is None:
            self.state_rows.fill_(-1)                      # warm on padding rows only
            for leader in self.leaders:
                self.topk[leader].fill_(-1)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.forward()
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.outputs = self.forward()
        self.state_rows.fill_(-1)
        self.state_rows[:R] = state_rows.to(self.state_rows.device)
        for leader in self.leaders:
            self.topk[leader].fill_(-1)
            self.topk[leader][:R] = topk[leader].to(self.state_rows.device)
        if self.graph is not None:
            self.graph.replay()
            self.replays += 1
            rows, out = self.outputs
        else:
            rows, out = self.forward()
        for leader in self.leaders:   # padding rows resolve to -1 and read nothing
            assert bool((rows[leader][R:] == -1).all()) and not out[leader][:, R:].any()
        return ({leader: r[:R].clone() for leader, r in rows.items()},
                {leader: o[:, :R].clone() for leader, o in out.items()})


def decode_fixed_against_eager(device: torch.device, backend: str, *, steps: int,
                               capture: bool, batch: int = 3, prompt: int = 40,
                               topk_width: int = 8, buffer: int = 16) -> tuple:
    """Two identical scheduler + worker pairs decode the same steps: one eagerly (a
    ``resolve_rows`` of the live rows per index group), one through ``FixedStep`` at the
    captured batch (padded). Requests come and go (a plan that frees, one that admits), every
    request is offloaded (misses), the tiny preset's index groups have followers. Every
    step's rows and attention reads must agree byte for byte, and at the end the workers'
    tables, hot state, counters and device pools. Returns both workers' stats and the
    fixed step."""
    spec = build_kv_cache_spec("tiny", num_layers=4, block_size=4)
    plan = plan_for_workload(spec, max_model_len=prompt + steps + 16, num_requests=batch,
                             topk=topk_width, device_buffer_size=buffer, prompt_len=prompt)
    pairs = [(HiSparseScheduler(plan.kv_cache_config, plan.config, max_num_seqs=batch,
                                free_block_watermark=1.0),
              HiSparseWorker(plan.kv_cache_config, plan.config, max_num_seqs=batch,
                             device=device, backend=backend)) for _ in range(2)]
    gen = torch.Generator().manual_seed(11)

    def step_both(admit=(), free=(), decode=()):
        """One step on both pairs: admissions (prefill), frees, one token per ``decode``
        request; identical KV bytes in both pools; the plan applied. Returns the plans."""
        appended = [{} for _ in pairs]
        for i, (scheduler, _) in enumerate(pairs):
            for rid in free:
                scheduler.free_request(rid)
            for rid in admit:
                scheduler.add_request(rid, prompt, steps + 8)
                appended[i][rid] = scheduler.append_slots(rid, prompt)
            if decode:
                appended[i]["decode"] = scheduler.append_decode(list(decode))
        plans = [scheduler.step() for scheduler, _ in pairs]
        for (_, worker), plan_ in zip(pairs, plans):
            worker.apply(plan_)
        for key in appended[0]:
            for layer, ids in appended[0][key].items():
                cache = pairs[0][1].device_cache(layer)
                data = torch.randint(0, 256, (len(ids), cache.shape[2]), dtype=torch.uint8,
                                     generator=gen)
                for (_, worker), mine in zip(pairs, appended):
                    assert list(mine[key][layer]) == list(ids)   # the same plans
                    c = worker.device_cache(layer)
                    rows = torch.as_tensor(ids, dtype=torch.int64)
                    c[rows // c.shape[1], rows % c.shape[1]] = data.to(c.device)
        return plans

    def mirror(plans):
        for (_, worker), plan_ in zip(pairs, plans):
            worker.mirror(plan_)

    live = ["a", "b", "c", "e"][:batch]
    for rid in live:                                     # prefilled; durable: offloaded
        mirror(step_both(admit=(rid,)))
        mirror(step_both())
    leaders = pairs[0][0].leaders
    fixed = FixedStep(pairs[1][1], leaders, batch, topk_width, capture)
    for step in range(steps):
        admit, free = (), ()
        if step == steps // 3:
            free = (live.pop(0),)                        # a smaller batch: padding
        if step == 2 * steps // 3:
            admit = ("d",)
        plans = step_both(admit=admit, free=free, decode=live)
        scheduler = pairs[0][0]
        state_rows = torch.from_numpy(scheduler.state_rows(live)).to(device)
        topk = {leader: torch.stack([
            torch.randint(-2, scheduler.seq_len(rid) + 3, (topk_width,), generator=gen)
            for rid in live]).to(torch.int32).to(device) for leader in leaders}
        eager_rows = {leader: pairs[0][1].resolve_rows(leader, state_rows, topk[leader])
                      for leader in leaders}
        eager_out = {leader: _attention(pairs[0][1], leader, eager_rows[leader])
                     for leader in leaders}
        rows, out = fixed(state_rows, topk)
        for leader in leaders:
            assert torch.equal(rows[leader], eager_rows[leader]), (step, leader)
            assert torch.equal(out[leader], eager_out[leader]), (step, leader)
        mirror(plans)
        if admit:
            live += list(admit)
            mirror(step_both())
    eager, graph = (worker for _, worker in pairs)
    assert eager._debug_snapshot() == graph._debug_snapshot()
    assert torch.equal(eager.device_pool.tensor.cpu(), graph.device_pool.tensor.cpu())
    stats = (eager.stats(), graph.stats())
    for _, worker in pairs:
        worker.close()
    return stats, fixed


def test_a_captured_decode_forward_replays_padded_batches_with_new_plans_exactly():
    (eager, graph), fixed = decode_fixed_against_eager(torch.device("cuda"), "triton",
                                                       steps=12, capture=True, batch=4,
                                                       prompt=200, topk_width=32, buffer=64)
    assert fixed.replays == 12 and eager == graph and eager.misses > 0
