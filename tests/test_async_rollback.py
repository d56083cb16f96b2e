"""Rollback under async scheduling, exact against an independent dense oracle.

The oracle is ``examples/tiny_dsa.py``'s dense run: the same tiny DeepSeek-V3.2-shaped model
decoding one token per step with every KV row in plain tensors (no runtime, no drafts). The
runtime side decodes with ``Q - 1`` drafts per step from a drafter wrong at random (0..Q-1
accepted per step) in vLLM's async order (``EngineConfig.max_concurrent_batches=2``):
schedule step N+1 (``append_slots(..., num_draft_tokens=)`` after step N's unverified
drafts), its forward (KV written at the corrected positions), then ``verify_drafts`` for
step N (the rejected drafts dropped, step N+1's tokens moved down), ``commit``. Pure
HiSparse (``free_block_watermark=1``: every committed page leaves the GPU and is read
through the hot buffer, so rows come back from the host), on the split halves and the
facade, both backends, one and two tensor-parallel ranks: tokens and logits bit-identical.

The scheduler's bookkeeping of drafts alone is ``tests/test_scheduler_drafts.py``.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
from hisparse_triton.scheduler.requests import RequestTable
from test_tiny_dsa import HAS_TRITON_BACKEND, run_split, tiny_dsa

#: Three requests, two at a time, 80 new tokens each (generated pages leave the resident
#: tail and come back from the host), 3 drafts per step wrong at random.
ASYNC = tiny_dsa.RunSpec(num_requests=3, max_running=2, prompt_len_range=(40, 60),
                         max_new_tokens=80, spec_tokens=4, draft_error=0.4,
                         free_block_watermark=1.0, async_scheduling=True)
#: For the Triton interpreter: two layers, two requests, 2 drafts per step.
SMALL = tiny_dsa.RunSpec(num_requests=2, num_layers=2, prompt_len_range=(20, 30),
                         max_new_tokens=40, spec_tokens=3, draft_error=0.4,
                         free_block_watermark=1.0, async_scheduling=True)


def dense_of(spec):
    return tiny_dsa.run_dense(spec)


def run_facade(spec, drafts):
    with tiny_dsa.build_runtime(spec) as runtime:
        result = tiny_dsa.run(spec, tiny_dsa.HiSparseStore(runtime), drafts)
        stats = runtime.stats()
        assert runtime.request_ids == []
        return result, stats, stats


def run_store(kind, spec, drafts):
    """``(result, scheduler stats, worker stats)`` of a run through ``kind``."""
    if kind == "split":
        result, _, sched, work = run_split(spec, drafts)
        return result, sched, work
    return run_facade(spec, drafts)


@pytest.fixture(scope="module")
def dense():
    return dense_of(ASYNC)


def test_the_plan_runs_two_batches_in_flight():
    plan = tiny_dsa.plan_for_spec(ASYNC)
    assert plan.config.max_concurrent_batches == 2
    assert tiny_dsa.plan_for_spec(dataclasses.replace(ASYNC, async_scheduling=False)
                                  ).config.max_concurrent_batches == 1


#: Seed 1 under the engine's chunk limit at its smallest (the speculative tokens of a step):
#: a rejection re-mirrors tokens already planned, which the limit must not count again.
VARIANTS = {"seed0": {}, "seed1-limit": dict(seed=1, chunk_size=4, max_num_batched_tokens=4)}


@pytest.mark.parametrize("kind", ["split", "facade"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_async_rollback_is_bit_identical_to_the_dense_run(kind, variant):
    spec = dataclasses.replace(ASYNC, **VARIANTS[variant])
    dense = dense_of(spec)
    result, sched, work = run_store(kind, spec, dense.tokens)
    assert tiny_dsa.compare(dense, result) == []
    assert result.rejected_tokens > 20 and result.steps < dense.steps
    assert work.misses > 0 and sched.unpinned_pages > 0     # rows came back from the host


def test_every_request_ends_with_its_drafts_verified_and_the_pools_free(dense):
    scheduler, worker = tiny_dsa.build_split(ASYNC)
    initial = scheduler.device_block_pool.num_free, scheduler.host_block_pool.num_free
    verified = []
    verify = scheduler.verify_drafts

    def logged(request_id, num_accepted):
        start, count = scheduler.pending_drafts(request_id)[0]
        verified.append((count, num_accepted))
        verify(request_id, num_accepted)

    scheduler.verify_drafts = logged
    with worker:
        result = tiny_dsa.run(ASYNC, tiny_dsa.SplitStore(worker, scheduler), dense.tokens)
        scheduler.step()
        scheduler.check_invariants()
    assert tiny_dsa.compare(dense, result) == []
    # Random acceptance: every count from none to all of the run's drafts.
    assert {accepted for count, accepted in verified if count == 3} == {0, 1, 2, 3}
    assert 0 < sum(count - accepted for count, accepted in verified) \
        <= result.rejected_tokens
    scheduler.reset_prefix_cache()
    assert (scheduler.device_block_pool.num_free, scheduler.host_block_pool.num_free) == initial


def test_a_runtime_that_keeps_stale_host_copies_is_caught(dense, monkeypatch):
    """The oracle sees the host bytes of a re-appended position: a ``verify_drafts`` that
    does not mirror the positions from the first rejected one again (their host rows keep
    the rejected drafts' bytes) makes the decode differ."""
    original = RequestTable.verify

    def stale(self, req, num_accepted, block_size):
        before = req.scheduled_len
        out = original(self, req, num_accepted, block_size)
        self._journal.setattr(req, "scheduled_len", min(before, req.seq_len))
        return out

    monkeypatch.setattr(RequestTable, "verify", stale)
    result, _, _ = run_store("split", ASYNC, dense.tokens)
    assert any("differ" in problem for problem in tiny_dsa.compare(dense, result))


def test_two_tensor_parallel_ranks_roll_back_exactly(dense):
    """``--tp 2 --async``: rank 0 schedules (drafts, verifications) and broadcasts every
    plan; each rank writes the step's KV at the corrected positions through its own block
    tables; one host pool in /dev/shm."""
    ranks = tiny_dsa.run_tp(ASYNC, 2, drafts=dense.tokens)
    for r in ranks:
        assert tiny_dsa.compare(dense, r.result) == [], r.rank
        assert r.result.rejected_tokens > 0
    zero, one = ranks
    assert zero.worker["misses"] == one.worker["misses"] > 0
    assert zero.worker["d2h_bytes"] > 0 and one.worker["d2h_bytes"] == 0
    leftover = [f for f in os.listdir("/dev/shm") if f.startswith("hisparse-tiny-dsa-")] \
        if os.path.isdir("/dev/shm") else []
    assert not leftover, leftover


@pytest.mark.skipif(not HAS_TRITON_BACKEND, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("kind", ["split", "facade", "tp2"])
def test_triton_backend_async_rollback_small(kind):
    spec = dataclasses.replace(SMALL, backend="triton")
    dense = dense_of(spec)
    if kind == "tp2":
        ranks = tiny_dsa.run_tp(spec, 2, drafts=dense.tokens)
        runs = [(r.result, r.worker["misses"]) for r in ranks]
    else:
        result, sched, work = run_store(kind, spec, dense.tokens)
        runs = [(result, work.misses)]
    for result, misses in runs:
        assert tiny_dsa.compare(dense, result) == []
        assert result.rejected_tokens > 0 and misses > 0


def test_the_cli_runs_async_and_refuses_it_with_cuda_graphs(capsys):
    assert tiny_dsa.main(["--mtp", "2", "--draft-error", "0.4", "--async", "--requests", "2",
                          "--layers", "2", "--prompt-len", "20", "30", "--max-new-tokens",
                          "40", "--free-block-watermark", "1", "--check"]) == 0
    out = capsys.readouterr().out
    assert "async scheduling" in out and "bit-identical" in out
    assert tiny_dsa.main(["--cuda-graph", "--async"]) == 2
    assert "without --async" in capsys.readouterr().err
