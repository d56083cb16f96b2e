"""Prefill staging out of the box: with ``prefill_staging_rows = 0`` (the default) no region
is reserved and ``resolve_prefill`` stages into device blocks the scheduler lends until the
step ends (``HiSparseScheduler.borrow_prefill_staging``).

Checked: a long prompt prefilled in chunks of ``max_num_batched_tokens`` tokens through the
facade with the default config, exact against the dense oracle on both backends; the lent
blocks come back at ``commit()``; a chunk the free blocks cannot hold is refused with
advice that fits and nothing changed; the split protocol (borrow before ``step()``, pass
``staging_blocks``) exact; misuse refused.

Geometry: the ``tiny`` preset cut to 4 layers (two index groups of a leader and a
follower), block 4, top-k 8, chunks of 16 tokens.
"""

from __future__ import annotations

import pytest
import torch

from hisparse_triton import HiSparseRuntime
from hisparse_triton.errors import PrefillStagingError
from hisparse_triton.oracle import DenseOracle, SplitView
from hisparse_triton.presets import build_kv_cache_spec
from hisparse_triton.scheduler import HiSparseScheduler
from hisparse_triton.staging import chunk_rows, scheduler_host_rows_bound
from hisparse_triton.worker import HiSparseWorker
from hisparse_triton.workload import plan_for_workload

B, TOPK, CHUNK = 4, 8, 16


def make_plan(device_blocks: int, max_model_len: int = 264):
    """The default config (``prefill_staging_rows`` not given) with a 16-token chunk."""
    plan = plan_for_workload(build_kv_cache_spec("tiny", num_layers=4, block_size=B),
                             max_model_len=max_model_len, num_requests=2, topk=TOPK,
                             device_buffer_size=2 * TOPK, max_num_batched_tokens=CHUNK,
                             device_blocks=device_blocks)
    assert plan.config.hisparse.prefill_staging_rows == 0
    return plan.kv_cache_config, plan.config


def causal_topk(gen: torch.Generator, start: int) -> torch.Tensor:
    positions = torch.arange(start, start + CHUNK)
    return (torch.rand(CHUNK, TOPK, generator=gen) * (positions[:, None] + 1)).long()


@pytest.mark.parametrize("backend", ("torch", "triton"))
def test_the_default_config_prefills_a_long_prompt_exactly(backend) -> None:
    """256 tokens in 16 chunks of ``max_num_batched_tokens``; committed pages leave the GPU
    at once (watermark 1.0), so every later chunk selects host-only rows: each is staged in
    blocks lent for the step, which come back at ``commit()``."""
    kvc, config = make_plan(device_blocks=190)
    gen = torch.Generator().manual_seed(7)
    staged = 0
    with HiSparseRuntime(kvc, config, max_num_seqs=2, device="cpu", backend=backend,
                         free_block_watermark=1.0) as rt:
        oracle = DenseOracle(rt, seed=3)
        scheduler = rt.scheduler
        assert scheduler.prefill_staging.lent
        rt.add_request("long", 256, 4)
        oracle.add("long")
        free = scheduler.device_block_pool.num_free
        for k in range(16):
            oracle.write("long", rt.append_slots("long", CHUNK))
            ids = ["long"] * CHUNK
            topk = causal_topk(gen, CHUNK * k)
            for leader in rt.leaders:
                rows = rt.resolve_prefill(leader, ids, topk)
                oracle.check_resolve(leader, ids, topk, rows)
                staged = max(staged, int(rt.worker.prefill_counts[1]))
            lent = len(scheduler.read_holds.lent_blocks())
            assert scheduler.held_device_blocks >= lent
            scheduler.check_invariants()
            rt.commit()
            assert not scheduler.read_holds.lent_blocks()     # back at commit
        assert staged > 2 * CHUNK and lent > 0
        rt.free_request("long")
        assert scheduler.device_block_pool.num_free == free
        scheduler.check_invariants()


def test_a_chunk_the_free_blocks_cannot_lend_is_refused_and_changes_nothing() -> None:
    kvc, config = make_plan(device_blocks=64, max_model_len=128)
    with HiSparseRuntime(kvc, config, max_num_seqs=2, device="cpu",
                         free_block_watermark=1.0) as rt:
        rt.add_request("a", 112, 4)
        for _ in range(7):
            rt.append_slots("a", CHUNK)
            rt.commit()
        rt.append_slots("a", 1)           # a change waits for the next plan
        # the chunk's bound is 104 host-only rows (26 blocks); 20 blocks are free
        assert rt.scheduler.available_device_blocks == 20
        topk = torch.arange(CHUNK * TOPK).view(CHUNK, TOPK) % 112
        before = rt._debug_snapshot()
        with pytest.raises(PrefillStagingError, match=r"commit\(\) first.*prefill_staging_rows"):
            rt.resolve_prefill(rt.leaders[0], ["a"] * CHUNK, topk)
        assert rt._debug_snapshot() == before
        assert rt.scheduler.has_pending_changes    # nothing was handed over


def test_chunk_rows_bounds_one_request() -> None:
    _, config = make_plan(device_blocks=190)
    assert chunk_rows(config) == min(CHUNK * TOPK, 264) == 128


# ---------------------------------------------------------------------- split protocol
def test_a_split_stack_borrows_before_step_and_passes_the_blocks() -> None:
    kvc, config = make_plan(device_blocks=190)
    scheduler = HiSparseScheduler(kvc, config, max_num_seqs=2, free_block_watermark=1.0)
    worker = HiSparseWorker(kvc, config, max_num_seqs=2, device="cpu", backend="torch")
    oracle = DenseOracle(SplitView(scheduler, worker), seed=5)
    gen = torch.Generator().manual_seed(2)
    try:
        scheduler.add_request("a", 128, 4)
        oracle.add("a")
        for k in range(8):
            oracle.write("a", scheduler.append_slots("a", CHUNK))
            plan = scheduler.step()
            ids = ["a"] * CHUNK
            scheduler.hold_reads(ids)         # then no lent block is one of a's pages
            bounds = [scheduler_host_rows_bound(scheduler, leader, ids, TOPK)
                      for leader in scheduler.leaders]
            blocks = scheduler.borrow_prefill_staging(max(bounds))
            assert scheduler.borrow_prefill_staging(0) == blocks    # the step's, again
            plans = [plan, scheduler.flush()] if scheduler.has_pending_changes else [plan]
            for p in plans:                   # the workers, before the forward
                worker.apply(p)
            state_rows = torch.full((CHUNK,), scheduler.state_row("a"), dtype=torch.int32)
            topk = causal_topk(gen, CHUNK * k)
            for leader, bound in zip(scheduler.leaders, bounds):
                assert scheduler.read_holds.lent_blocks() == blocks      # still lent
                rows = worker.resolve_prefill(leader, state_rows, topk, host_rows_bound=bound,
                                              staging_blocks=blocks)
                oracle.check_resolve(leader, ids, topk, rows)
            worker.mirror()
            scheduler.check_invariants()
        scheduler.step()                      # the next step: the blocks go back
        assert not scheduler.read_holds.lent_blocks()
        scheduler.check_invariants()
        assert int(worker.prefill_counts[1]) > 0
        # a worker given no blocks stages nothing: the advice says what to do
        with pytest.raises(PrefillStagingError,
                           match=r"holds 0 .*borrow_prefill_staging.*prefill_staging_rows"):
            worker.resolve_prefill(scheduler.leaders[0], state_rows, topk)
    finally:
        worker.close()


@pytest.mark.parametrize("blocks, match", [
    ([0], r"block 0 is outside \[1, 190\)"),
    ([5, 5], "named twice"),
    ([190], "outside"),
    (["x"], "sequence of block ids"),
    (torch.tensor([1.5]), "sequence of block ids"),
])
def test_bad_staging_blocks_are_refused(blocks, match) -> None:
    kvc, config = make_plan(device_blocks=190)
    with HiSparseWorker(kvc, config, max_num_seqs=2, device="cpu") as worker:
        topk = torch.zeros(2, TOPK, dtype=torch.int64)
        rows = torch.zeros(2, dtype=torch.int32)
        before = worker._debug_snapshot()
        with pytest.raises(ValueError, match=match):
            worker.resolve_prefill(worker.leaders[0], rows, topk, staging_blocks=blocks)
        assert worker._debug_snapshot() == before


def test_a_reserved_region_lends_nothing() -> None:
    import dataclasses

    kvc, config = make_plan(device_blocks=190)
    config = dataclasses.replace(config, hisparse=dataclasses.replace(
        config.hisparse, prefill_staging_rows=64))
    scheduler = HiSparseScheduler(kvc, config, max_num_seqs=2)
    with pytest.raises(ValueError, match="reserves a staging region of 64 rows"):
        scheduler.borrow_prefill_staging(8)
    with HiSparseWorker(kvc, config, max_num_seqs=2, device="cpu") as worker:
        with pytest.raises(ValueError, match="reserves a staging region"):
            worker.resolve_prefill(worker.leaders[0], torch.zeros(1, dtype=torch.int32),
                                   torch.zeros(1, TOPK, dtype=torch.int64),
                                   staging_blocks=[3])
