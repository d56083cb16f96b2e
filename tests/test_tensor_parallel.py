"""Two tensor-parallel ranks as a serving stack runs them: one scheduler, two workers.

Two spawned processes join a gloo process group. Rank 0 runs the ``HiSparseScheduler`` and
broadcasts each step's ``StepPlan`` (``broadcast_plan``) plus the step's script (which
tokens were appended where, the top-k of every index group); both ranks run a
``HiSparseWorker`` over ONE host pool in ``/dev/shm`` (rank 0 creates it and is the only one
that mirrors). Every rank writes the same KV bytes (a pure function of request, layer and
position) and checks every row it resolves against that function: after a few hundred
random steps, with offloads, misses, requests coming and going, both ranks are exact.
"""

import dataclasses
import os
import random
import uuid

import numpy as np
import pytest
import torch
import torch.distributed as dist

from gloo_ranks import reporting_errors, spawn_ranks

from hisparse_triton.distributed import broadcast_host_pool_secret, broadcast_plan
from hisparse_triton.layout import get_hisparse_kv_cache_config, get_hisparse_kv_cache_groups
from hisparse_triton.presets import build_kv_cache_spec
from hisparse_triton.scheduler import HiSparseScheduler
from hisparse_triton.specs import cdiv
from hisparse_triton.worker import HiSparseWorker, pools
from hisparse_triton.workload import plan_for_workload

B, TOPK, BUFFER, SEQS, MAX_LEN, STEPS = 4, 8, 16, 3, 80, 240


def plan(tp: int = 2):
    spec = dict(build_kv_cache_spec("tiny", num_layers=4, block_size=B))
    base = plan_for_workload(spec, max_model_len=MAX_LEN, num_requests=SEQS, topk=TOPK,
                             device_buffer_size=BUFFER, device_blocks=70)
    config = dataclasses.replace(base.config, tensor_parallel_size=tp)
    groups = get_hisparse_kv_cache_groups(config, spec)
    stride = cdiv(groups[0].page_size_bytes, 4096) * 4096
    kvc = get_hisparse_kv_cache_config(config, groups, 0,
                                       base.kv_cache_config.hisparse_host_num_blocks * stride)
    assert kvc.hisparse_shared_host_pool == (tp > 1)
    return kvc, config


def content(uid: int, layer: int, positions: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """``[n, row_bytes] uint8``: the KV bytes of request ``uid``'s ``layer`` at ``positions``
    (the same on every rank, without communicating)."""
    base = (uid * 1_000_003 + layer * 7_919 + positions.to(torch.int64) * 104_729)[:, None]
    mixed = base * 6_364_136_223_846_793_005 + torch.arange(row_bytes) * 1_442_695_040_888_963_407
    return ((mixed >> 40) & 0xFF).to(torch.uint8)


def _script(rng: random.Random, scheduler: HiSparseScheduler, live: dict, next_uid: list):
    """Rank 0's scheduling for one step: requests come and go, running ones append."""
    if live and rng.random() < 0.06:
        rid = rng.choice(sorted(live))
        scheduler.free_request(rid)
        del live[rid]
    writes = []
    if len(live) < SEQS and rng.random() < 0.3:
        rid, uid = f"r{next_uid[0]}", next_uid[0]
        next_uid[0] += 1
        prompt = rng.randint(1, 30)
        try:
            scheduler.add_request(rid, prompt, rng.randint(0, MAX_LEN - prompt))
            rows = scheduler.append_slots(rid, prompt)
            live[rid] = uid
            writes.append((uid, 0, rows))
        except Exception as exc:  # a full pool: the request waits (is dropped here)
            if scheduler.has_request(rid):
                scheduler.free_request(rid)
            assert "free" in str(exc) or "state rows" in str(exc), exc
    for rid, uid in sorted(live.items()):
        if writes and writes[-1][0] == uid:
            continue
        start = scheduler.seq_len(rid)
        try:
            rows = scheduler.append_slots(rid, rng.randint(1, 2))
        except Exception as exc:  # reservation or device pool full: finished
            assert "exceeds its reservation" in str(exc) or "free" in str(exc), exc
            scheduler.free_request(rid)
            del live[rid]
            continue
        writes.append((uid, start, rows))
    ids = sorted(live)
    state_rows = scheduler.state_rows(ids).tolist()
    lengths = [scheduler.seq_len(rid) for rid in ids]
    uids = [live[rid] for rid in ids]
    topk = {leader: np.array([[rng.randint(-2, n + 3) for _ in range(TOPK)] for n in lengths],
                             dtype=np.int32).reshape(len(ids), TOPK)
            for leader in scheduler.leaders}
    return {"writes": writes, "state_rows": state_rows, "lengths": lengths, "uids": uids,
            "topk": topk}


def _check_rows(worker: HiSparseWorker, leader: str, script: dict, rows: torch.Tensor,
                layer_index: dict) -> int:
    topk = torch.from_numpy(script["topk"][leader]).to(torch.int64)
    lengths = torch.tensor(script["lengths"], dtype=torch.int64)
    valid = (topk >= 0) & (topk < lengths[:, None])
    assert torch.equal(rows < 0, ~valid), (leader, rows, topk)
    checked = 0
    for layer in worker._index_group(leader).layers:
        cache = worker.device_cache(layer)
        flat = cache.reshape(-1, cache.shape[-1])
        for r, uid in enumerate(script["uids"]):
            cols = valid[r]
            got = flat[rows[r][cols].to(torch.int64)]
            expect = content(uid, layer_index[layer], topk[r][cols], cache.shape[-1])
            assert torch.equal(got, expect), (leader, layer, uid)
            checked += int(cols.sum())
    return checked


def _rank_main(rank: int, world: int, init_file: str, pool_name: str, result_dir: str,
               split: bool = False, backend: str = "torch", steps: int = STEPS,
               fraction: "float | str" = 0.25) -> None:
    with reporting_errors(result_dir, rank):
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world)
        torch.set_num_threads(1)
        kvc, config = plan(world)
        scheduler = HiSparseScheduler(kvc, config, max_num_seqs=SEQS,
                                      free_block_watermark=1.0) if rank == 0 else None
        worker = None
        if world == 1:  # one rank: a private host pool
            pool_name = None
        if rank == 0:  # rank 0 creates the pool first; the others get its secret
            worker = HiSparseWorker(kvc, config, max_num_seqs=SEQS, device="cpu",
                                    backend=backend, tp_rank=0, host_pool_name=pool_name,
                                    split_gather=split, split_gather_fraction=fraction)
        secret = broadcast_host_pool_secret(worker.host_pool_secret if rank == 0 else None) \
            if world > 1 else None
        if rank != 0:
            worker = HiSparseWorker(kvc, config, max_num_seqs=SEQS, device="cpu",
                                    backend=backend, tp_rank=rank, host_pool_name=pool_name,
                                    host_pool_secret=secret, split_gather=split,
                                    split_gather_fraction=fraction)
        assert (worker.split_gather is not None) == split
        layer_index = {layer: i for i, layer in enumerate(worker.groups.device_layers)}
        rng = random.Random(1234)
        live: dict = {}
        next_uid = [1]
        checked = 0
        for _ in range(steps):
            script = _script(rng, scheduler, live, next_uid) if rank == 0 else None
            step_plan = broadcast_plan(scheduler.step() if rank == 0 else None)
            box = [script]
            dist.broadcast_object_list(box, src=0)
            script = box[0]
            worker.apply(step_plan)
            for uid, start, rows in script["writes"]:   # the forward writes KV ...
                for layer, r in rows.items():
                    cache = worker.device_cache(layer)
                    positions = torch.arange(start, start + r.size)
                    r = torch.from_numpy(r)
                    cache[r // B, r % B] = content(uid, layer_index[layer], positions,
                                                   cache.shape[-1])
            state_rows = torch.tensor(script["state_rows"], dtype=torch.int32)
            for leader in worker.leaders:                 # ... and resolves
                topk = torch.from_numpy(script["topk"][leader])
                rows = worker.resolve_rows(leader, state_rows, topk)
                checked += _check_rows(worker, leader, script, rows, layer_index)
            worker.mirror(step_plan)                      # after the forward
            dist.barrier()  # rank 0's mirror is in the shared pool before anyone reads it
        stats = worker.stats()
        extra = ""
        if split:   # every miss went through the split gather; what it exchanged
            sg = worker.split_gather.stats()
            assert sg.misses == stats.misses and 0 < sg.calls <= steps * len(worker.leaders)
            extra = (f" {sg.miss_bytes} {sg.exchange_bytes} {sg.overflow_bytes} "
                     f"{int(sg.fraction * 64)} {sg.plan_columns}")
        with open(os.path.join(result_dir, f"rank{rank}"), "w") as out:
            out.write(f"{checked} {stats.misses} {stats.hits} {stats.d2h_bytes} "
                      f"{step_plan.step}{extra}\n")
        dist.barrier()
        worker.close()
        dist.destroy_process_group()


def _run_two_ranks(tmp_path, split: bool = False, backend: str = "torch",
                   steps: int = STEPS, fraction: "float | str" = 0.25,
                   world: int = 2) -> list[list[int]]:
    name = f"test-tp-{uuid.uuid4().hex}"
    spawn_ranks(_rank_main, world, (world, str(tmp_path / "pg"), name, str(tmp_path), split,
                                    backend, steps, fraction), tmp_path)
    leftover = [f for f in os.listdir(pools.shared_host_pool_dir()) if name in f]
    assert not leftover, leftover
    results = [(tmp_path / f"rank{r}").read_text().split() for r in range(world)]
    return [[int(v) for v in r] for r in results]


def test_two_ranks_one_scheduler_one_shared_host_pool(tmp_path):
    (checked0, misses0, hits0, d2h0, steps0), (checked1, misses1, hits1, d2h1, steps1) = \
        _run_two_ranks(tmp_path)
    assert checked0 == checked1 > 2000            # both ranks verified the same rows
    assert misses0 == misses1 > 50 and hits0 == hits1 > 0
    assert d2h0 > 0 and d2h1 == 0                 # only rank 0 writes the shared pool
    assert steps0 == steps1 == STEPS


@pytest.mark.parametrize("backend,steps,fraction", [
    ("torch", STEPS, 0.25),   # a fixed capacity: rows past it pulled by both ranks
    ("torch", STEPS, 1.0),    # every miss column split and exchanged
    ("torch", STEPS, "auto"),  # the capacity follows the miss fraction
    ("triton", 30, 0.5)])
def test_two_ranks_split_the_gather_and_stay_exact(tmp_path, backend, steps, fraction):
    """``split_gather=True``: each rank pulls half of every step's missed rows and the ranks
    all_gather them (gloo); every row either rank resolves is checked against the dense
    content function, so both ranks' hot buffers are complete and identical."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1" \
            and not torch.cuda.is_available():
        pytest.skip("the Triton backend on CPU needs TRITON_INTERPRET=1")
    (checked0, misses0, hits0, _, steps0, *split0), (checked1, misses1, hits1, _, steps1,
                                                     *split1) = \
        _run_two_ranks(tmp_path, split=True, backend=backend, steps=steps, fraction=fraction)
    assert split0 == split1       # the same misses, exchange and capacity on both ranks
    assert checked0 == checked1 > (2000 if steps == STEPS else 100)
    assert misses0 == misses1 > (50 if steps == STEPS else 5) and hits0 == hits1
    assert steps0 == steps1 == steps


@pytest.mark.parametrize("world", [1, 4])
def test_one_and_four_ranks_split_the_gather_at_auto_capacity(tmp_path, world):
    """``split_gather_fraction="auto"`` on 1 and 4 gloo ranks: every row any rank resolves
    is exact, and the ranks agree on every count and on the capacity they retuned to."""
    results = _run_two_ranks(tmp_path, split=True, steps=48, fraction="auto", world=world)
    assert all(r[:3] + r[4:] == results[0][:3] + results[0][4:] for r in results)
    checked, misses, hits, _, steps, miss_bytes, exchange, overflow, level, cols = results[0]
    assert checked > 300 and misses > 20 and hits > 0 and steps == 48
    assert 0 <= overflow <= miss_bytes
    if world == 1:
        assert exchange == 0     # nothing to exchange with
    else:
        # retuned away from the 1/4 it starts at, to a level of the rule (this workload
        # misses about 30% of its columns; the rule itself: tests/test_split_gather.py)
        from hisparse_triton.worker.split_capacity import CAPACITY_LEVELS

        assert 0 < exchange and level != 16 and level / 64 in CAPACITY_LEVELS
        assert level / 64 >= misses / cols
