"""Prefill staging through the runtime's halves: the reserved region (both halves derive
it, the scheduler never hands it out), ``HiSparseWorker.resolve_prefill`` exact against the
dense oracle while the pool forces offload (a long prompt in 16 chunks, on both backends),
hot state untouched, overflow reported with and without a host-side bound, bad calls
refused with nothing changed.

Geometry: the ``tiny`` preset cut to 4 layers (two index groups of a leader and a follower),
block 4, top-k 8.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hisparse_triton import HiSparseConfig, HiSparseRuntime
from hisparse_triton.errors import (
    CapacityError,
    PrefillStagingError,
    ReservationExceededError,
    UnknownRequestError,
)
from hisparse_triton.oracle import DenseOracle, SplitView, position_bytes
from hisparse_triton.presets import build_kv_cache_spec
from hisparse_triton.scheduler import HiSparseScheduler
from hisparse_triton.staging import (
    PrefillStaging,
    host_only_rows,
    host_rows_bound,
    scheduler_host_rows_bound,
)
from hisparse_triton.worker import HiSparseWorker
from hisparse_triton.workload import plan_for_workload

B, TOPK = 4, 8


def make_plan(*, max_model_len: int, staging_rows: int, device_blocks: int,
              num_requests: int = 2, chunk: int = 16):
    """A plan whose config asks for ``staging_rows`` rows of prefill staging."""
    plan = plan_for_workload(build_kv_cache_spec("tiny", num_layers=4, block_size=B),
                             max_model_len=max_model_len, num_requests=num_requests,
                             topk=TOPK, device_buffer_size=2 * TOPK,
                             max_num_batched_tokens=chunk, device_blocks=device_blocks)
    hisparse = dataclasses.replace(plan.config.hisparse, prefill_staging_rows=staging_rows)
    return plan.kv_cache_config, dataclasses.replace(plan.config, hisparse=hisparse)


class Prefill:
    """A scheduler + worker pair (watermark 1.0: committed pages leave the GPU at once)
    with a dense oracle, driven as a serving stack drives them."""

    def __init__(self, backend: str = "torch", *, max_model_len: int = 264,
                 staging_rows: int = 256, device_blocks: int = 190, num_requests: int = 2,
                 chunk: int = 16) -> None:
        kvc, config = make_plan(max_model_len=max_model_len, staging_rows=staging_rows,
                                device_blocks=device_blocks, num_requests=num_requests,
                                chunk=chunk)
        self.scheduler = HiSparseScheduler(kvc, config, max_num_seqs=num_requests,
                                           free_block_watermark=1.0)
        self.worker = HiSparseWorker(kvc, config, max_num_seqs=num_requests, device="cpu",
                                     backend=backend)
        self.oracle = DenseOracle(SplitView(self.scheduler, self.worker), seed=3)
        self.gen = torch.Generator().manual_seed(5)
        self.plan = None

    def add(self, rid: str, prompt_len: int) -> None:
        self.scheduler.add_request(rid, prompt_len, 4)
        self.oracle.add(rid)

    def begin(self, chunks: dict[str, int]) -> None:
        """Append every request's chunk, write its KV, apply the step's plan."""
        for rid, n in chunks.items():
            self.oracle.write(rid, self.scheduler.append_slots(rid, n))
        self.plan = self.scheduler.step()
        self.worker.apply(self.plan)

    def end(self) -> None:
        self.worker.mirror(self.plan)

    def chunk_topk(self, chunks: dict[str, int]) -> tuple[list[str], torch.Tensor,
                                                         torch.Tensor]:
        """One request id, state row and causal top-k row per query token of the chunks."""
        ids, rows, topk = [], [], []
        for rid, n in chunks.items():
            end = self.scheduler.seq_len(rid)
            for q in range(end - n, end):
                ids.append(rid)
                rows.append(self.scheduler.state_row(rid))
                picks = (torch.rand(TOPK, generator=self.gen) * (q + 1)).long()
                picks[-1] = -1          # a masked column in every row
                topk.append(picks)
        return ids, torch.tensor(rows, dtype=torch.int32), torch.stack(topk)

    def stage_and_check(self, chunks: dict[str, int], **kwargs) -> list[int]:
        """``resolve_prefill`` of every index group for the chunks' tokens, checked against
        the dense copies of the leader and its follower; the staged counts per group."""
        ids, state_rows, topk = self.chunk_topk(chunks)
        counts = []
        for leader in self.scheduler.leaders:
            bound = scheduler_host_rows_bound(self.scheduler, leader, ids, TOPK)
            rows = self.worker.resolve_prefill(leader, state_rows, topk,
                                               host_rows_bound=bound, **kwargs)
            self.oracle.check_resolve(leader, ids, topk, rows)
            staged, needed = self.worker.prefill_counts.tolist()
            assert staged == needed <= bound
            counts.append(needed)
        return counts


# ---------------------------------------------------------------------- the region


def test_the_region_is_the_last_blocks_of_the_pool() -> None:
    kvc, config = make_plan(max_model_len=64, staging_rows=10, device_blocks=40)
    staging = PrefillStaging.from_plan(kvc, config)
    assert (staging.num_blocks, staging.first_block, staging.block_size) == (3, 37, B)
    assert staging.capacity_rows == 12 and staging.first_row == 37 * B
    assert staging.nbytes(kvc.bytes_per_block) == 3 * kvc.bytes_per_block
    kvc, config = make_plan(max_model_len=64, staging_rows=0, device_blocks=40)
    assert PrefillStaging.from_plan(kvc, config) == PrefillStaging(40, 0, B)


def test_a_region_that_leaves_no_pool_is_refused() -> None:
    kvc, config = make_plan(max_model_len=64, staging_rows=39 * B, device_blocks=40)
    with pytest.raises(ValueError, match=r"reserves 39 blocks .* has only 40 blocks"):
        PrefillStaging.from_plan(kvc, config)
    with pytest.raises(ValueError, match="reserves 39 blocks"):
        HiSparseScheduler(kvc, config, max_num_seqs=2)


@pytest.mark.parametrize("bad", (-1, True, 1.5, None))
def test_prefill_staging_rows_must_be_a_count(bad) -> None:
    with pytest.raises(ValueError, match="prefill_staging_rows must be an int >= 0"):
        HiSparseConfig(host_pool_gib=1, prefill_staging_rows=bad)


def test_the_scheduler_never_hands_out_a_staging_block() -> None:
    kvc, config = make_plan(max_model_len=256, staging_rows=32, device_blocks=60,
                            num_requests=4, chunk=256)
    scheduler = HiSparseScheduler(kvc, config, max_num_seqs=4)
    staging = scheduler.prefill_staging
    assert scheduler.device_block_pool.num_blocks == staging.first_block == 52
    used: set[int] = set()
    full = 0
    for i in range(4):
        try:
            scheduler.add_request(f"r{i}", 248, 8)
            while True:
                scheduler.append_slots(f"r{i}", 8)
        except CapacityError:
            full += 1
        except ReservationExceededError:
            pass
        for rid in scheduler.request_ids:
            for layer in scheduler.device_layers:
                used.update(scheduler.block_table(rid, layer))
        scheduler.step()
    assert full and max(used) == staging.first_block - 1     # the pool was used up to it


def test_host_only_rows_counts_rows_without_a_device_copy() -> None:
    # pages: host-only, resident, host-only (partial last page: 2 of 4 rows), no host block
    assert host_only_rows([0, 5, 0, 0], [3, 4, 6, 0], 10, 4) == 4 + 2
    assert host_only_rows([0, 0], [3, 4], 0, 4) == 0
    assert host_only_rows([], [], 5, 4) == 0
    assert host_rows_bound([100, 50], tokens=3, top_k=8) == 24
    assert host_rows_bound([10, 5], tokens=3, top_k=8) == 15


# ---------------------------------------------------------------------- end to end


@pytest.mark.parametrize("backend", ("torch", "triton"))
def test_a_long_prompt_prefills_in_16_chunks_exactly_while_offloaded(backend) -> None:
    """A 128K-class prompt scaled down: 16 chunks of 16 tokens; from the third chunk on most
    of its history lives only in the host pool, and every chunk's rows are exact for the
    leader and the follower of both index groups."""
    run = Prefill(backend)
    run.add("long", 256)
    needed = []
    for k in range(16):
        run.begin({"long": 16})
        needed.append(run.stage_and_check({"long": 16}))
        run.end()
    assert run.scheduler.unpinned_pages("long") >= 56      # the history left the GPU
    assert all(n > 0 for n in needed[-1]) and max(map(max, needed)) > 64


def test_two_requests_sharing_a_cached_prefix_stage_its_rows_once() -> None:
    """Request b reuses a's first 64 prompt tokens from the prefix cache (shared host
    blocks); one chunk with tokens of both stages each shared host row once."""
    shared = 64
    run = Prefill(max_model_len=136, staging_rows=128, device_blocks=170)
    layer_of = {name: i for i, name in enumerate(run.scheduler.device_layers)}

    def content(rid, layer, positions, row_bytes):
        keys = torch.where(positions < shared, 0, 1 + int(rid == "b"))
        return position_bytes(keys, layer_of[layer], positions, row_bytes)

    run.oracle = DenseOracle(SplitView(run.scheduler, run.worker), content=content)
    tokens = list(range(96))
    run.scheduler.add_request("a", 96, 4, token_ids=tokens)
    run.oracle.add("a")
    for _ in range(shared // 16 + 1):
        run.begin({"a": 16})
        run.end()
    cached = run.scheduler.add_request("b", 96, 4, token_ids=tokens[:shared] + [7] * 32)
    assert cached == shared
    run.oracle.add("b", cached)
    chunks = {"a": 16, "b": 16}
    run.begin(chunks)
    ids, state_rows, topk = run.chunk_topk(chunks)
    leader = run.scheduler.leaders[0]
    alone = []
    for rid in chunks:
        mine = torch.tensor([i == rid for i in ids])
        run.worker.resolve_prefill(leader, state_rows[mine], topk[mine])
        alone.append(int(run.worker.prefill_counts[1]))
    rows = run.worker.resolve_prefill(leader, state_rows, topk)
    run.oracle.check_resolve(leader, ids, topk, rows)
    assert int(run.worker.prefill_counts[1]) < sum(alone)     # shared rows staged once
    run.end()


def test_hot_state_and_tables_are_untouched(backend="triton") -> None:
    run = Prefill(backend)
    run.add("a", 64)
    for _ in range(3):
        run.begin({"a": 16})
        run.end()
    run.begin({"a": 16})
    before = run.worker._debug_snapshot()
    run.stage_and_check({"a": 16})
    assert run.worker._debug_snapshot() == before
    run.end()


# ---------------------------------------------------------------------- overflow


def _offloaded(backend: str = "torch", staging_rows: int = 256) -> tuple[Prefill, tuple]:
    run = Prefill(backend, staging_rows=staging_rows)
    run.add("a", 128)
    for _ in range(6):
        run.begin({"a": 16})
        run.end()
    run.begin({"a": 16})
    ids, state_rows, topk = run.chunk_topk({"a": 16})
    return run, (ids, state_rows, topk)


def test_a_chunk_that_overflows_the_region_names_both_numbers() -> None:
    run, (ids, state_rows, topk) = _offloaded(staging_rows=8)
    leader = run.scheduler.leaders[0]
    before = run.worker._debug_snapshot()
    with pytest.raises(PrefillStagingError, match=r"references (\d+) distinct host-only rows "
                                                  r"but the staging region holds 8") as info:
        run.worker.resolve_prefill(leader, state_rows, topk)
    assert info.value.available == 8 and info.value.needed > 8
    assert run.worker._debug_snapshot() == before
    # the same with a bound that does not prove the chunk fits
    with pytest.raises(PrefillStagingError):
        run.worker.resolve_prefill(leader, state_rows, topk, host_rows_bound=10**6)
    # check=False: no error; overflowing columns are -1, the counts say so
    rows = run.worker.resolve_prefill(leader, state_rows, topk, check=False)
    staged, needed = run.worker.prefill_counts.tolist()
    assert staged == 8 and needed == info.value.needed
    staging_rows = rows >= run.scheduler.prefill_staging.first_row
    assert int(staging_rows.sum()) >= 8 and bool(((rows >= 0) | (topk < 0)).any())


def test_a_region_of_zero_rows_serves_resident_rows_only() -> None:
    run = Prefill(staging_rows=0, device_blocks=160)
    run.add("a", 64)
    run.begin({"a": 16})
    ids, state_rows, topk = run.chunk_topk({"a": 16})
    leader = run.scheduler.leaders[0]
    rows = run.worker.resolve_prefill(leader, state_rows, topk)   # nothing on the host yet
    run.oracle.check_resolve(leader, ids, topk, rows)
    run.end()
    for _ in range(2):
        run.begin({"a": 16})
        run.end()
    run.begin({"a": 16})
    ids, state_rows, topk = run.chunk_topk({"a": 16})
    with pytest.raises(PrefillStagingError, match="staging region holds 0"):
        run.worker.resolve_prefill(leader, state_rows, topk)


def test_a_bound_that_fits_reads_nothing_on_the_host(monkeypatch) -> None:
    """With ``host_rows_bound <= capacity`` the call launches its kernels and returns
    without reading a tensor value (no sync: it may run on a side stream); without a
    bound it reads the device count once."""
    from lab.launches import record_launches
    from test_ops import _SYNCING

    run, (ids, state_rows, topk) = _offloaded("triton")
    leader = run.scheduler.leaders[0]
    bound = scheduler_host_rows_bound(run.scheduler, leader, ids, TOPK)
    run.worker.resolve_prefill(leader, state_rows, topk, host_rows_bound=bound)  # warm up

    def refuse(self, *args, **kwargs):
        raise AssertionError("resolve_prefill read a tensor value on the host")

    with record_launches() as launched:
        with monkeypatch.context() as patch:
            for name in _SYNCING:
                patch.setattr(torch.Tensor, name, refuse)
            patch.setattr(torch, "nonzero", refuse)
            run.worker.resolve_prefill(leader, state_rows, topk, host_rows_bound=bound)
            assert len(launched) == 5          # four plan kernels and one gather
            run.worker.resolve_prefill(leader, state_rows, topk, check=False)
            with pytest.raises(AssertionError, match="read a tensor value"):
                run.worker.resolve_prefill(leader, state_rows, topk)


# ---------------------------------------------------------------------- bad calls


@pytest.mark.parametrize("call, error, match", [
    (lambda w, s, t: w.resolve_prefill("nope", s, t), ValueError, "not an index-group leader"),
    (lambda w, s, t: w.resolve_prefill(L0(w), s, t.float()), ValueError, "integer positions"),
    (lambda w, s, t: w.resolve_prefill(L0(w), s, t[None]), ValueError, r"\[tokens, k\]"),
    (lambda w, s, t: w.resolve_prefill(L0(w), s.long(), t), ValueError, "int32 tensor"),
    (lambda w, s, t: w.resolve_prefill(L0(w), s[:-1], t), ValueError, r"int32 tensor \[16\]"),
    (lambda w, s, t: w.resolve_prefill(L0(w), s, t, host_rows_bound=-1), ValueError,
     "host_rows_bound must be"),
])
def test_bad_calls_are_refused_and_change_nothing(call, error, match) -> None:
    run, (ids, state_rows, topk) = _offloaded()
    before = run.worker._debug_snapshot()
    with pytest.raises(error, match=match):
        call(run.worker, state_rows, topk)
    assert run.worker._debug_snapshot() == before


def L0(worker: HiSparseWorker) -> str:
    return worker.leaders[0]


# ---------------------------------------------------------------------- the facade


@pytest.mark.parametrize("backend", ("torch", "triton"))
def test_the_facade_prefills_a_long_prompt_in_16_chunks_exactly(backend) -> None:
    """The same 16 chunks through ``HiSparseRuntime.resolve_prefill`` (request ids, one per
    query token; pending table changes flushed by the call), checked against the dense
    oracle for every layer of both index groups."""
    kvc, config = make_plan(max_model_len=264, staging_rows=256, device_blocks=190)
    gen = torch.Generator().manual_seed(7)
    with HiSparseRuntime(kvc, config, max_num_seqs=2, device="cpu", backend=backend,
                         free_block_watermark=1.0) as rt:
        oracle = DenseOracle(rt, seed=3)
        rt.add_request("long", 256, 4)
        oracle.add("long")
        for k in range(16):
            oracle.write("long", rt.append_slots("long", 16))
            ids = ["long"] * 16
            positions = torch.arange(16 * k, 16 * (k + 1))
            topk = (torch.rand(16, TOPK, generator=gen) * (positions[:, None] + 1)).long()
            for leader in rt.leaders:
                rows = rt.resolve_prefill(leader, ids, topk)
                oracle.check_resolve(leader, ids, topk, rows)
            rt.commit()
        assert rt.scheduler.unpinned_pages("long") >= 56
        assert int(rt.worker.prefill_counts[1]) > 64


def test_the_facade_refuses_bad_prefill_calls_and_changes_nothing() -> None:
    kvc, config = make_plan(max_model_len=264, staging_rows=8, device_blocks=190)
    with HiSparseRuntime(kvc, config, max_num_seqs=2, device="cpu",
                         free_block_watermark=1.0) as rt:
        rt.add_request("a", 128, 4)
        for _ in range(6):
            rt.append_slots("a", 16)
            rt.commit()
        rt.append_slots("a", 16)
        leader = rt.leaders[0]
        topk = torch.arange(16 * TOPK).view(16, TOPK) % 96
        rt.resolve_prefill(leader, ["a"] * 16, topk[:, :1] * 0)   # flushes; fits
        before = rt._debug_snapshot()
        for call, error, match in (
                (lambda: rt.resolve_prefill(leader, ["a"] * 15, topk), ValueError, "16 rows"),
                (lambda: rt.resolve_prefill(leader, ["b"] * 16, topk), UnknownRequestError,
                 "'b'"),
                (lambda: rt.resolve_prefill(leader, "a" * 16, topk), ValueError, "list or"),
                (lambda: rt.resolve_prefill(leader, ["a"] * 16, topk.float()), ValueError,
                 "integer positions"),
                (lambda: rt.resolve_prefill("nope", ["a"] * 16, topk), ValueError, "leader"),
                (lambda: rt.resolve_prefill(leader, ["a"] * 16, topk), PrefillStagingError,
                 "holds 8")):
            with pytest.raises(error, match=match):
                call()
            assert rt._debug_snapshot() == before
